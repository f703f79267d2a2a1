#include "staging.h"

#include <algorithm>

#include "core/check.h"

#if ATTNFORGE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace attnforge::python {

#if ATTNFORGE_WITH_CUDA
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) detail::fail(ErrorKind::kBackend, "{}: {} ({})", what, cudaGetErrorString(e), static_cast<int>(e));
}

// Makes `device` current for the scope and restores the caller's device (torch keeps its own).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

}  // namespace

PinnedStaging::~PinnedStaging() {
  for (Slot& s : slots_) {
    if (s.done) {
      cudaEventSynchronize(static_cast<cudaEvent_t>(s.done));
      cudaEventDestroy(static_cast<cudaEvent_t>(s.done));
    }
    if (s.data) cudaFreeHost(s.data);
  }
}

void* PinnedStaging::acquire(size_t bytes, int device) {
  if (device_ >= 0 && device != device_)
    detail::fail_arg("staging: device cuda:{}; this wrapper staged plans for cuda:{}", device, device_);
  device_ = device;
  DeviceScope scope(device);
  current_ = (current_ + 1) % 2;
  Slot& s = slots_[current_];
  if (s.done == nullptr) check(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&s.done), cudaEventDisableTiming), "cudaEventCreate");
  // Normally long complete: the copy made two plans ago.
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(s.done)), "cudaEventSynchronize (staging slot)");
  if (s.bytes < bytes) {
    if (s.data) check(cudaFreeHost(s.data), "cudaFreeHost");
    s.data = nullptr;
    const size_t grown = std::max<size_t>({bytes, 2 * s.bytes, size_t{64} << 10});
    check(cudaHostAlloc(&s.data, grown, cudaHostAllocDefault), "cudaHostAlloc (plan staging)");
    s.bytes = grown;
  }
  return s.data;
}

void PinnedStaging::release(Stream stream) {
  DeviceScope scope(device_);
  check(cudaEventRecord(static_cast<cudaEvent_t>(slots_[current_].done), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord (staging slot)");
}

void copy_to_device_async(void* dst, const void* src, size_t bytes, int device, Stream stream) {
  DeviceScope scope(device);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync (plan metadata to the device)");
}

#else  // a build without CUDA never plans for a GPU: the selector refuses CUDA devices before staging is needed

PinnedStaging::~PinnedStaging() = default;

void* PinnedStaging::acquire(size_t, int device) {
  detail::fail(ErrorKind::kUnsupported, "device cuda:{}: this build of attnforge has no CUDA backend", device);
}

void PinnedStaging::release(Stream) {}

void copy_to_device_async(void*, const void*, size_t, int device, Stream) {
  detail::fail(ErrorKind::kUnsupported, "device cuda:{}: this build of attnforge has no CUDA backend", device);
}

#endif

}  // namespace attnforge::python
