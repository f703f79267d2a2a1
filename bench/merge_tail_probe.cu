// What the split-KV merge adds to the end of the 1 x 32768 decode step, and what a merge through distributed shared
// memory (thread block clusters, sm_90) would add instead. Each kernel streams the step's 134 MB of K/V as the decode
// kernel does (256 CTAs of 128 threads, two an SM, 32 KB tiles through cp.async with two in flight, nothing computed:
// the bytes set the CTAs' end spread), then ends its CTA's state (4 query rows x 128 dims of fp32 O and 4 LSEs: one
// GQA group of one KV head, a thread one row's four dims) in one of these ways:
//   none     the state is written to global memory (the partial buffers), nothing merged: the floor;
//   global   as the decode kernel merged in sessions 34-36 (its arrive-early count, removed since, perf-notes v32,
//            and merge_split_rows' one-pass form): a
//            relaxed arrival as the stream ends, the partial rows written and counted by red.release, and the CTA
//            that arrived last among its KV head's 32 waits (acquire) for the others' rows, loads the 32 states by
//            cp.async and folds them in split order;
//   cluster8 clusters of 8 CTAs (8 consecutive splits of one KV head): each CTA keeps its state in shared memory,
//            the cluster syncs, rank r folds dims 16 r .. 16 r + 15 of the 8 states read through distributed shared
//            memory and writes that slice of the cluster's state; a counter per (KV head, slice) picks the last of
//            the head's 4 clusters, whose rank-r CTA folds the 4 slices (loaded as above) and writes them;
//   cluster16 the same with 16-CTA clusters (a non-portable size; skipped where the device refuses it): 2
//            clusters a KV head; cluster4 and cluster2 the same with 4- and 2-CTA clusters (8 and 16 clusters a KV
//            head: on a 132-SM Hopper only 240 CTAs in clusters of 8 and 224 in clusters of 16 are resident at once,
//            a second wave for the step's 256, perf-notes v31; smaller clusters pack the SMs' slots more fully);
//   dynamic  none and global again, with the stream's tiles handed out from a counter per KV head instead of 512 KB
//            a CTA: each CTA starts on two tiles of its own, then takes the head's next tile from the counter (one
//            atomic a tile, taken a tile ahead of its copies), so the CTAs of a head end within about a tile of one
//            another whichever of them the memory system favours. It says what the static split's end spread costs
//            (the states are still one a CTA: a kernel built this way would need states per fixed piece of KV, not
//            per CTA, to stay deterministic).
//   fixedN   a merging CTA fixed in advance (split 0 of each KV head) with a shorter piece, N 64ths of the
//            others' 512 KB (the head's 16 MB in 2048 pieces of 8 KB, 64 a CTA; the 64 - N it gives up go one each to
//            splits 1 .. 64 - N, each 8 KB or half a page of 16 tokens at head_dim 128 longer): it streams
//            its piece, then waits for the others' states as they land (each CTA releases a flag of its own once its
//            state is written; every warp of the merger polls the 31 flags a lane each and copies its row's slices
//            of each landed state into shared memory) and folds them in split order as soon as the states before
//            them are in, so that after the last state lands one load and the folds left remain, where global
//            loads and folds all 32 after the last CTA's count. fixed64 is the same wait without the shorter piece.
// The rows without a merge also print the CTAs' end times after the first CTA's start (p10, p50, p90, max; the
// medians over the timed launches).
// Each row: the events' median around one plain call, the kernel's median span (first CTA's start to the last
// CTA's end, %globaltimer), and a call's share of a graph of 16 calls; every variant's output is checked against a
// host fold of the same states first.
// Build: nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o merge_tail_probe bench/merge_tail_probe.cu
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

namespace cg = cooperative_groups;

constexpr int kHeads = 8, kSplits = 32, kCtas = kHeads * kSplits, kThreads = 128;
constexpr int kRows = 4, kDim = 128, kQuads = kDim / 4;  // a CTA's state: kRows x kQuads float4 = one a thread
constexpr int kStageBytes = kThreads * 16 * 16, kStages = 3;  // 32 KB tiles (K and V of 64 tokens), 2 in flight
constexpr long long kBytes = 32768LL * kHeads * kDim * 2 * 2;   // 1 x 32768, K and V, bf16

