// Python arrays -> TensorView. Anything with __dlpack__ (numpy, torch, cupy, jax) goes through nanobind's DLPack
// import and attnforge::from_dlpack, so dtype and device rules and their messages are the C++ library's. Two
// shortcuts, both ending in from_dlpack too: numpy arrays are read through numpy's C API (also giving the ml_dtypes
// types bfloat16 and fp8, which numpy cannot export through DLPack), and torch tensors from their attributes
// (torch's __dlpack__ is a Python method costing microseconds per call). A build without numpy's headers reads
// ml_dtypes arrays as same-sized integers and relabels them.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "attnforge/tensor.h"

namespace attnforge::python {

// Called once when the module is imported.
void init_arrays();

// `name` names the argument in error messages. Throws attnforge::Error for arrays attnforge cannot represent.
TensorView view_of(nanobind::handle obj, const char* name);
// None (or no object) gives an undefined view: an optional argument left out.
TensorView optional_view(nanobind::handle obj, const char* name);

// How torch tensors are read: "C++ (attnforge._torch_reader, torch <version>)" when the optional reader module is
// built against the running torch, else "attributes: <why not the reader>". Asks once torch is imported.
std::string torch_reader_status();

}  // namespace attnforge::python
