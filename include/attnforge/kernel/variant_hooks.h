// Attention variants as hook structs (issue 5; design in docs/design.md, "Custom variants"). NVRTC-clean.
//
// A variant derives from VariantBase, whose hooks are identities, and overrides the hooks it needs, statically.
// The loop that runs a variant (today: the CPU loop compiled at run time, backends/cpu/variant_loop.h) calls,
// for each query row and KV position:
//   query_transform once per query row (fp32 row, before the dot products), key_transform per K row,
//   s = sm_scale * k_scale * dot(q, k); logits_mask (false: the position is left out);
//   s = logits_transform(s); with kSoftmax, softmax over the kept s (plus the built-in sink, if given), else
//   p = s as is; o = sum p v; output_transform on the finished row.
// BuiltinVariant expresses the built-in options of VariantParams (causal, window, custom mask, soft-cap, ALiBi,
// RoPE) through the same hooks.
#pragma once

#include "attnforge/kernel/variant.h"

namespace attnforge {

constexpr int kMaxVariantScalars = 8;
constexpr int kMaxVariantTensors = 4;

// What a hook knows about the logit it is called for. q_pos and kv_pos are positions (bottom-right aligned, as
// in variant.h); q_token is the query's row within its request.
struct LogitIndex {
  int32_t request;
  int32_t q_token, q_pos, kv_pos, kv_len;
  int32_t qo_head, kv_head;
};

// The run's arguments a hook can read: the built-in options, and the user's extra scalars and tensors (passed to
// run_variant; tensors are raw pointers whose layout the variant defines).
struct VariantArgs {
  const VariantParams* options;
  float scalars[kMaxVariantScalars];
  int32_t num_scalars;
  void* tensors[kMaxVariantTensors];
  int32_t num_tensors;
};

struct VariantBase {
  static constexpr bool kSoftmax = true;
  ATTNFORGE_HOST_DEVICE static void query_transform(const VariantArgs&, const LogitIndex&, float*, int32_t) {}
  ATTNFORGE_HOST_DEVICE static void key_transform(const VariantArgs&, const LogitIndex&, float*, int32_t) {}
  ATTNFORGE_HOST_DEVICE static bool logits_mask(const VariantArgs&, const LogitIndex&) { return true; }
  ATTNFORGE_HOST_DEVICE static float logits_transform(const VariantArgs&, const LogitIndex&, float s) { return s; }
  ATTNFORGE_HOST_DEVICE static void output_transform(const VariantArgs&, const LogitIndex&, float*, int32_t) {}
};

struct BuiltinVariant : VariantBase {
  ATTNFORGE_HOST_DEVICE static void rope(const VariantArgs& a, const LogitIndex& i, float* x, int32_t pos) {
    const RopeParams& r = a.options->rope;
    if (!r.enabled) return;
    float freqs[256];  // rotary pairs: rotary_dim / 2 <= 256
    for (int32_t p = 0; p < r.rotary_dim / 2; ++p) freqs[p] = rope_frequency(r, p);
    rope_rotate(r, freqs, x, pos + (r.pos_offset ? r.pos_offset[i.request] : 0));
  }
  ATTNFORGE_HOST_DEVICE static void query_transform(const VariantArgs& a, const LogitIndex& i, float* q, int32_t) {
    rope(a, i, q, i.q_pos);
  }
  ATTNFORGE_HOST_DEVICE static void key_transform(const VariantArgs& a, const LogitIndex& i, float* k, int32_t) {
    rope(a, i, k, i.kv_pos);
  }
  ATTNFORGE_HOST_DEVICE static bool logits_mask(const VariantArgs& a, const LogitIndex& i) {
    int32_t lo, hi;
    allowed_kv_range(*a.options, i.q_pos, i.kv_len, &lo, &hi);
    if (i.kv_pos < lo || i.kv_pos >= hi) return false;
    return !a.options->custom_mask || custom_mask_allows(*a.options, i.request, i.q_token, i.kv_pos, i.kv_len);
  }
  ATTNFORGE_HOST_DEVICE static float logits_transform(const VariantArgs& a, const LogitIndex& i, float s) {
    return transform_logit(*a.options, s, i.qo_head, i.q_pos, i.kv_pos);
  }
};

}  // namespace attnforge

// A variant's source is global-scope C++: the fixed-width integer names its hooks' signatures use (int32_t) are
// there too under NVRTC, which has no <cstdint>, as <cstdint> puts them there on the host.
#if defined(__CUDACC_RTC__)
using attnforge::int32_t;
using attnforge::int64_t;
using attnforge::int8_t;
using attnforge::uint16_t;
using attnforge::uint32_t;
using attnforge::uint64_t;
using attnforge::uint8_t;
#endif