struct Params {
  unsigned long long* stamps;  // [0] min start, [1] max end (global ns)
  const uint4* src;            // this call's K/V buffer
  float4* partial_o;           // [kCtas][kRows * kQuads]
  float* partial_lse;          // [kCtas][kRows]
  int* counters;               // global: one a KV head; clusters: one a (KV head, slice)
  int* tile_counters;          // dynamic: the next tile of each KV head, past the tiles every CTA starts on
  int* flags;                  // fixedN: [kCtas] a written state (1), put back to 0 by the head's merger
  unsigned long long* ends;    // [kCtas] each CTA's end (global ns)
  float4* out;                 // [kHeads][kRows * kQuads], normalized
  unsigned seed;               // varies the states by call
};

// Tile `tile` (32 KB) from `base` into shared stage `stage` by cp.async, only its uint4s before `elems` of the stream
// (a partial last tile); no copy for tile < 0 or past the stream. Commits a group either way, so every iteration of
// a stream has one.
__device__ __forceinline__ void copy_tile(uint4* stages, const uint4* base, int stage, int tile, int elems) {
  constexpr int kPer = kStageBytes / 16 / kThreads;
  if (tile >= 0 && tile * (kStageBytes / 16) < elems) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = k * kThreads + threadIdx.x;
      if (tile * (kStageBytes / 16) + e >= elems) break;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stages + stage * (kStageBytes / 16) + e));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                   "l"(base + static_cast<long long>(tile) * (kStageBytes / 16) + e));
    }
  }
  asm volatile("cp.async.commit_group;");
}

// Pieces [first, first + pieces) of 8 KB of the head's 16 MB through the same three 32 KB stages (the last tile
// partial where the pieces end inside one); returns a word of what landed.
constexpr int kPieceBytes = 8192, kPieceElems = kPieceBytes / 16;
__device__ uint32_t stream_range(const Params& p, int head, int first, int pieces) {
  extern __shared__ __align__(16) uint4 stages[];
  const uint4* base = p.src + static_cast<long long>(head) * (kBytes / 16 / kHeads) +
                      static_cast<long long>(first) * kPieceElems;
  const int elems = pieces * kPieceElems, tiles = (elems + kStageBytes / 16 - 1) / (kStageBytes / 16);
  auto issue = [&](int t) { copy_tile(stages, base, t % kStages, t, elems); };
  for (int t = 0; t < kStages - 1; ++t) issue(t);
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2));
    __syncthreads();
    acc ^= stages[(t % kStages) * (kStageBytes / 16) + threadIdx.x].x;
    issue(t + kStages - 1);
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();  // the stages are free for the merge
  return acc;
}

// The CTA's 512 KB of K/V (64 pieces: split s of head h streams pieces 64 s .. 64 s + 63 of the head's).
__device__ uint32_t stream_tiles(const Params& p) {
  constexpr int kEven = static_cast<int>(kBytes / kCtas / kPieceBytes);
  return stream_range(p, blockIdx.x / kSplits, (blockIdx.x % kSplits) * kEven, kEven);
}

// dynamic: the head's 16 MB as 512 tiles of 32 KB; CTA `split` starts on tiles 2 split and 2 split + 1, then takes
// tiles 64, 65, .. from the head's counter, a tile ahead of its copies (double-buffered in shared memory: thread 0
// writes the one the next iteration reads). The CTA whose take is the head's last (each CTA takes once past the end)
// puts the counter back to zero for the next launch.
__device__ uint32_t stream_tiles_dynamic(const Params& p, int head, int split) {
  extern __shared__ __align__(16) uint4 stages[];
  __shared__ int s_take[2];
  constexpr int kTiles = static_cast<int>(kBytes / kHeads / kStageBytes), kFirst = 2 * kSplits;
  constexpr int kTakes = kTiles - kFirst + kSplits;  // every tile past the first ones, and one failed take a CTA
  const uint4* base = p.src + static_cast<long long>(head) * (kBytes / 16 / kHeads);
  int* counter = p.tile_counters + head;
  auto issue = [&](int stage, int tile) { copy_tile(stages, base, stage, tile, kTiles * (kStageBytes / 16)); };
  auto take = [&](int slot) {
    if (threadIdx.x == 0) {
      const int v = atomicAdd(counter, 1);
      if (v == kTakes - 1) *counter = 0;
      s_take[slot] = kFirst + v;
    }
  };
  int cur = 2 * split, nxt = 2 * split + 1;
  issue(0, cur);
  issue(1, nxt);
  take(0);
  uint32_t acc = 0;
  for (int t = 0; cur < kTiles; ++t) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2));
    __syncthreads();  // tile t landed; s_take[t & 1] written; every thread read s_take[(t + 1) & 1] last time
    acc ^= stages[(t % kStages) * (kStageBytes / 16) + threadIdx.x].x;
    const int after = s_take[t & 1];
    issue((t + kStages - 1) % kStages, after);
    if (after < kTiles) take((t + 1) & 1);
    else if (threadIdx.x == 0) s_take[(t + 1) & 1] = kTiles;
    cur = nxt, nxt = after;
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();  // the stages are free for the merge
  return acc;
}

