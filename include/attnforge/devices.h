// The devices this build can see at run time.
#pragma once

#include <string>
#include <vector>

#include "attnforge/tensor.h"

namespace attnforge {

struct DeviceInfo {
  Device device;
  std::string name;         // "cpu" or the GPU's name
  std::string description;  // threads and SIMD for the CPU; compute capability, SMs and memory for a GPU
  bool attention = false;   // whether attention runs on it in this build
};

std::vector<DeviceInfo> available_devices();
// Build facts: version, commit, compiler, CUDA on/off and target architectures.
std::string build_info();
// The commit this library was built from (12 hex digits, or ATTNFORGE_COMMIT's value for a copied tree, or
// "unknown"); read at build time, never at configure time.
const char* git_commit();

}  // namespace attnforge
