// What a plain-timed call (events around one call after a sync, as bench and the peers time them) pays beyond its
// kernel's own span on this machine, for kernels shaped like a split decode step (264 CTAs of 128 threads, 1 KB of
// parameters, 100 KB of dynamic shared memory: two CTAs an SM), and the fastest such call can be for a step's bytes:
//   - a kernel that spins for a fixed time: launched plainly, with the programmatic-serialization attribute, and
//     with griddepcontrol.launch_dependents at its start or its end, alone or followed by an empty dependent kernel
//     (the decode kernel and the merge kernel);
//   - a streaming read of the 1 x 32768 step's 134 MB of K/V (rotated over 4 buffers) by 256 CTAs in four shapes
//     (loads into registers; cp.async into shared memory as the decode kernel copies, 48 or 80 KB in flight a CTA):
//     plain, with the attribute, as a graph of one call, and a call's share of a graph of 16;
//   - the same bytes in the decode step's own pattern (paged_copy_kernel: a CTA per KV head and 1024 tokens, 64-token
//     tiles of K and V through page ids), NHD pages in order and shuffled, HND pages shuffled; and with each warp
//     spinning 400-1600 ns after a tile's issue where the decode kernel computes the tile (does compute that fits
//     between two tiles' arrivals still cost the stream, when tiles land in bursts?); and the same with a pipeline
//     per warp (paged_copy_warp_kernel: no CTA barrier a tile).
// Each row: the events' median, the kernel's median span (first CTA's start to the last CTA's end, by %globaltimer)
// and their difference.
// Build: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o plain_call_probe bench/plain_call_probe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_common.cuh"

struct Params {
  unsigned long long* stamps;  // [0] min start, [1] max end (global ns)
  const uint4* src;            // the streaming read's buffer
  float* sink;                 // one float a CTA (keeps the read alive)
  long long spin_ns;
  long long chunk;             // uint4s a CTA reads
  int trigger;                 // 0 none, 1 launch_dependents at the start, 2 at the end
  const int* page_ids;         // paged reads: the step's 2048 pages of 16 tokens, in the order read
  int hnd;                     // paged reads: pages laid out [head][token] (HND) rather than [token][head] (NHD)
  long long tile_work_ns;      // paged reads: each warp's stand-in for a tile's compute, after the next tile's issue
  long long pad[117];          // 1 KB of parameters, as AttentionParams
};

// A paged read's stand-in for the decode kernel's compute of a tile: each thread spins p.tile_work_ns.
__device__ __forceinline__ void tile_work(const Params& p) {
  if (p.tile_work_ns <= 0) return;
  const unsigned long long w0 = now_ns();
  while (now_ns() - w0 < static_cast<unsigned long long>(p.tile_work_ns)) {
  }
}

__global__ void __launch_bounds__(128) spin_kernel(const Params p) {
  const unsigned long long t0 = now_ns();
  stamp_start(p.stamps, t0);
  if (p.trigger == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  while (now_ns() - t0 < static_cast<unsigned long long>(p.spin_ns)) {
  }
  if (p.trigger == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  stamp_end(p.stamps);
}

// Each CTA streams its contiguous chunk, kUnroll 16-byte loads a thread in flight.
template <int kThreads, int kUnroll>
__global__ void __launch_bounds__(kThreads) read_kernel(const Params p) {
  const unsigned long long t0 = now_ns();
  stamp_start(p.stamps, t0);
  const uint4* base = p.src + blockIdx.x * p.chunk;
  uint32_t acc = 0;
  for (long long i = threadIdx.x; i < p.chunk; i += kThreads * kUnroll) {  // chunk: a multiple of kThreads x kUnroll
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(base + i + u * kThreads);  // every load issues before any use
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (p.trigger == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (acc == 0x12345678u) p.sink[blockIdx.x] = 1.f;
  stamp_end(p.stamps);
}

// The same bytes through shared memory as the decode kernel streams them: cp.async 16-byte copies, kStages stages of
// kThreads x 4 copies (16 KB at 256 threads), kStages - 1 in flight (96 KB an SM at two CTAs of 4 stages of 16 KB);
// nothing computed.
template <int kThreads, int kStages>
__global__ void __launch_bounds__(kThreads) copy_kernel(const Params p) {
  extern __shared__ __align__(16) uint4 stage_smem[];
  const unsigned long long t0 = now_ns();
  stamp_start(p.stamps, t0);
  constexpr int kPer = 4, kStage = kThreads * kPer;  // uint4s a stage
  const uint4* base = p.src + blockIdx.x * p.chunk;
  const int stages = static_cast<int>(p.chunk / kStage);  // chunk: a multiple of kStage
  auto issue = [&](int s) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = k * kThreads + threadIdx.x;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage_smem + (s % kStages) * kStage + e));
      const uint4* src = base + static_cast<long long>(s) * kStage + e;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (int s = 0; s < stages; ++s) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2));
    __syncthreads();
    acc ^= stage_smem[(s % kStages) * kStage + threadIdx.x].x;
    if (s + kStages - 1 < stages) issue(s + kStages - 1);
    else asm volatile("cp.async.commit_group;");
  }
  if (acc == 0x12345678u) p.sink[blockIdx.x] = 1.f;
  stamp_end(p.stamps);
}

