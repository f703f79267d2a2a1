// run()'s validation and params, for entry points that launch something else than a backend's attention (the
// custom variants of src/jit/variant.cc).
#pragma once

#include "attnforge/ops.h"
#include "backends/backend.h"

namespace attnforge::detail {

// Filled in place: params.plan may point at host_view.
struct PreparedRun {
  AttentionParams params{};
  PlanView host_view{};
  Backend* backend = nullptr;
  PreparedRun() = default;
  PreparedRun(const PreparedRun&) = delete;
  PreparedRun& operator=(const PreparedRun&) = delete;
};

// Every check of run() and the AttentionParams it launches with, on the backend the selector picks.
void prepare_run(PreparedRun& prepared, const AttentionPlan& plan, const TensorView& q, const KVParams& kv,
                 const TensorView& k_view, const TensorView& v_view, KVLayout layout, const Outputs& out,
                 const AttentionOptions& options, const Workspace& ws);

// The KV params of a paged cache checked against the plan.
KVParams paged_run_params(const AttentionPlan& plan, const PagedKVCache& kv);

}  // namespace attnforge::detail
