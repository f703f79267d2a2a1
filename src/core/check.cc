#include "core/check.h"
#include "core/env.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace attnforge::detail {

std::string env_choice(const char* name, std::initializer_list<const char*> accepted, const char* unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  std::string set;
  for (const char* a : accepted) {
    if (std::string(a) == v) return v;
    set += set.empty() ? a : std::string(", ") + a;
  }
  fail_arg("{} '{}': expected one of {{{}}}", name, v, set);
}

int env_int(const char* name, int lo, int hi, int unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || errno != 0 || n < lo || n > hi)
    fail_arg("{} '{}': expected an integer in [{}, {}]", name, v, lo, hi);
  return static_cast<int>(n);
}

std::string dtype_set_string(std::initializer_list<DType> allowed) {
  std::string s = "{";
  for (DType t : allowed) {
    if (s.size() > 1) s += ", ";
    s += to_string(t);
  }
  return s + "}";
}

void expect_defined(const TensorView& t, const char* name) {
  if (!t.defined()) fail_arg("{}: required but not given", name);
  if (t.data == nullptr && t.numel() > 0) fail_arg("{}: data pointer is null for shape {}", name, shape_string(t));
}

void expect_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) == allowed.end())
    fail_arg("{}: dtype {} is not accepted; expected one of {}", name, to_string(t.dtype), dtype_set_string(allowed));
}

void expect_ndim(const TensorView& t, const char* name, int ndim, const char* layout) {
  if (t.ndim != ndim) fail_arg("{}: has {} dimensions (shape {}); expected {}: {}", name, t.ndim, shape_string(t), ndim, layout);
}

void expect_dim(const TensorView& t, const char* name, int dim, int64_t expected, const char* what) {
  if (t.shape[dim] != expected)
    fail_arg("{}: dimension {} is {} (shape {}); expected {} ({})", name, dim, t.shape[dim], shape_string(t), expected,
             what);
}

void expect_device(const TensorView& t, const char* name, Device device) {
  if (t.device != device)
    fail_arg("{}: is on {}; expected {} (all tensors of one call must be on one device)", name, to_string(t.device),
             to_string(device));
}

void expect_last_dim_contiguous(const TensorView& t, const char* name) {
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
    fail_arg("{}: last dimension has stride {} (strides {}); expected stride 1", name, t.strides[t.ndim - 1],
             strides_string(t));
  for (int i = 0; i < t.ndim; ++i)
    if (t.strides[i] < 0) fail_arg("{}: negative stride {} in dimension {}; expected strides >= 0", name, t.strides[i], i);
}

void expect_host(const TensorView& t, const char* name) {
  if (t.device.type != DeviceType::kCPU)
    fail_arg("{}: is on {}; plan() reads metadata on the host, expected cpu memory", name, to_string(t.device));
}

void expect_int32_vector(const TensorView& t, const char* name, int64_t len, Device device) {
  expect_defined(t, name);
  expect_device(t, name, device);
  expect_dtype(t, name, {DType::kInt32});
  expect_ndim(t, name, 1, "[n]");
  if (len >= 0 && t.shape[0] != len) fail_arg("{}: has {} elements; expected {}", name, t.shape[0], len);
  if (t.shape[0] > 1 && t.strides[0] != 1)
    fail_arg("{}: stride {}; expected a contiguous int32 vector", name, t.strides[0]);
}

std::span<const int32_t> host_int32(const TensorView& t, const char* name, int64_t expected_len) {
  expect_defined(t, name);
  expect_host(t, name);
  expect_int32_vector(t, name, expected_len, Device::cpu());
  return {t.ptr<const int32_t>(), static_cast<size_t>(t.shape[0])};
}

namespace {
// Byte range [lo, hi) a view can touch.
std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  int64_t hi = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return {base, base};
    hi += (t.shape[i] - 1) * t.strides[i];
  }
  return {base, base + static_cast<uintptr_t>((hi + 1) * dtype_bytes(t.dtype))};
}
}  // namespace

void expect_no_overlap(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name) {
  if (!out.defined() || !in.defined() || out.device != in.device) return;
  const auto [a0, a1] = byte_range(out);
  const auto [b0, b1] = byte_range(in);
  if (a0 < b1 && b0 < a1) fail_arg("{}: overlaps the memory of {}; outputs must not alias inputs", out_name, in_name);
}

}  // namespace attnforge::detail