// The decode step's own access pattern with nothing computed: CTA b reads KV head b % 8 of tokens [1024 (b / 8),
// +1024) of a paged cache (2048 pages of 16 tokens, 8 KV heads, head_dim 128, bf16; K in the buffer's first half, V
// in its second) in 64-token tiles of 32 KB (K and V), 3 stages (2 in flight), as the 1 x 32768 decode step's
// kernel copies them: 128 threads x 16 cp.async a tile, the tile's 4 page ids fetched one tile ahead. NHD: a page's
// head slice is 16 rows of 256 bytes, 2 KB apart; HND: 4 KB in one piece.
__global__ void __launch_bounds__(128) paged_copy_kernel(const Params p) {
  extern __shared__ __align__(16) uint4 stage_smem[];
  const unsigned long long t0 = now_ns();
  stamp_start(p.stamps, t0);
  constexpr int kStages = 3, kTiles = 16, kTileChunks = 2048;  // uint4s a tile: 2 x 64 tokens x 16
  const int head = blockIdx.x % 8, piece = blockIdx.x / 8;
  const long long v_offset = 2048LL * 16 * 8 * 128 / 8;  // uint4s of K
  const int* ids = p.page_ids + piece * 64;
  const int x = threadIdx.x, dchunk = x % 16;
  int4 pages = *reinterpret_cast<const int4*>(ids);
  auto issue = [&](int t, int4 pg) {
    uint4* dst = stage_smem + (t % kStages) * kTileChunks;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int token = x / 16 + 8 * k, tok = token % 16;
      const int page = k < 2 ? pg.x : k < 4 ? pg.y : k < 6 ? pg.z : pg.w;
      const long long row = p.hnd ? (static_cast<long long>(page) * 8 + head) * 16 + tok
                                  : (static_cast<long long>(page) * 16 + tok) * 8 + head;
      const uint4* src = p.src + row * 16 + dchunk;
      const uint32_t dk = static_cast<uint32_t>(__cvta_generic_to_shared(dst + token * 16 + dchunk));
      const uint32_t dv = static_cast<uint32_t>(__cvta_generic_to_shared(dst + 1024 + token * 16 + dchunk));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(src));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(src + v_offset));
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int t = 0; t < kStages - 1; ++t) {
    issue(t, pages);
    pages = *reinterpret_cast<const int4*>(ids + 4 * (t + 1));
  }
  uint32_t acc = 0;
  for (int t = 0; t < kTiles; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2));
    __syncthreads();
    acc ^= stage_smem[(t % kStages) * kTileChunks + x].x;
    const int next = t + kStages - 1;
    if (next < kTiles) {
      issue(next, pages);
      if (next + 1 < kTiles) pages = *reinterpret_cast<const int4*>(ids + 4 * (next + 1));
    } else {
      asm volatile("cp.async.commit_group;");
    }
    tile_work(p);  // the decode kernel computes tile t here, with tiles t + 1 and t + 2 in flight
  }
  if (acc == 0x12345678u) p.sink[blockIdx.x] = 1.f;
  stamp_end(p.stamps);
}

