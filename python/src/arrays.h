// Python arrays -> TensorView. Anything with __dlpack__ (numpy, torch, cupy, jax) goes through nanobind's DLPack
// import and attnforge::from_dlpack, so dtype and device rules and their messages are the C++ library's. Two
// shortcuts: torch tensors are read from their attributes (torch's __dlpack__ is a Python method costing
// microseconds per call), and numpy arrays of ml_dtypes types (bfloat16, fp8), which numpy cannot export through
// DLPack, are read as same-sized integers and given their real dtype.
#pragma once

#include <nanobind/nanobind.h>

#include "attnforge/tensor.h"

namespace attnforge::python {

// `name` names the argument in error messages. Throws attnforge::Error for arrays attnforge cannot represent.
TensorView view_of(nanobind::handle obj, const char* name);
// None (or no object) gives an undefined view: an optional argument left out.
TensorView optional_view(nanobind::handle obj, const char* name);

}  // namespace attnforge::python
