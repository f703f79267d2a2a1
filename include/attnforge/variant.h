// Custom attention variants: C++ source given at run time (hooks of attnforge/kernel/variant_hooks.h), compiled
// on first use and cached like the run-time compiled GPU kernels (attnforge/jit.h: the same directory, modes and
// log). On the CPU they are compiled by the host C++ compiler attnforge was built with (or ATTNFORGE_HOST_CXX); on
// CUDA, into the decode and prefill kernels by NVRTC (docs/design.md, "Custom variants").
#pragma once

#include <string>
#include <vector>

#include "attnforge/ops.h"

namespace attnforge {

// `source` defines `struct <name> : attnforge::VariantBase { ... }` with the hooks it overrides, e.g.
//   struct Sigmoid : attnforge::VariantBase {
//     static constexpr bool kSoftmax = false;
//     static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex&, float s) {
//       return 1.f / (1.f + expf(-(s + a.scalars[0])));
//     }
//   };
struct CustomVariant {
  std::string name;    // the struct's name, a C++ identifier
  std::string source;  // compiled with <math.h> and the attnforge kernel headers available
};

// The user parameters hooks read through VariantArgs.
struct VariantInputs {
  std::vector<float> scalars;  // at most kMaxVariantScalars (8)
  std::vector<void*> tensors;  // at most kMaxVariantTensors (4); memory of the plan's device, laid out as the
                               // variant expects
};

// run() with a custom variant: the same validation, plan and arguments; `options` are the built-in options the
// variant's hooks can read (VariantArgs::options), and a sink joins the softmax. Plans without KV splits
// (PlanOptions::disable_split). Without softmax the LSE output holds NaN.
// CPU plans: the host compiler builds the variant's loop. CUDA plans (decode and prefill plans, K/V in Q's dtype):
// NVRTC builds the decode or prefill kernel with the variant's hooks (plain functions compile as device code there),
// on `stream`, asynchronously like run(); key_transform there sees the key's fields only (query fields -1), since
// one K row serves every query row of a CTA. Tensors in `inputs` live on the plan's device.
void run_variant(const AttentionPlan& plan, const TensorView& q, const PagedKVCache& kv, const Outputs& outputs,
                 const AttentionOptions& options, const CustomVariant& variant, const VariantInputs& inputs,
                 const Workspace& workspace, Stream stream = nullptr);

// The built-in options written as a variant (BuiltinVariant), through the same mechanism as a custom one.
CustomVariant builtin_variant();

}  // namespace attnforge