// paged_copy_kernel with each warp its own pipeline: warp w copies and reads rows 16 w .. 16 w + 15 of every tile
// (one 16-token page of K and one of V), waits for its own copies and syncs only its lanes (__syncwarp), where
// paged_copy_kernel (as the decode kernel) copies every tile with all 128 threads and waits at a CTA barrier: a warp's
// late tile or long compute then holds only its own next issue, not the CTA's.
__global__ void __launch_bounds__(128) paged_copy_warp_kernel(const Params p) {
  extern __shared__ __align__(16) uint4 stage_smem[];
  const unsigned long long t0 = now_ns();
  stamp_start(p.stamps, t0);
  constexpr int kStages = 3, kTiles = 16, kTileChunks = 2048, kWarpChunks = kTileChunks / 4;
  const int head = blockIdx.x % 8, piece = blockIdx.x / 8;
  const long long v_offset = 2048LL * 16 * 8 * 128 / 8;  // uint4s of K
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, dchunk = lane % 16;
  const int* ids = p.page_ids + piece * 64 + warp;  // tile t's page for this warp: ids[4 t]
  int page = ids[0];
  auto issue = [&](int t, int pg) {
    uint4* dst = stage_smem + (t % kStages) * kTileChunks + warp * kWarpChunks;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int tok = lane / 16 + 2 * k;  // the warp's 16 tokens, 2 a pass
      const long long row = p.hnd ? (static_cast<long long>(pg) * 8 + head) * 16 + tok
                                  : (static_cast<long long>(pg) * 16 + tok) * 8 + head;
      const uint4* src = p.src + row * 16 + dchunk;
      const uint32_t dk = static_cast<uint32_t>(__cvta_generic_to_shared(dst + tok * 16 + dchunk));
      const uint32_t dv = static_cast<uint32_t>(__cvta_generic_to_shared(dst + 256 + tok * 16 + dchunk));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(src));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(src + v_offset));
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int t = 0; t < kStages - 1; ++t) {
    issue(t, page);
    page = ids[4 * (t + 1)];
  }
  uint32_t acc = 0;
  for (int t = 0; t < kTiles; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2));
    __syncwarp();
    acc ^= stage_smem[(t % kStages) * kTileChunks + warp * kWarpChunks + lane].x;
    const int next = t + kStages - 1;
    if (next < kTiles) {
      issue(next, page);
      if (next + 1 < kTiles) page = ids[4 * (next + 1)];
    } else {
      asm volatile("cp.async.commit_group;");
    }
    tile_work(p);
    __syncwarp();  // every lane has read stage t % kStages before a lane's next issue overwrites it
  }
  if (acc == 0x12345678u) p.sink[blockIdx.x] = 1.f;
  stamp_end(p.stamps);
}

__global__ void dependent_kernel(const Params p) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (p.trigger == 12345) p.sink[0] = 0.f;
}

