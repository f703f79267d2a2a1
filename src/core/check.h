// Validation helpers. Every message names the argument, the value found and what is accepted.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <span>
#include <string>

#include "attnforge/error.h"
#include "attnforge/tensor.h"

namespace attnforge::detail {

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(kind, fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail_arg(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(ErrorKind::kInvalidArgument, fmt::format(format, std::forward<Args>(args)...));
}

std::string dtype_set_string(std::initializer_list<DType> allowed);

void expect_defined(const TensorView& t, const char* name);
void expect_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
// ndim must equal `ndim`; `layout` names the axes, e.g. "[tokens, num_qo_heads, head_dim]".
void expect_ndim(const TensorView& t, const char* name, int ndim, const char* layout);
void expect_dim(const TensorView& t, const char* name, int dim, int64_t expected, const char* what);
void expect_device(const TensorView& t, const char* name, Device device);
// The last axis must have stride 1 (rows are read as contiguous vectors).
void expect_last_dim_contiguous(const TensorView& t, const char* name);
// Non-negative strides that never let two distinct valid indices meet is not checked; only sanity.
void expect_host(const TensorView& t, const char* name);
// A contiguous int32 vector [len] on `device` (len < 0: any length).
void expect_int32_vector(const TensorView& t, const char* name, int64_t len, Device device);
// An int32 host vector [n] read as a span.
std::span<const int32_t> host_int32(const TensorView& t, const char* name, int64_t expected_len);
// Rejects outputs that overlap an input's memory range (run() must not read what it writes).
void expect_no_overlap(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name);

}  // namespace attnforge::detail