// This CTA's state, a function of (split, row, quad, seed) alone, so the host can fold the same values.
__device__ __forceinline__ void make_state(const Params& p, int split, uint32_t acc, float4* o, float* lse) {
  const int r = threadIdx.x / kQuads, q = threadIdx.x % kQuads;
  const float s = static_cast<float>((split * 7 + r * 3 + p.seed) % 17) * 0.25f;
  *lse = acc == 0x12345678u ? 0.f : s;  // keeps the read alive; never taken (the buffers hold 0x5a bytes)
  const float b = static_cast<float>(split + q + p.seed % 5) * 0.01f;
  *o = make_float4(b, b + 1.f, b - 1.f, 2.f * b);
}

// The fold of kN states of one (row, quad) in split order, the merge kernels' arithmetic: the LSEs' maximum m, then
// the weights 2^(lse - m), their sum and the weighted O. lse_of(k) and o_of(k) read state k.
template <int kN, class Lse, class O>
__device__ __forceinline__ void fold(Lse&& lse_of, O&& o_of, float4* out_o, float* out_lse) {
  float lses[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) lses[k] = lse_of(k);
  float m = -INFINITY, l = 0.f;
#pragma unroll
  for (int k = 0; k < kN; ++k) m = fmaxf(m, lses[k]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float w = exp2f(lses[k] - m);
    const float4 o = o_of(k);
    l += w;
    acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
  }
  *out_lse = m + log2f(l);
  *out_o = make_float4(acc.x / l, acc.y / l, acc.z / l, acc.w / l);
}

// none: each CTA writes its state; nothing merged.
template <bool kDynamic>
__global__ void __launch_bounds__(kThreads) tail_none(const Params p) {
  stamp_start(p.stamps, now_ns());
  const uint32_t acc = kDynamic ? stream_tiles_dynamic(p, blockIdx.x / kSplits, blockIdx.x % kSplits) : stream_tiles(p);
  float4 o;
  float lse;
  make_state(p, blockIdx.x % kSplits, acc, &o, &lse);
  p.partial_o[blockIdx.x * kThreads + threadIdx.x] = o;
  if (threadIdx.x % kQuads == 0) p.partial_lse[blockIdx.x * kRows + threadIdx.x / kQuads] = lse;
  stamp_end(p.stamps);
  if (threadIdx.x == 0) p.ends[blockIdx.x] = now_ns();
}

