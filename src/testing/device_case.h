// A Case mirrored in GPU memory: every buffer copied to the device and every view re-pointed at the copy, so
// the same adversarial data (shuffled pages, NaN-filled spares, guards) runs on the CUDA backend. Built only
// with CUDA.
#pragma once

#include <vector>

#include "testing/cases.h"

namespace attnforge::testing {

class DeviceCase {
 public:
  DeviceCase(const Case& host, int device = 0);
  ~DeviceCase();
  DeviceCase(const DeviceCase&) = delete;
  DeviceCase& operator=(const DeviceCase&) = delete;

  // Views of the device copy (same shapes and strides as the host case's).
  TensorView q, out, lse;
  PagedKVCache paged;
  RaggedKV ragged;
  AttentionOptions options;

  // Host buffer -> its device copy. Rewrites any view that points into one of the case's buffers.
  TensorView to_device(const TensorView& v) const;
  // Copies the host case's current out/lse buffers (guards included) to the device, e.g. after poisoning.
  void upload_outputs(const Case& host) const;
  // Copies the device out/lse buffers (guards included) back into the host case, for check_case.
  void download_outputs(Case& host) const;
  // Copies one host buffer of the case to its device copy again (after the test edited it on the host).
  void upload(const Buffer& host_buffer) const;

 private:
  struct Mirror {
    const uint8_t* host;
    size_t bytes;
    uint8_t* device;
  };
  const Mirror* find(const void* host_ptr) const;
  std::vector<Mirror> mirrors_;
  const Case* host_;
  int device_;
};

// Plans, uploads and runs a case on the GPU with exactly-sized workspace and staging, waits, copies the
// outputs back. Returns the plan.
AttentionPlan plan_and_run_cuda(Case& host, const DeviceCase& dev);

}  // namespace attnforge::testing
