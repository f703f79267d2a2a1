// The CPU backend: every operator and option, fp32 accumulation, work items spread over a thread pool.
#include <fmt/format.h>

#include "backends/backend.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/thread_pool.h"
#include "core/shape.h"
#include "planner/heuristics.h"

namespace attnforge::detail {

namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  Support check(const AttentionConfig& c) const override {
    const AttentionShape s = normalized(c.shape);
    if (s.head_dim_qk > cpu::kMaxHeadDim || s.head_dim_vo > cpu::kMaxHeadDim)
      return {false, fmt::format("head_dim {}/{}: the CPU backend takes head dims up to {} (multiples of 8)",
                                 s.head_dim_qk, s.head_dim_vo, cpu::kMaxHeadDim)};
    return {};
  }
  int32_t num_workers(const AttentionShape&, PlanKind, int32_t) const override {
    return cpu::ThreadPool::instance().size();
  }
  int32_t target_tile_rows(const AttentionShape&, double) const override { return planner::kCpuTargetRows; }
  void attention(const AttentionParams& p, PlanKind, Stream) override { cpu::attention(p); }
  void merge_states(const MergeStatesParams& p, Stream) override { cpu::merge_states(p); }
  void append_kv(const AppendKVParams& p, Stream) override { cpu::append_kv(p); }
  void rope(const RopeApplyParams& p, Stream) override { cpu::rope(p); }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace attnforge::detail