// global: the decode kernel's in-kernel merge (arrivals in the low 16 bits, written states in the high 16).
template <bool kDynamic>
__global__ void __launch_bounds__(kThreads) tail_global(const Params p) {
  __shared__ int s_last;
  stamp_start(p.stamps, now_ns());
  const int head = blockIdx.x / kSplits, split = blockIdx.x % kSplits;
  const uint32_t acc = kDynamic ? stream_tiles_dynamic(p, head, split) : stream_tiles(p);
  int* counter = p.counters + head;
  int before = 0;
  if (threadIdx.x == 0)
    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  float4 o;
  float lse;
  make_state(p, split, acc, &o, &lse);
  p.partial_o[blockIdx.x * kThreads + threadIdx.x] = o;
  if (threadIdx.x % kQuads == 0) p.partial_lse[blockIdx.x * kRows + threadIdx.x / kQuads] = lse;
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = (before & 0xffff) == kSplits - 1;
    if (!last) {
      asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(1 << 16) : "memory");
    } else {
      int v;
      do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      } while ((v >> 16) != kSplits - 1);
      *counter = 0;
    }
    s_last = last;
  }
  __syncthreads();
  if (s_last) {
    extern __shared__ __align__(16) uint4 stages[];
    float4* s_o = reinterpret_cast<float4*>(stages);  // [kSplits][kThreads]
    float* s_lse = reinterpret_cast<float*>(s_o + kSplits * kThreads);  // [kSplits][kRows]
    const float4* src = p.partial_o + head * kSplits * kThreads + threadIdx.x;
    for (int k = 0; k < kSplits; ++k) {
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(s_o + k * kThreads + threadIdx.x));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src + k * kThreads));
    }
    asm volatile("cp.async.commit_group;");
    for (int i = threadIdx.x; i < kSplits * kRows; i += kThreads)
      s_lse[i] = __ldcg(p.partial_lse + head * kSplits * kRows + i);
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();
    const int r = threadIdx.x / kQuads;
    float4 out;
    float out_lse;
    fold<kSplits>([&](int k) { return s_lse[k * kRows + r]; }, [&](int k) { return s_o[k * kThreads + threadIdx.x]; },
                  &out, &out_lse);
    p.out[head * kThreads + threadIdx.x] = out;
  }
  stamp_end(p.stamps);
}

// fixedN: split 0 of each head merges, on kMergerPieces pieces of 8 KB (see the top of the file).
template <int kMergerPieces>
__global__ void __launch_bounds__(kThreads) tail_fixed(const Params p) {
  constexpr int kPieces = static_cast<int>(kBytes / kHeads / kPieceBytes), kEven = kPieces / kSplits;  // 2048, 64
  constexpr int kGiven = kEven - kMergerPieces;  // pieces the merger gives up: one each to splits 1 .. kGiven
  static_assert(kMergerPieces >= 1 && kMergerPieces <= kEven && kGiven < kSplits);
  stamp_start(p.stamps, now_ns());
  const int head = blockIdx.x / kSplits, split = blockIdx.x % kSplits;
  const int pieces = split == 0 ? kMergerPieces : kEven + (split <= kGiven ? 1 : 0);
  const int first = split == 0 ? 0 : kMergerPieces + (split - 1) * kEven + min(split - 1, kGiven);
  const uint32_t acc = stream_range(p, head, first, pieces);
  float4 o;
  float lse;
  make_state(p, split, acc, &o, &lse);
  if (split != 0) {
    p.partial_o[blockIdx.x * kThreads + threadIdx.x] = o;
    if (threadIdx.x % kQuads == 0) p.partial_lse[blockIdx.x * kRows + threadIdx.x / kQuads] = lse;
    __syncthreads();  // every thread's state is written before thread 0's release (cumulativity)
    if (threadIdx.x == 0)
      asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p.flags + blockIdx.x), "r"(1) : "memory");
    stamp_end(p.stamps);
    return;
  }
  // The merger: warp w holds row w (kQuads = 32 threads a row), lane q its dims 4q .. 4q + 3.
  extern __shared__ __align__(16) uint4 stages[];
  float4* s_o = reinterpret_cast<float4*>(stages);                      // [kSplits][kThreads]
  float* s_lse = reinterpret_cast<float*>(s_o + kSplits * kThreads);   // [kSplits][kThreads]
  const int lane = threadIdx.x % 32;
  const float4* src_o = p.partial_o + static_cast<long long>(head) * kSplits * kThreads + threadIdx.x;
  const float* src_lse = p.partial_lse + head * kSplits * kRows + threadIdx.x / kQuads;
  const int* flags = p.flags + head * kSplits;
  float m = lse, l = 1.f;  // the running fold, from this CTA's own state (split 0)
  float4 sum = o;
  unsigned pending = ~1u;  // splits 1 .. 31 not landed yet
  int next = 1;            // the next split to fold
  while (next < kSplits) {
    bool landed = false;
    if (lane >= 1 && ((pending >> lane) & 1u)) {
      int v;
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(flags + lane) : "memory");
      landed = v != 0;
    }
    const unsigned fresh = __ballot_sync(0xffffffffu, landed);
    __syncwarp();  // the acquiring lanes' loads are ordered before every lane's reads below
    pending &= ~fresh;
    for (unsigned f = fresh; f != 0; f &= f - 1) {
      const int k = __ffs(f) - 1;
      s_o[k * kThreads + threadIdx.x] = __ldcg(src_o + k * kThreads);
      s_lse[k * kThreads + threadIdx.x] = __ldcg(src_lse + k * kRows);
    }
    for (; next < kSplits && ((pending >> next) & 1u) == 0; ++next) {
      const float lk = s_lse[next * kThreads + threadIdx.x];
      const float4 ok = s_o[next * kThreads + threadIdx.x];
      const float mn = fmaxf(m, lk), a = exp2f(m - mn), b = exp2f(lk - mn);
      l = l * a + b;
      sum = make_float4(sum.x * a + ok.x * b, sum.y * a + ok.y * b, sum.z * a + ok.z * b, sum.w * a + ok.w * b);
      m = mn;
    }
  }
  p.out[head * kThreads + threadIdx.x] = make_float4(sum.x / l, sum.y / l, sum.z / l, sum.w / l);
  __syncthreads();  // every warp saw every flag: put them back for the next launch
  if (threadIdx.x >= 1 && threadIdx.x < kSplits) p.flags[head * kSplits + threadIdx.x] = 0;
  stamp_end(p.stamps);
}

