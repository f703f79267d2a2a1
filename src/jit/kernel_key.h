// Specialization keys of the run-time compiled kernels. A key names everything that selects a kernel binary;
// run-time values (lengths, batch size, page size, page counts, head counts, output dtype, options read from
// params) are not in it. A key renders both the translation unit NVRTC compiles and a readable kernel name; the
// cache key hashes what the key renders (kernel_cache.h), never the key's name.
#pragma once

#include <string>

#include "attnforge/config.h"
#include "backends/cuda/decode/decode_defaults.cuh"
#include "jit/hash.h"
#include "jit/nvrtc_compiler.h"

namespace attnforge::jit {

enum class KernelFamily : int32_t {
  kDecode = 0,   // batch decode (backends/cuda/decode/decode_kernel.cuh)
  kPrefill = 1,  // batch prefill and append (backends/cuda/prefill/prefill_kernel.cuh)
};
const char* to_string(KernelFamily family);  // "decode", "prefill"

// The tile configuration of a decode kernel: 4 warps of 16 tokens per 64-token K/V tile over 16 query rows are
// fixed by the kernel's design; the depth of the cp.async pipeline is free.
struct DecodeTile {
  int32_t stages = cuda::kDefaultDecodeStages;  // 2 or 3; fp8 K/V: 2, 3 or 4
  bool operator==(const DecodeTile&) const = default;
};

// The tile configuration run() launches for K/V of `kv_dtype` (decode_defaults.cuh).
inline DecodeTile default_decode_tile(DType kv_dtype) { return {cuda::default_decode_stages(kv_dtype)}; }

// The tile configuration of a prefill kernel. Rows per CTA, warps and the softmax step (K/V tokens per step) follow
// from the head dim (backends/cuda/prefill/tile_config.cuh: what fits the register file); free is how many steps
// one cp.async stage holds (PrefillTraits' kStageTokens = stage_steps x the step), which also sets the stage count
// (3 stages of one step up to head_dim 128, else 2).
struct PrefillTile {
  int32_t stage_steps = 1;  // 1 (what the nvcc build instantiates) or 2
  // Packed query rows per CTA: 0 for the head dim's (prefill_rows: 128 up to head_dim 128, 64 at 256), or
  // cuda::kPrefillShortRows (64) below head_dim 256: the tile run() picks for plans of short query tiles.
  int32_t rows = 0;
  bool operator==(const PrefillTile&) const = default;
};

struct KernelKey {
  KernelFamily family = KernelFamily::kDecode;
  // The variant: "builtin" (the options of kernel/variant.h, read at run time), or a custom variant's struct name
  // with its source (decode and prefill without fused RoPE; set both with set_variant, which also fills
  // variant_hash).
  std::string variant = "builtin";
  std::string variant_source;
  Hash128 variant_hash;
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int32_t head_dim_qk = 128;
  int32_t head_dim_vo = 128;
  // Prefill only: RoPE fused into the kernel (PrefillTraits' kRope, its own instantiation so the common case does
  // not carry its registers). The decode kernel reads RoPE from params at run time, so a decode key keeps false.
  bool rope = false;
  DecodeTile decode_tile;    // decode keys; a prefill key leaves it at DecodeTile{}
  PrefillTile prefill_tile;  // prefill keys; a decode key leaves it at its default
  std::string arch = "sm_90a";  // arch_for_device()

  bool operator==(const KernelKey&) const = default;

  // A custom variant: `name` is its struct, `source` its definition (attnforge/variant.h).
  void set_variant(const std::string& name, const std::string& source);

  // "decode_d128_bf16_st2_sm90a", "prefill_d128_bf16_rope_sm90a"; fp8 K/V adds its format
  // ("decode_d128_bf16_e4m3_st4_sm90a"), a prefill tile other than the default "_stage64" (its K/V tokens per
  // stage), a custom variant its name. Unique among valid keys.
  std::string name() const;
  // Throws kUnsupported naming the field, its value and what is accepted.
  void validate() const;
  // The translation unit; its one entry point (kAttentionEntry) is the decode or prefill kernel. The split-KV merge
  // kernels both families launch are one module of their own per architecture (merge_source).
  KernelSource render() const;
  // K/V tokens per cp.async stage of a prefill key: PrefillTraits' kStageTokens (stage_steps softmax steps).
  int32_t prefill_stage_tokens() const;
  // Packed query rows per CTA of a prefill key: PrefillTraits' kRows.
  int32_t prefill_rows() const;
  // The `attnforge warmup` command that compiles this key (its default set holds every key run() uses).
  std::string warmup_command() const;
};

// The entry point of a decode or prefill module.
constexpr int kAttentionEntry = 0;

// The split-KV merge kernel of `arch` (backends/cuda/merge/merge_kernel.cuh), which run() launches after either
// family's kernel: one module per architecture, "merge_sm90a", compiled once rather than in every decode and prefill
// module (the merge kernels were half of each one's compile time); with `streamed`, the streamed merge
// (merge_stream_kernel, "merge_stream_sm90a"), which only ATTNFORGE_DECODE_KERNEL_MERGE=stream launches. Its one
// entry point is kMergeEntry. Throws kUnsupported for an arch not "sm_...".
KernelSource merge_source(const std::string& arch, bool streamed = false);
constexpr int kMergeEntry = 0;

// The decode key for an attention shape on `arch` (with the tile run() launches, or `tile`); throws kUnsupported
// when no decode kernel serves it.
KernelKey decode_key(const AttentionShape& shape, const std::string& arch);
KernelKey decode_key(const AttentionShape& shape, const std::string& arch, DecodeTile tile);
// The prefill key for an attention shape on `arch`, with or without RoPE fused; throws kUnsupported when no prefill
// kernel serves it. A tile's rows equal to the head dim's default are stored as 0, so one kernel has one key.
KernelKey prefill_key(const AttentionShape& shape, const std::string& arch, bool rope, PrefillTile tile = {});

}  // namespace attnforge::jit