struct Row {
  const char* name;
  double events, span;
};

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = 2 * sms, threads = 128, smem = 100 * 1024;
  CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const long long bytes = 32768LL * 8 * 128 * 2 * 2;  // 1 x 32768, 8 KV heads, head_dim 128, K and V, bf16
  const int kBuffers = 4;
  std::vector<uint4*> bufs(kBuffers);
  for (auto& b : bufs) {
    CHECK(cudaMalloc(&b, bytes));
    CHECK(cudaMemset(b, 0x5a, bytes));
  }
  // Page tables for the paged reads, one a buffer: in order, and shuffled (a fixed LCG-driven Fisher-Yates).
  std::vector<int*> in_order(kBuffers), shuffled(kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    std::vector<int> ids(2048);
    for (int j = 0; j < 2048; ++j) ids[j] = j;
    CHECK(cudaMalloc(&in_order[i], ids.size() * sizeof(int)));
    CHECK(cudaMemcpy(in_order[i], ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
    unsigned long long state = 0x9e3779b97f4a7c15ull * (i + 1);
    for (int j = 2047; j > 0; --j) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(ids[j], ids[static_cast<int>((state >> 33) % static_cast<unsigned long long>(j + 1))]);
    }
    CHECK(cudaMalloc(&shuffled[i], ids.size() * sizeof(int)));
    CHECK(cudaMemcpy(shuffled[i], ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
  }
  unsigned long long* stamps;
  float* sink;
  CHECK(cudaMalloc(&stamps, 2 * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&sink, grid * sizeof(float)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  Params base{};
  // The reads: 256 CTAs (the 1 x 32768 step's 8 KV heads x 32 pieces), 512 KB each.
  const int read_grid = 256;
  base.stamps = stamps, base.sink = sink, base.spin_ns = 35000, base.chunk = bytes / 16 / read_grid;
  auto launch = [&](void (*k)(Params), const Params& p, bool pdl, int g, int s, int block) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t c{};
    c.gridDim = dim3(g), c.blockDim = dim3(block), c.dynamicSmemBytes = s, c.stream = stream;
    c.attrs = &attr, c.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&c, k, p));
  };
  const unsigned long long reset[2] = {~0ull, 0ull};
  // events and span medians of `iters` plain calls
  auto measure = [&](const char* name, auto&& call, std::vector<Row>& rows, int iters = 200) {
    for (int i = 0; i < 10; ++i) call(i);
    CHECK(cudaStreamSynchronize(stream));
    std::vector<double> ev, sp;
    for (int i = 0; i < iters; ++i) {
      CHECK(cudaMemcpyAsync(stamps, reset, sizeof reset, cudaMemcpyHostToDevice, stream));
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaEventRecord(e0, stream));
      call(i);
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      unsigned long long h[2];
      CHECK(cudaMemcpy(h, stamps, sizeof h, cudaMemcpyDeviceToHost));
      ev.push_back(ms * 1e3);
      sp.push_back(h[1] > h[0] ? (h[1] - h[0]) * 1e-3 : 0.0);
    }
    std::sort(ev.begin(), ev.end());
    std::sort(sp.begin(), sp.end());
    rows.push_back({name, ev[ev.size() / 2], sp[sp.size() / 2]});
  };
  std::vector<Row> rows;
  auto spin = [&](bool pdl, int trigger, bool dependent) {
    return [=, &launch](int) {
      Params p = base;
      p.trigger = trigger;
      launch(spin_kernel, p, pdl, grid, smem, threads);
      if (dependent) launch(dependent_kernel, p, true, 32, 0, threads);
    };
  };
  measure("spin 35 us, plain launch", spin(false, 0, false), rows);
  measure("spin, PDL attribute", spin(true, 0, false), rows);
  measure("spin, PDL attribute, trigger at start", spin(true, 1, false), rows);
  measure("spin, PDL attribute, trigger at end", spin(true, 2, false), rows);
  measure("spin, plain launch, trigger at end", spin(false, 2, false), rows);
  measure("spin, PDL + trigger at end, + dependent", spin(true, 2, true), rows);
  measure("spin, PDL, no trigger, + dependent", spin(true, 0, true), rows);
  struct ReadShape {
    const char* name;
    void (*kernel)(Params);
    int threads, smem;
    int paged = 0;  // 0: contiguous; 1 NHD in order, 2 NHD shuffled, 3 HND shuffled (paged_copy_kernel)
    long long tile_work_ns = 0;  // paged: a stand-in for the decode kernel's compute of each tile (Params)
  };
  CHECK(cudaFuncSetAttribute(paged_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  CHECK(cudaFuncSetAttribute(paged_copy_warp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  CHECK(cudaFuncSetAttribute(copy_kernel<256, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  CHECK(cudaFuncSetAttribute(copy_kernel<256, 6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  const ReadShape shapes[] = {{"read 134 MB, 128 x 8 loads", read_kernel<128, 8>, 128, 0},
                              {"read 134 MB, 512 x 8 loads", read_kernel<512, 8>, 512, 0},
                              {"read 134 MB, cp.async 3 x 16 KB in flight", copy_kernel<256, 4>, 256, 64 * 1024},
                              {"read 134 MB, cp.async 5 x 16 KB in flight", copy_kernel<256, 6>, 256, 96 * 1024},
                              {"paged NHD in order, 2 x 32 KB in flight", paged_copy_kernel, 128, 96 * 1024, 1},
                              {"paged NHD shuffled, 2 x 32 KB in flight", paged_copy_kernel, 128, 96 * 1024, 2},
                              {"paged HND shuffled, 2 x 32 KB in flight", paged_copy_kernel, 128, 96 * 1024, 3},
                              // Does a tile's compute cost the stream? The decode step's tiles land about 1.9 us
                              // apart a CTA; a spin of each warp after the next tile's issue stands in for its work.
                              {"paged NHD shuffled, + 400 ns a tile", paged_copy_kernel, 128, 96 * 1024, 2, 400},
                              {"paged NHD shuffled, + 800 ns a tile", paged_copy_kernel, 128, 96 * 1024, 2, 800},
                              {"paged NHD shuffled, + 1200 ns a tile", paged_copy_kernel, 128, 96 * 1024, 2, 1200},
                              {"paged NHD shuffled, + 1600 ns a tile", paged_copy_kernel, 128, 96 * 1024, 2, 1600},
                              {"paged NHD shuffled, warp pipelines", paged_copy_warp_kernel, 128, 96 * 1024, 2},
                              {"paged NHD shuffled, warp pipelines, + 800 ns", paged_copy_warp_kernel, 128, 96 * 1024,
                               2, 800},
                              {"paged NHD shuffled, warp pipelines, + 1600 ns", paged_copy_warp_kernel, 128,
                               96 * 1024, 2, 1600}};
  auto read = [&](const ReadShape& r, bool pdl) {
    return [=, &launch, &bufs](int i) {
      Params p = base;
      p.src = bufs[i % kBuffers];
      p.page_ids = r.paged == 1 ? in_order[i % kBuffers] : shuffled[i % kBuffers];
      p.hnd = r.paged == 3;
      p.tile_work_ns = r.tile_work_ns;
      launch(r.kernel, p, pdl, read_grid, r.smem, r.threads);
    };
  };
  std::vector<Row> chain;
  std::vector<std::string> names;
  names.reserve(64);  // rows keep c_str() pointers into it: no reallocation
  for (const ReadShape& r : shapes) {
    measure(r.name, read(r, false), rows);
    names.push_back(std::string(r.name) + ", PDL attribute");
    measure(names.back().c_str(), read(r, true), rows);
    // As graphs: one call a graph, and 16 calls a graph (a call's share).
    auto graph_of = [&](int calls, int first) {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int c = 0; c < calls; ++c) read(r, false)(first + c);
      CHECK(cudaStreamEndCapture(stream, &g));
      CHECK(cudaGraphInstantiate(&exec, g, 0));
      CHECK(cudaGraphDestroy(g));
      return exec;
    };
    std::vector<cudaGraphExec_t> ones;
    for (int i = 0; i < kBuffers; ++i) ones.push_back(graph_of(1, i));
    names.push_back(std::string(r.name) + ", a graph of one call");
    measure(names.back().c_str(), [&](int i) { CHECK(cudaGraphLaunch(ones[i % kBuffers], stream)); }, rows);
    cudaGraphExec_t many = graph_of(16, 0);
    names.push_back(std::string(r.name) + ", a graph of 16 calls");
    measure(names.back().c_str(), [&](int) { CHECK(cudaGraphLaunch(many, stream)); }, chain, 50);
  }

  std::printf("%-52s %10s %10s %10s\n", "call", "events us", "span us", "diff us");
  for (const Row& r : rows) std::printf("%-52s %10.2f %10.2f %10.2f\n", r.name, r.events, r.span, r.events - r.span);
  for (const Row& r : chain)
    std::printf("%-52s %10.2f: a call's share %.2f us, %.3f TB/s\n", r.name, r.events, r.events / 16,
                bytes / (r.events / 16) * 1e-6);
  for (const Row& r : rows)
    if (r.name[0] == 'r' || r.name[0] == 'p')
      std::printf("%-52s %.3f TB/s by events, %.3f TB/s over the span\n", r.name, bytes / r.events * 1e-6,
                  bytes / r.span * 1e-6);
  CHECK(cudaGetLastError());
  std::printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