// cluster2 / cluster4 / cluster8 / cluster16: kC CTAs a cluster (consecutive splits of one KV head), kSplits / kC
// clusters a head.
template <int kC>
__global__ void __launch_bounds__(kThreads) tail_cluster(const Params p) {
  constexpr int kClusters = kSplits / kC, kSlice = kThreads / kC;  // clusters a head; (row, quad) pairs a rank folds
  __shared__ float4 s_state_o[kThreads];
  __shared__ float s_state_lse[kThreads];
  __shared__ int s_last;
  stamp_start(p.stamps, now_ns());
  cg::cluster_group cluster = cg::this_cluster();
  const int head = blockIdx.x / kSplits, split = blockIdx.x % kSplits, rank = static_cast<int>(cluster.block_rank());
  const int c = split / kC;  // this cluster among the head's
  const uint32_t acc = stream_tiles(p);
  float4 o;
  float lse;
  make_state(p, split, acc, &o, &lse);
  s_state_o[threadIdx.x] = o, s_state_lse[threadIdx.x] = lse;
  cluster.sync();  // every state of the cluster is in its CTA's shared memory
  // Rank `rank` folds pairs [kSlice rank, kSlice (rank + 1)) of the cluster's kC states (split order = rank order).
  const int pair = kSlice * rank + threadIdx.x;
  int* counter = p.counters + head * kC + rank;
  float4* slice_o = p.partial_o + (head * kClusters) * kThreads;  // [kClusters][kThreads] of this head
  float* slice_lse = p.partial_lse + (head * kClusters) * kThreads;
  if (threadIdx.x < kSlice) {
    float4 so;
    float sl;
    fold<kC>([&](int k) { return *cluster.map_shared_rank(&s_state_lse[pair], k); },
             [&](int k) { return *cluster.map_shared_rank(&s_state_o[pair], k); }, &so, &sl);
    slice_o[c * kThreads + pair] = so;
    slice_lse[c * kThreads + pair] = sl;
  }
  cluster.sync();  // no CTA leaves while another reads its shared memory
  __syncthreads();
  if (threadIdx.x == 0) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    const bool last = before == kClusters - 1;
    if (last) *counter = 0;
    s_last = last;
  }
  __syncthreads();
  if (s_last && threadIdx.x < kSlice) {
    float4 out;
    float out_lse;
    fold<kClusters>([&](int k) { return __ldcg(slice_lse + k * kThreads + pair); },
                    [&](int k) { return __ldcg(slice_o + k * kThreads + pair); }, &out, &out_lse);
    p.out[head * kThreads + pair] = out;
  }
  stamp_end(p.stamps);
}

