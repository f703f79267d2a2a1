// The interface between attnforge._C and the optional module attnforge._torch_reader (torch_reader.cc), which is
// built against the torch found at build time and reads a torch tensor's pointer, device, dtype, shape and strides
// from its C++ object in one call instead of six Python attribute reads. attnforge._C finds the reader through a
// capsule named kTorchReaderCapsule holding a TorchReader, and uses it only when the running torch is the build's.
#pragma once

#include <Python.h>

#include <cstdint>

namespace attnforge::python {

constexpr int kTorchReaderMaxDims = 8;
constexpr const char* kTorchReaderCapsule = "attnforge._torch_reader.read";

struct TorchTensorInfo {
  void* data;
  int32_t device_type;  // DLPack: 1 CPU, 2 CUDA; 0 for another device
  int32_t device_id;
  uint8_t code, bits;   // DLPack dtype code and bits (lanes 1); bits 0 for a dtype outside attnforge's set
  int32_t ndim;         // -1 when more than kTorchReaderMaxDims
  int64_t shape[kTorchReaderMaxDims];
  int64_t strides[kTorchReaderMaxDims];
};

// Returns 1 and fills `info` for a torch tensor, 0 for any other object (no Python error is set).
using TorchReader = int (*)(PyObject* obj, TorchTensorInfo* info);

}  // namespace attnforge::python
