// merge_state / merge_states on the CPU.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attnforge/kernel/state.h"
#include "backends/cpu/convert.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/thread_pool.h"

namespace attnforge::cpu {

void merge_states(const MergeStatesParams& p) {
  ThreadPool& pool = ThreadPool::instance();
  const int32_t d = p.head_dim;
  pool.parallel_for(p.n * p.num_heads, [&](int64_t task, int32_t worker) {
    const int64_t i = task / p.num_heads;
    const int32_t h = static_cast<int32_t>(task % p.num_heads);
    float* o = pool.scratch(worker);
    float* part = o + d;
    std::fill(o, o + d, 0.f);
    float lse = -std::numeric_limits<float>::infinity();
    for (int32_t k = 0; k < p.num_states; ++k) {
      const StateView& src = p.num_sources > 0 ? p.sources[k] : p.stacked;
      const int64_t v_off = p.num_sources > 0 ? 0 : k * p.v_stride_state;
      const int64_t s_off = p.num_sources > 0 ? 0 : k * p.s_stride_state;
      const float lse_k = src.s[s_off + i * src.s_stride_n + h * src.s_stride_head];
      load_row(src.v, src.v_dtype, v_off + i * src.v_stride_n + h * src.v_stride_head, d, 1.f, part);
      float wa, wb;
      lse = merge_weights(lse, lse_k, &wa, &wb);
#pragma omp simd
      for (int32_t j = 0; j < d; ++j) o[j] = wa * o[j] + (wb == 0.f ? 0.f : wb * part[j]);
    }
    store_row(p.o, p.o_dtype, i * p.o_stride_n + h * p.o_stride_head, d, o);
    if (p.lse) p.lse[i * p.lse_stride_n + h * p.lse_stride_head] = lse;
  });
}

}  // namespace attnforge::cpu
