#pragma once

#include <cuda_runtime.h>

#include "attnforge/error.h"

// Every CUDA runtime call and every launch is checked; a failure becomes attnforge::Error(kBackend) naming the
// call, the error and where it happened.
#define ATTNFORGE_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                         \
    const cudaError_t attnforge_err_ = (expr);                                                                 \
    if (attnforge_err_ != cudaSuccess)                                                                         \
      throw ::attnforge::Error(::attnforge::ErrorKind::kBackend,                                               \
                               std::string(#expr) + ": " + cudaGetErrorName(attnforge_err_) + " (" +         \
                                   cudaGetErrorString(attnforge_err_) + ") at " + __FILE__ + ":" +           \
                                   std::to_string(__LINE__));                                                  \
  } while (0)
