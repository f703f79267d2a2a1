// Page-locked host memory that a plan's metadata and page table pass through on their way to the GPU
// (attnforge::upload_plan copies from it asynchronously). Two slots are used in turn, each guarded by a CUDA event
// recorded after the copies that read it, so plan() never synchronizes: it only waits if the copy made two plans
// ago has not run yet.
#pragma once

#include <cstddef>

#include "attnforge/ops.h"

namespace attnforge::python {

class PinnedStaging {
 public:
  PinnedStaging() = default;
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  ~PinnedStaging();

  // A slot of at least `bytes` bytes that no pending copy reads, on CUDA device `device`.
  void* acquire(size_t bytes, int device);
  // Marks the end of the copies just enqueued on `stream` from the slot acquire() returned.
  void release(Stream stream);

 private:
  struct Slot {
    void* data = nullptr;
    size_t bytes = 0;
    void* done = nullptr;  // cudaEvent_t
  };
  Slot slots_[2];
  int current_ = -1;
  int device_ = -1;
};

// Copies `bytes` from page-locked host memory to device memory, asynchronously on `stream`.
void copy_to_device_async(void* dst, const void* src, size_t bytes, int device, Stream stream);

}  // namespace attnforge::python
