// How the CUDA kernels (decode and prefill) take a variant: one kernel body per family, templated on V.
// BuiltinOptions: the built-in options, read from VariantParams at run time (the kernels run() launches). A custom
// variant V (a VariantBase with hooks, attnforge/variant.h) replaces them: V's logits_mask decides which keys a
// query sees, logits_transform acts on the scaled logit, query/key/output transforms act on fp32 rows, and
// V::kSoftmax false sums p v without normalizing (LSE then NaN); sinks still join a softmax. Hooks V leaves at
// VariantBase's identity are not called. Self-contained for NVRTC.
#pragma once

#include "attnforge/kernel/variant_hooks.h"

namespace attnforge::cuda {

struct BuiltinOptions {
  static constexpr bool kSoftmax = true;
};

template <class A, class B>
struct SameType {
  static constexpr bool value = false;
};
template <class A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

template <class V>
struct IsCustomVariant {
  static constexpr bool value = !SameType<V, BuiltinOptions>::value;
};

template <class V>
struct OverriddenHooks {
  static constexpr bool kQuery = &V::query_transform != &VariantBase::query_transform;
  static constexpr bool kKey = &V::key_transform != &VariantBase::key_transform;
  static constexpr bool kOutput = &V::output_transform != &VariantBase::output_transform;
};
template <>
struct OverriddenHooks<BuiltinOptions> {  // the built-in options have no hooks
  static constexpr bool kQuery = false, kKey = false, kOutput = false;
};

}  // namespace attnforge::cuda
