// Non-owning tensor views: a data pointer, dtype, shape, strides in elements and the device holding the data.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>

#include "attnforge/kernel/types.h"

namespace attnforge {

enum class DeviceType : int32_t { kCPU = 1, kCUDA = 2 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t id = 0;
  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int32_t id = 0) { return {DeviceType::kCUDA, id}; }
  bool operator==(const Device& o) const { return type == o.type && id == o.id; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;  // 0: not given (an optional argument left out)
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  Device device{};

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu());
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides,
             Device device = Device::cpu());

  bool defined() const { return ndim > 0; }
  int64_t numel() const;
  bool is_contiguous() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

std::string to_string(DType t);
std::string to_string(Device d);
std::string to_string(KVLayout l);
std::string to_string(KVFormat f);
std::string shape_string(const TensorView& t);    // "[3, 4, 128]"
std::string strides_string(const TensorView& t);  // "(512, 128, 1)"

}  // namespace attnforge
