// Batch decode on a paged KV cache with the C++ API: plan once per batch shape, run per layer.
// Build: part of the CMake build (examples/); run: build/release/examples/batch_decode
#include <attnforge/attnforge.h>

#include <cstdio>
#include <cmath>
#include <cstdint>
#include <vector>

int main() {
  using namespace attnforge;
  const int32_t batch = 2, num_qo_heads = 32, num_kv_heads = 8, head_dim = 128, page_size = 16;
  // Request 0 has 40 tokens (3 pages, 8 in the last), request 1 has 16 (1 page). Pages may be anywhere.
  std::vector<int32_t> indptr = {0, 3, 4}, indices = {5, 0, 2, 7}, last_page_len = {8, 16};
  const int32_t num_pages = 8;

  std::vector<float> k(num_pages * page_size * num_kv_heads * head_dim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.001f * i), v[i] = std::cos(0.002f * i);
  std::vector<float> q(batch * num_qo_heads * head_dim, 0.1f), out(q.size()), lse(batch * num_qo_heads);

  PagedKVCache cache;
  cache.k = TensorView(k.data(), DType::kFloat32, {num_pages, page_size, num_kv_heads, head_dim});
  cache.v = TensorView(v.data(), DType::kFloat32, {num_pages, page_size, num_kv_heads, head_dim});
  cache.layout = KVLayout::kNHD;
  cache.table = PageTable::csr(TensorView(indptr.data(), DType::kInt32, {batch + 1}),
                               TensorView(indices.data(), DType::kInt32, {4}),
                               TensorView(last_page_len.data(), DType::kInt32, {batch}));

  BatchPlanArgs args;  // host metadata; on a GPU the page table views above would be device memory
  args.device = Device::cpu();
  args.shape = {num_qo_heads, num_kv_heads, head_dim, head_dim, DType::kFloat32, DType::kFloat32, DType::kFloat32};
  args.set_paged(cache.table, page_size);
  try {
    const AttentionPlan plan = plan_batch_decode(args);
    std::vector<unsigned char> workspace_storage(plan.workspace_bytes + 256);
    void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace_storage.data()) + 255) / 256 * 256);

    AttentionOptions options;  // per layer: sm_scale, window, soft-cap, ...
    TensorView q_view(q.data(), DType::kFloat32, {batch, num_qo_heads, head_dim});
    Outputs outputs{TensorView(out.data(), DType::kFloat32, {batch, num_qo_heads, head_dim}),
                    TensorView(lse.data(), DType::kFloat32, {batch, num_qo_heads})};
    run(plan, q_view, cache, outputs, options, Workspace{ws, plan.workspace_bytes});
    std::printf("%s\nout[0][0][0..3] = %.5f %.5f %.5f %.5f, lse[0][0] = %.5f (log2)\n", plan.describe().c_str(),
                out[0], out[1], out[2], out[3], lse[0]);
  } catch (const Error& e) {
    std::fprintf(stderr, "attnforge: %s\n", e.what());
    return 1;
  }
  return 0;
}
