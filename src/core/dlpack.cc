#include "attnforge/dlpack.h"

#include "core/check.h"

namespace attnforge {

namespace {
// DLPack 1.x type codes for fp8 (older dlpack.h headers stop at kDLComplex/kDLBool).
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;

DType dtype_from(const DLDataType& t, const char* name) {
  if (t.lanes != 1) detail::fail_arg("{}: DLPack dtype with {} lanes; expected 1", name, t.lanes);
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::kFloat32;
      if (t.bits == 16) return DType::kFloat16;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBFloat16;
      break;
    case kDLInt:
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::kUInt8;
      break;
    case kDLFloat8E4M3FN:
      if (t.bits == 8) return DType::kFloat8E4M3;
      break;
    case kDLFloat8E5M2:
      if (t.bits == 8) return DType::kFloat8E5M2;
      break;
    default: break;
  }
  detail::fail_arg("{}: DLPack dtype (code {}, {} bits) is not accepted; expected one of {{float32, float16, "
                   "bfloat16, float8_e4m3fn, float8_e5m2, int32, int64, uint8}}",
                   name, static_cast<int>(t.code), static_cast<int>(t.bits));
}

DLDataType dtype_to(DType t) {
  switch (t) {
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kFloat8E4M3: return {kDLFloat8E4M3FN, 8, 1};
    case DType::kFloat8E5M2: return {kDLFloat8E5M2, 8, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kUInt8: return {kDLUInt, 8, 1};
  }
  return {kDLFloat, 32, 1};
}
}  // namespace

TensorView from_dlpack(const DLTensor& t, const char* name) {
  TensorView v;
  if (t.ndim < 0 || t.ndim > kMaxDims) detail::fail_arg("{}: {} dimensions; expected 0 to {}", name, t.ndim, kMaxDims);
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: v.device = Device::cpu(); break;
    case kDLCUDA:
    case kDLCUDAManaged: v.device = Device::cuda(t.device.device_id); break;
    default:
      detail::fail_arg("{}: DLPack device type {} is not accepted; expected one of {{cpu, cuda, cuda_host, cuda_managed}}",
                       name, static_cast<int>(t.device.device_type));
  }
  v.dtype = dtype_from(t.dtype, name);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.ndim = t.ndim;
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides ? t.strides[i] : stride;
    stride *= t.shape[i];
  }
  return v;
}

DLTensor to_dlpack(TensorView& t) {
  DLTensor d{};
  d.data = t.data;
  d.device = {t.device.type == DeviceType::kCUDA ? kDLCUDA : kDLCPU, t.device.id};
  d.ndim = t.ndim;
  d.dtype = dtype_to(t.dtype);
  d.shape = t.shape;
  d.strides = t.strides;
  d.byte_offset = 0;
  return d;
}

}  // namespace attnforge
