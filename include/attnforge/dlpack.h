// Conversion between TensorView and DLPack's DLTensor. fp8 uses DLPack 1.x type codes (kDLFloat8_e4m3fn = 10,
// kDLFloat8_e5m2 = 12), which older dlpack.h headers do not name.
#pragma once

#include <dlpack/dlpack.h>

#include "attnforge/tensor.h"

namespace attnforge {

// Throws Error (naming `name`) for dtypes, devices or ranks attnforge cannot represent.
TensorView from_dlpack(const DLTensor& t, const char* name = "tensor");
// The DLTensor's shape and strides point into `t`, which must outlive it.
DLTensor to_dlpack(TensorView& t);

}  // namespace attnforge