// The host's fold of a head's 32 states for `seed` (make_state), in split order, as the kernels' arithmetic.
void expected_out(unsigned seed, std::vector<float>& out) {
  out.assign(kHeads * kThreads * 4, 0.f);
  for (int h = 0; h < kHeads; ++h)
    for (int t = 0; t < kThreads; ++t) {
      const int r = t / kQuads, q = t % kQuads;
      double m = -INFINITY, l = 0, acc[4] = {0, 0, 0, 0};
      for (int s = 0; s < kSplits; ++s) m = std::max(m, ((s * 7 + r * 3 + seed) % 17) * 0.25);
      for (int s = 0; s < kSplits; ++s) {
        const double w = std::exp2(((s * 7 + r * 3 + seed) % 17) * 0.25 - m);
        const double b = (s + q + seed % 5) * 0.01;
        const double o[4] = {b, b + 1, b - 1, 2 * b};
        l += w;
        for (int i = 0; i < 4; ++i) acc[i] += w * o[i];
      }
      for (int i = 0; i < 4; ++i) out[(h * kThreads + t) * 4 + i] = static_cast<float>(acc[i] / l);
    }
}

int main() {
  int cc_major = 0;
  CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, 0));
  if (cc_major < 9) {
    std::printf("merge_tail_probe: thread block clusters need sm_90 or newer\n");
    return 0;
  }
  const int kSmem = kStages * kStageBytes;  // 96 KB: two CTAs an SM, as the decode step's kernel
  const int kBuffers = 4;
  std::vector<uint4*> bufs(kBuffers);
  for (auto& b : bufs) {
    CHECK(cudaMalloc(&b, kBytes));
    CHECK(cudaMemset(b, 0x5a, kBytes));
  }
  Params base{};
  CHECK(cudaMalloc(&base.stamps, 2 * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&base.partial_o, kCtas * kThreads * sizeof(float4)));
  CHECK(cudaMalloc(&base.partial_lse, kCtas * kThreads * sizeof(float)));
  CHECK(cudaMalloc(&base.counters, kHeads * 16 * sizeof(int)));
  CHECK(cudaMemset(base.counters, 0, kHeads * 16 * sizeof(int)));
  CHECK(cudaMalloc(&base.out, kHeads * kThreads * sizeof(float4)));
  CHECK(cudaMalloc(&base.tile_counters, kHeads * sizeof(int)));
  CHECK(cudaMemset(base.tile_counters, 0, kHeads * sizeof(int)));
  CHECK(cudaMalloc(&base.ends, kCtas * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&base.flags, kCtas * sizeof(int)));
  CHECK(cudaMemset(base.flags, 0, kCtas * sizeof(int)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  struct Variant {
    const char* name;
    void (*kernel)(Params);
    int cluster;  // 0: no cluster launch
    bool merges;
  };
  const Variant variants[] = {{"none (states written, no merge)", tail_none<false>, 0, false},
                              {"global (the decode kernel's merge)", tail_global<false>, 0, true},
                              {"dynamic none (tiles from a counter)", tail_none<true>, 0, false},
                              {"dynamic global", tail_global<true>, 0, true},
                              {"fixed64 (merger waits, even pieces)", tail_fixed<64>, 0, true},
                              {"fixed56 (merger's piece 56/64)", tail_fixed<56>, 0, true},
                              {"fixed48 (merger's piece 48/64)", tail_fixed<48>, 0, true},
                              {"fixed34 (merger's piece 34/64)", tail_fixed<34>, 0, true},
                              {"cluster2 (DSMEM, then 16 states)", tail_cluster<2>, 2, true},
                              {"cluster4 (DSMEM, then 8 states)", tail_cluster<4>, 4, true},
                              {"cluster8 (DSMEM, then 4 states)", tail_cluster<8>, 8, true},
                              {"cluster16 (DSMEM, then 2 states)", tail_cluster<16>, 16, true}};
  for (const Variant& v : variants) {
    CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    if (v.cluster > 8) CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  auto config = [&](const Variant& v, cudaLaunchAttribute* attr) {
    cudaLaunchConfig_t c{};
    c.gridDim = dim3(kCtas), c.blockDim = dim3(kThreads), c.dynamicSmemBytes = kSmem, c.stream = stream;
    if (v.cluster > 0) {
      attr->id = cudaLaunchAttributeClusterDimension;
      attr->val.clusterDim.x = v.cluster, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
      c.attrs = attr, c.numAttrs = 1;
    }
    return c;
  };
  auto launch = [&](const Variant& v, int i) {
    cudaLaunchAttribute attr{};
    cudaLaunchConfig_t c = config(v, &attr);
    Params p = base;
    p.src = bufs[i % kBuffers];
    p.seed = static_cast<unsigned>(i % 7);
    CHECK(cudaLaunchKernelEx(&c, v.kernel, p));
  };
  const unsigned long long reset[2] = {~0ull, 0ull};
  std::printf("%-40s %10s %10s %10s %12s\n", "end of the step", "events us", "span us", "diff us", "graph of 16");
  for (const Variant& v : variants) {
    if (v.cluster > 0) {  // clusters that cannot all be resident at once run in waves: said, and timed anyway
      cudaLaunchAttribute attr{};
      cudaLaunchConfig_t c = config(v, &attr);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, v.kernel, &c) != cudaSuccess) {
        std::printf("%-40s skipped: %s\n", v.name, cudaGetErrorString(cudaGetLastError()));
        continue;
      }
      if (clusters * v.cluster < kCtas)
        std::printf("%-40s note: %d clusters of %d CTAs resident at once, %d CTAs launched\n", v.name, clusters,
                    v.cluster, kCtas);
    }
    // Checked first: the output against the host's fold (every seed of the rotation).
    if (v.merges) {
      for (int i = 0; i < 7; ++i) {
        CHECK(cudaMemsetAsync(base.out, 0xff, kHeads * kThreads * sizeof(float4), stream));  // NaN
        launch(v, i);
        std::vector<float> got(kHeads * kThreads * 4), want;
        CHECK(cudaMemcpyAsync(got.data(), base.out, got.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
        CHECK(cudaStreamSynchronize(stream));
        expected_out(static_cast<unsigned>(i % 7), want);
        double worst = 0;
        for (size_t k = 0; k < got.size(); ++k) {
          const double err = std::fabs(static_cast<double>(got[k]) - want[k]);
          worst = std::isnan(err) ? INFINITY : std::max(worst, err);
        }
        if (!(worst < 1e-4)) {
          std::printf("%-40s WRONG: max error %g against the host's fold (seed %d)\n", v.name, worst, i);
          return 1;
        }
      }
    }
    for (int i = 0; i < 10; ++i) launch(v, i);
    CHECK(cudaStreamSynchronize(stream));
    std::vector<double> ev, sp, ends[4];  // ends: the CTAs' p10, p50, p90, max after the first start
    for (int i = 0; i < 200; ++i) {
      CHECK(cudaMemcpyAsync(base.stamps, reset, sizeof reset, cudaMemcpyHostToDevice, stream));
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaEventRecord(e0, stream));
      launch(v, i);
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      unsigned long long h[2];
      CHECK(cudaMemcpy(h, base.stamps, sizeof h, cudaMemcpyDeviceToHost));
      ev.push_back(ms * 1e3);
      sp.push_back(h[1] > h[0] ? (h[1] - h[0]) * 1e-3 : 0.0);
      if (!v.merges) {
        std::vector<unsigned long long> e(kCtas);
        CHECK(cudaMemcpy(e.data(), base.ends, kCtas * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        std::sort(e.begin(), e.end());
        const int at[4] = {kCtas / 10, kCtas / 2, kCtas * 9 / 10, kCtas - 1};
        for (int k = 0; k < 4; ++k) ends[k].push_back(e[at[k]] > h[0] ? (e[at[k]] - h[0]) * 1e-3 : 0.0);
      }
    }
    // A call's share of a graph of 16 calls, replayed 20 times.
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < 16; ++i) launch(v, i);
    CHECK(cudaStreamEndCapture(stream, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    std::vector<double> chain;
    for (int i = 0; i < 22; ++i) {
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) chain.push_back(ms * 1e3 / 16);
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(g));
    std::sort(ev.begin(), ev.end());
    std::sort(sp.begin(), sp.end());
    std::sort(chain.begin(), chain.end());
    std::printf("%-40s %10.2f %10.2f %10.2f %12.2f", v.name, ev[ev.size() / 2], sp[sp.size() / 2],
                ev[ev.size() / 2] - sp[sp.size() / 2], chain[chain.size() / 2]);
    if (!v.merges) {
      std::printf("   CTA ends p10/p50/p90/max");
      for (auto& x : ends) {
        std::sort(x.begin(), x.end());
        std::printf(" %.2f", x[x.size() / 2]);
      }
    }
    std::printf("\n");
  }
  CHECK(cudaGetLastError());
  return 0;
}
