#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace attnforge::detail {

struct CudaDeviceInfo {
  int id;
  std::string name;
  int major, minor;
  int sms;
  size_t memory_bytes;
  size_t l2_bytes;
};

// Empty when no driver or device is present.
std::vector<CudaDeviceInfo> cuda_devices();

}  // namespace attnforge::detail
