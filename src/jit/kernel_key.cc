#include "jit/kernel_key.h"

#include <fmt/format.h>

#include "core/check.h"

namespace attnforge::jit {

namespace {

// Short dtype names for kernel names and the template arguments of DecodeTraits.
const char* short_name(DType t) {
  switch (t) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    default: return "?";
  }
}
const char* elem_type(DType t) {
  switch (t) {
    case DType::kFloat16: return "attnforge::cuda::F16";
    case DType::kFloat8E4M3: return "attnforge::cuda::E4M3";
    case DType::kFloat8E5M2: return "attnforge::cuda::E5M2";
    default: return "attnforge::cuda::Bf16";
  }
}

}  // namespace

std::string KernelKey::name() const {
  std::string arch_short = arch;
  if (arch_short.rfind("sm_", 0) == 0) arch_short.erase(2, 1);  // "sm90a"
  const std::string variant_part = variant == "builtin" ? "" : "_" + variant;
  const std::string kv_part = kv_dtype == q_dtype ? "" : std::string("_") + short_name(kv_dtype);
  return fmt::format("decode{}_d{}_{}{}_st{}_{}", variant_part, head_dim_qk, short_name(q_dtype), kv_part, tile.stages,
                     arch_short);
}

void KernelKey::validate() const {
  if (family != KernelFamily::kDecode)
    detail::fail(ErrorKind::kUnsupported, "kernel family {}: the run-time compiler builds {{decode}}",
                 static_cast<int>(family));
  if (variant != "builtin")
    detail::fail(ErrorKind::kUnsupported, "variant {}: custom variants are not built yet; accepted: {{builtin}}",
                 variant);
  if (q_dtype != DType::kBFloat16 && q_dtype != DType::kFloat16)
    detail::fail(ErrorKind::kUnsupported, "q_dtype {}: the decode kernel takes {{bfloat16, float16}}",
                 to_string(q_dtype));
  const bool fp8 = cuda::is_fp8(kv_dtype);
  if (kv_dtype != q_dtype && !fp8)
    detail::fail(ErrorKind::kUnsupported,
                 "kv_dtype {} with q_dtype {}: the decode kernel takes K/V in {{{}, float8_e4m3, float8_e5m2}}",
                 to_string(kv_dtype), to_string(q_dtype), to_string(q_dtype));
  if (head_dim_qk != head_dim_vo || (head_dim_qk != 64 && head_dim_qk != 128 && head_dim_qk != 256))
    detail::fail(ErrorKind::kUnsupported,
                 "head_dim {}/{}: the decode kernel takes equal Q/K and V head dims in {{64, 128, 256}}", head_dim_qk,
                 head_dim_vo);
  if (tile.stages < 2 || tile.stages > (fp8 ? 4 : 3))
    detail::fail(ErrorKind::kUnsupported, "tile.stages {}: the decode kernel takes {{2, 3}}{}", tile.stages,
                 fp8 ? ", and {2, 3, 4} with fp8 K/V" : " ({2, 3, 4} with fp8 K/V)");
  if (arch.rfind("sm_", 0) != 0)
    detail::fail(ErrorKind::kUnsupported, "arch '{}': expected a real architecture such as sm_80 or sm_90a", arch);
}

KernelSource KernelKey::render() const {
  validate();
  KernelSource s;
  s.name = name();
  s.arch = arch;
  s.warmup_command = warmup_command();
  const std::string traits = fmt::format("attnforge::cuda::DecodeTraits<{}, {}, {}, {}>", head_dim_qk,
                                         elem_type(q_dtype), tile.stages, elem_type(kv_dtype));
  s.entry_points = {fmt::format("&attnforge::cuda::decode_kernel<{}>", traits), "&attnforge::cuda::merge_kernel"};
  s.source = fmt::format(
      "// attnforge run-time kernel {}: family decode, variant {}, q {}, kv {}, head_dim {}/{}, stages {}, {}\n"
      "#include \"backends/cuda/decode/decode_kernel.cuh\"\n"
      "#include \"backends/cuda/merge/merge_kernel.cuh\"\n"
      "template __global__ void attnforge::cuda::decode_kernel<{}>(const attnforge::AttentionParams);\n",
      s.name, variant, to_string(q_dtype), to_string(kv_dtype), head_dim_qk, head_dim_vo, tile.stages, arch, traits);
  return s;
}

std::string KernelKey::warmup_command() const {
  return fmt::format("attnforge warmup --arch {} --head-dim {} --dtype {} --kv-dtype {}", arch, head_dim_qk,
                     short_name(q_dtype), kv_dtype == q_dtype ? "same" : short_name(kv_dtype));
}

KernelKey decode_key(const AttentionShape& shape, const std::string& arch) {
  return decode_key(shape, arch, default_decode_tile(shape.kv_dtype));
}

KernelKey decode_key(const AttentionShape& shape, const std::string& arch, DecodeTile tile) {
  KernelKey k;
  k.q_dtype = shape.q_dtype;
  k.kv_dtype = shape.kv_dtype;
  k.head_dim_qk = shape.head_dim_qk;
  k.head_dim_vo = shape.head_dim_vo > 0 ? shape.head_dim_vo : shape.head_dim_qk;
  k.tile = tile;
  k.arch = arch;
  k.validate();
  return k;
}

}  // namespace attnforge::jit
