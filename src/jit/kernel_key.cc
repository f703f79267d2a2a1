#include "jit/kernel_key.h"

#include <fmt/format.h>

#include "core/check.h"

namespace attnforge::jit {

namespace {

// Short dtype names for kernel names and the template argument of DecodeTraits.
const char* short_name(DType t) { return t == DType::kFloat16 ? "fp16" : t == DType::kBFloat16 ? "bf16" : "?"; }
const char* elem_type(DType t) { return t == DType::kFloat16 ? "attnforge::cuda::F16" : "attnforge::cuda::Bf16"; }

}  // namespace

std::string KernelKey::name() const {
  std::string arch_short = arch;
  if (arch_short.rfind("sm_", 0) == 0) arch_short.erase(2, 1);  // "sm90a"
  const std::string variant_part = variant == "builtin" ? "" : "_" + variant;
  return fmt::format("decode{}_d{}_{}_st{}_{}", variant_part, head_dim_qk, short_name(q_dtype), tile.stages,
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
  if (kv_dtype != q_dtype)
    detail::fail(ErrorKind::kUnsupported,
                 "kv_dtype {} with q_dtype {}: the decode kernel needs K/V in the dtype of Q (fp8 K/V is not built "
                 "for CUDA yet)",
                 to_string(kv_dtype), to_string(q_dtype));
  if (head_dim_qk != head_dim_vo || (head_dim_qk != 64 && head_dim_qk != 128 && head_dim_qk != 256))
    detail::fail(ErrorKind::kUnsupported,
                 "head_dim {}/{}: the decode kernel takes equal Q/K and V head dims in {{64, 128, 256}}", head_dim_qk,
                 head_dim_vo);
  if (tile.stages != 2 && tile.stages != 3)
    detail::fail(ErrorKind::kUnsupported, "tile.stages {}: the decode kernel takes {{2, 3}}", tile.stages);
  if (arch.rfind("sm_", 0) != 0)
    detail::fail(ErrorKind::kUnsupported, "arch '{}': expected a real architecture such as sm_80 or sm_90a", arch);
}

KernelSource KernelKey::render() const {
  validate();
  KernelSource s;
  s.name = name();
  s.arch = arch;
  s.warmup_command = warmup_command();
  const std::string traits =
      fmt::format("attnforge::cuda::DecodeTraits<{}, {}, {}>", head_dim_qk, elem_type(q_dtype), tile.stages);
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
  return fmt::format("attnforge warmup --arch {} --head-dim {} --dtype {}", arch, head_dim_qk, short_name(q_dtype));
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
