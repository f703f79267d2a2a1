#include "jit/kernel_key.h"

#include <fmt/format.h>

#include "backends/cuda/prefill/tile_config.cuh"
#include "core/check.h"

namespace attnforge::jit {

namespace {

// Short dtype names for kernel names and the element type arguments of the traits.
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

// "sm_90a" -> "sm90a", for kernel names.
std::string short_arch(const std::string& arch) {
  std::string s = arch;
  if (s.rfind("sm_", 0) == 0) s.erase(2, 1);
  return s;
}

void check_arch(const std::string& arch) {
  if (arch.rfind("sm_", 0) != 0)
    detail::fail(ErrorKind::kUnsupported, "arch '{}': expected a real architecture such as sm_80 or sm_90a", arch);
}

}  // namespace

const char* to_string(KernelFamily family) { return family == KernelFamily::kPrefill ? "prefill" : "decode"; }

std::string KernelKey::name() const {
  const std::string arch_short = short_arch(arch);
  // A custom variant's name carries 8 hex digits of its source's hash: two sources under one name get two kernels.
  const std::string variant_part = variant == "builtin" ? "" : "_" + variant + "_" + variant_hash.hex().substr(0, 8);
  if (family == KernelFamily::kPrefill) {
    const std::string tile_part =
        (prefill_tile.stage_steps == PrefillTile{}.stage_steps ? "" : fmt::format("_stage{}", prefill_stage_tokens())) +
        (prefill_tile.rows == 0 ? "" : fmt::format("_rows{}", prefill_tile.rows));
    return fmt::format("prefill{}_d{}_{}{}{}_{}", variant_part, head_dim_qk, short_name(q_dtype), rope ? "_rope" : "",
                       tile_part, arch_short);
  }
  const std::string kv_part = kv_dtype == q_dtype ? "" : std::string("_") + short_name(kv_dtype);
  return fmt::format("decode{}_d{}_{}{}_st{}_{}", variant_part, head_dim_qk, short_name(q_dtype), kv_part,
                     decode_tile.stages, arch_short);
}

void KernelKey::validate() const {
  if (family != KernelFamily::kDecode && family != KernelFamily::kPrefill)
    detail::fail(ErrorKind::kUnsupported, "kernel family {}: the run-time compiler builds {{decode, prefill}}",
                 static_cast<int>(family));
  const char* kernel = to_string(family);
  if (variant != "builtin") {
    if (family == KernelFamily::kPrefill && rope)
      detail::fail(ErrorKind::kUnsupported, "variant {} with rope true: a custom variant does its own RoPE in its "
                   "query and key transforms (BuiltinVariant shows how); a custom prefill key takes rope {{false}}",
                   variant);
    if (variant_source.empty() || variant_hash == Hash128{})
      detail::fail(ErrorKind::kUnsupported, "variant {}: no source; set custom variants with KernelKey::set_variant",
                   variant);
    if (kv_dtype != q_dtype)
      detail::fail(ErrorKind::kUnsupported, "variant {} with kv_dtype {}: custom variants take K/V in Q's dtype {{{}}}",
                   variant, to_string(kv_dtype), to_string(q_dtype));
  } else if (!variant_source.empty()) {
    detail::fail(ErrorKind::kUnsupported, "variant builtin: takes no variant_source");
  }
  if (q_dtype != DType::kBFloat16 && q_dtype != DType::kFloat16)
    detail::fail(ErrorKind::kUnsupported, "q_dtype {}: the {} kernel takes {{bfloat16, float16}}", to_string(q_dtype),
                 kernel);
  const bool fp8 = cuda::is_fp8(kv_dtype);
  if (family == KernelFamily::kDecode && kv_dtype != q_dtype && !fp8)
    detail::fail(ErrorKind::kUnsupported,
                 "kv_dtype {} with q_dtype {}: the decode kernel takes K/V in {{{}, float8_e4m3, float8_e5m2}}",
                 to_string(kv_dtype), to_string(q_dtype), to_string(q_dtype));
  if (family == KernelFamily::kPrefill && kv_dtype != q_dtype)
    detail::fail(ErrorKind::kUnsupported,
                 "kv_dtype {} with q_dtype {}: the prefill kernel takes K/V in {{{}}} (fp8 K/V is not built for CUDA "
                 "prefill yet)",
                 to_string(kv_dtype), to_string(q_dtype), to_string(q_dtype));
  if (head_dim_qk != head_dim_vo || (head_dim_qk != 64 && head_dim_qk != 128 && head_dim_qk != 256))
    detail::fail(ErrorKind::kUnsupported,
                 "head_dim {}/{}: the {} kernel takes equal Q/K and V head dims in {{64, 128, 256}}", head_dim_qk,
                 head_dim_vo, kernel);
  // The other family's fields stay at their defaults, so that one kernel has one key and one name.
  if (family == KernelFamily::kDecode) {
    if (decode_tile.stages < 2 || decode_tile.stages > (fp8 ? 4 : 3))
      detail::fail(ErrorKind::kUnsupported, "decode_tile.stages {}: the decode kernel takes {{2, 3}}{}",
                   decode_tile.stages, fp8 ? ", and {2, 3, 4} with fp8 K/V" : " ({2, 3, 4} with fp8 K/V)");
    if (rope)
      detail::fail(ErrorKind::kUnsupported,
                   "rope true: the decode kernel reads RoPE from params at run time; a decode key takes {{false}}");
    if (prefill_tile != PrefillTile{})
      detail::fail(ErrorKind::kUnsupported, "prefill_tile {{stage_steps {}, rows {}}}: a decode key takes the default "
                   "{{{}, {}}}", prefill_tile.stage_steps, prefill_tile.rows, PrefillTile{}.stage_steps,
                   PrefillTile{}.rows);
  } else {
    if (prefill_tile.stage_steps != 1 && prefill_tile.stage_steps != 2)
      detail::fail(ErrorKind::kUnsupported, "prefill_tile.stage_steps {}: the prefill kernel takes {{1, 2}}",
                   prefill_tile.stage_steps);
    if (prefill_tile.rows != 0 &&
        (prefill_tile.rows != cuda::kPrefillShortRows || cuda::prefill_rows(head_dim_qk) == cuda::kPrefillShortRows))
      detail::fail(ErrorKind::kUnsupported, "prefill_tile.rows {}: the prefill kernel at head_dim {} takes {{0 (its "
                   "{} rows){}}}", prefill_tile.rows, head_dim_qk, cuda::prefill_rows(head_dim_qk),
                   cuda::prefill_rows(head_dim_qk) == cuda::kPrefillShortRows
                       ? std::string()
                       : fmt::format(", {}", cuda::kPrefillShortRows));
    if (decode_tile != DecodeTile{})
      detail::fail(ErrorKind::kUnsupported, "decode_tile.stages {}: a prefill key takes the default {{{}}}",
                   decode_tile.stages, DecodeTile{}.stages);
  }
  check_arch(arch);
}

KernelSource KernelKey::render() const {
  validate();
  KernelSource s;
  s.name = name();
  s.arch = arch;
  s.warmup_command = warmup_command();
  s.default_device = variant != "builtin";
  if (s.default_device)
    s.warmup_command = "a run_variant() call with the cache mode on (custom variants are not in attnforge warmup)";
  const bool prefill = family == KernelFamily::kPrefill;
  const std::string traits =
      prefill ? fmt::format("attnforge::cuda::PrefillTraits<{}, {}, {}, {}, {}>", head_dim_qk, elem_type(q_dtype),
                            rope, prefill_stage_tokens(), prefill_rows())
              : fmt::format("attnforge::cuda::DecodeTraits<{}, {}, {}, {}>", head_dim_qk, elem_type(q_dtype),
                            decode_tile.stages, elem_type(kv_dtype));
  const bool custom = variant != "builtin";
  const std::string kernel =
      custom ? fmt::format("attnforge::cuda::{}_variant_kernel<{}, {}>", to_string(family), traits, variant)
             : fmt::format("attnforge::cuda::{}_kernel<{}>", to_string(family), traits);
  s.entry_points = {"&" + kernel};
  const std::string tile = prefill
                               ? fmt::format("rope {}, stage tokens {}, rows {}", rope ? "on" : "off",
                                             prefill_stage_tokens(), prefill_rows())
                               : fmt::format("stages {}", decode_tile.stages);
  s.source = fmt::format(
      "// attnforge run-time kernel {}: family {}, variant {}, q {}, kv {}, head_dim {}/{}, {}, {}\n"
      "#include \"backends/cuda/{}/{}_kernel.cuh\"\n"
      "{}"
      "template __global__ void {}(const attnforge::AttentionParams{});\n",
      s.name, to_string(family), variant, to_string(q_dtype), to_string(kv_dtype), head_dim_qk, head_dim_vo, tile,
      arch, to_string(family), to_string(family), custom ? "\n" + variant_source + "\n\n" : "", kernel,
      custom ? ", const attnforge::VariantArgs" : "");
  return s;
}

KernelSource merge_source(const std::string& arch, bool streamed) {
  check_arch(arch);
  KernelSource s;
  s.name = (streamed ? "merge_stream_" : "merge_") + short_arch(arch);
  s.arch = arch;
  s.warmup_command =
      streamed ? fmt::format("ATTNFORGE_DECODE_KERNEL_MERGE=stream attnforge warmup --arch {}", arch)
               : fmt::format("attnforge warmup --arch {} (any configuration's warm-up compiles it)", arch);
  s.entry_points = {streamed ? "&attnforge::cuda::merge_stream_kernel" : "&attnforge::cuda::merge_kernel"};
  s.source = fmt::format(
      "// attnforge run-time kernel {}: the split-KV {}, {}\n"
      "#define ATTNFORGE_MERGE_KERNELS {}\n"
      "#include \"backends/cuda/merge/merge_kernel.cuh\"\n",
      s.name, streamed ? "merge streamed beside the decode kernel" : "merge after the attention kernel", arch,
      streamed ? 2 : 1);
  return s;
}

void KernelKey::set_variant(const std::string& name, const std::string& source) {
  variant = name;
  variant_source = source;
  variant_hash = Hasher().field(name).field(source).digest();
}

int32_t KernelKey::prefill_stage_tokens() const {
  return prefill_tile.stage_steps * cuda::prefill_tile_tokens(head_dim_qk);
}

int32_t KernelKey::prefill_rows() const {
  return prefill_tile.rows > 0 ? prefill_tile.rows : cuda::prefill_rows(head_dim_qk);
}

std::string KernelKey::warmup_command() const {
  return fmt::format("attnforge warmup --arch {} --head-dim {} --dtype {} --kv-dtype {}", arch, head_dim_qk,
                     short_name(q_dtype), kv_dtype == q_dtype ? "same" : short_name(kv_dtype));
}

namespace {

KernelKey key_of(KernelFamily family, const AttentionShape& shape, const std::string& arch) {
  KernelKey k;
  k.family = family;
  k.q_dtype = shape.q_dtype;
  k.kv_dtype = shape.kv_dtype;
  k.head_dim_qk = shape.head_dim_qk;
  k.head_dim_vo = shape.head_dim_vo > 0 ? shape.head_dim_vo : shape.head_dim_qk;
  k.arch = arch;
  return k;
}

}  // namespace

KernelKey decode_key(const AttentionShape& shape, const std::string& arch) {
  return decode_key(shape, arch, default_decode_tile(shape.kv_dtype));
}

KernelKey decode_key(const AttentionShape& shape, const std::string& arch, DecodeTile tile) {
  KernelKey k = key_of(KernelFamily::kDecode, shape, arch);
  k.decode_tile = tile;
  k.validate();
  return k;
}

KernelKey prefill_key(const AttentionShape& shape, const std::string& arch, bool rope, PrefillTile tile) {
  KernelKey k = key_of(KernelFamily::kPrefill, shape, arch);
  k.rope = rope;
  k.prefill_tile = tile;
  if (k.prefill_tile.rows == cuda::prefill_rows(k.head_dim_qk)) k.prefill_tile.rows = 0;  // the default, one key
  k.validate();
  return k;
}

}  // namespace attnforge::jit
