#include "testing/cases.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include <sys/mman.h>

#include "backends/cpu/convert.h"
#include "testing/parallel.h"

namespace attnforge::testing {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Stores v at element idx of base (as the dtype stores it) and returns the value read back.
float put(void* base, DType t, int64_t idx, float v) {
  cpu::store_row(base, t, idx, 1, &v);
  return cpu::load_one(base, t, idx);
}

// Uniform in [-1, 1) from a splitmix64 stream: K/V of serving-sized batches hold billions of values, and this
// is an order of magnitude faster than std::uniform_real_distribution.
constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;  // splitmix64's increment

float fast_uniform(uint64_t& state) {
  uint64_t z = (state += kGamma);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.f / 16777216.f) - 1.f;
}

void fill_nan(const Buffer& b) {
  const std::vector<float> row(4096, kNaN);
  constexpr int64_t kRowsPerTask = 256;
  const int64_t rows = static_cast<int64_t>((b.count + row.size() - 1) / row.size());
  parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    for (int64_t r = task * kRowsPerTask; r < std::min(rows, (task + 1) * kRowsPerTask); ++r) {
      const size_t i = static_cast<size_t>(r) * row.size();
      const auto n = static_cast<int32_t>(std::min(row.size(), b.count - i));
      cpu::store_row(b.data(), b.dtype, static_cast<int64_t>(i), n, row.data());
    }
  });
}

const char* kind_name(PlanKind k) { return k == PlanKind::kDecode ? "decode" : "prefill"; }

}  // namespace

void* Buffer::data() const { return storage.get(); }

Buffer Buffer::make(DType dtype, size_t count) {
  Buffer b;
  b.dtype = dtype;
  b.count = count;
  const size_t bytes = std::max<size_t>(1, count * dtype_bytes(dtype));
  // Large buffers (a KV cache) are 2 MiB aligned and asked to be backed by huge pages, as serving engines
  // allocate their caches: with 4 KiB pages, decode's scattered page reads miss the TLB on nearly every row.
  const size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 256;
  auto* p = static_cast<uint8_t*>(::operator new[](bytes, std::align_val_t(align)));
  if (align == kHuge) madvise(p, (bytes + kHuge - 1) / kHuge * kHuge, MADV_HUGEPAGE);
  b.storage = std::shared_ptr<uint8_t[]>(p, [align](uint8_t* q) { ::operator delete[](q, std::align_val_t(align)); });
  return b;
}

std::string CaseSpec::describe() const {
  auto lens = [](const std::vector<int32_t>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += fmt::format("{}{}", i ? "," : "", v[i]);
    if (v.size() > 8) s += fmt::format(",...({} requests)", v.size());
    return s;
  };
  std::string opts;
  const OptionSpec& o = options;
  if (o.causal) opts += " causal";
  if (o.window_left >= 0 || o.window_right >= 0) opts += fmt::format(" window({},{})", o.window_left, o.window_right);
  if (o.soft_cap > 0) opts += fmt::format(" softcap={}", o.soft_cap);
  if (o.alibi) opts += " alibi";
  if (o.sinks) opts += " sinks";
  if (o.custom_mask) opts += " mask";
  if (o.rope) opts += fmt::format(" rope{}{}{}", o.rope_interleave ? "-interleave" : "", o.rope_llama31 ? "-llama31" : "",
                                  o.rope_offsets ? "-offsets" : "");
  if (o.sm_scale > 0) opts += fmt::format(" sm_scale={}", o.sm_scale);
  return fmt::format("{} {} {} qo=[{}] kv=[{}] heads {}/{} d {}/{} page {} q/kv/o {}/{}/{}{}{}{}{} seed {}", kind_name(kind),
                     to_string(format), to_string(layout), lens(qo_lens), lens(kv_lens), num_qo_heads, num_kv_heads,
                     head_dim_qk, head_dim_vo ? head_dim_vo : head_dim_qk, page_size, to_string(q_dtype),
                     to_string(kv_dtype), to_string(o_dtype), combined_kv ? " combined-kv" : "",
                     padded_strides ? " padded" : (padded_v_only ? " padded-v" : ""),
                     plan.deterministic ? " deterministic" : "", opts, seed);
}

void PrintTo(const CaseSpec& spec, std::ostream* os) { *os << spec.describe(); }

Case make_case(const CaseSpec& spec) {
  Case c;
  c.spec = spec;
  const CaseSpec& s = spec;
  std::mt19937_64 rng(s.seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  c.batch = static_cast<int32_t>(s.qo_lens.size());
  const int32_t B = c.batch, Hq = s.num_qo_heads, Hk = s.num_kv_heads, dqk = s.head_dim_qk, dvo = c.head_dim_vo();
  const int32_t pad = s.padded_strides ? 8 : 0;
  c.qo_indptr.assign(B + 1, 0);
  for (int32_t b = 0; b < B; ++b) c.qo_indptr[b + 1] = c.qo_indptr[b] + s.qo_lens[b];
  const int64_t total_qo = c.qo_indptr[B];

  // Queries: [total_qo, Hq, dqk] with optional padding between heads and tokens.
  {
    const int64_t head_stride = dqk + pad, tok_stride = Hq * head_stride + pad;
    c.q = Buffer::make(s.q_dtype, static_cast<size_t>(std::max<int64_t>(1, total_qo * tok_stride)));
    fill_nan(c.q);
    c.q_vals.resize(static_cast<size_t>(total_qo) * Hq * dqk);
    for (int64_t t = 0; t < total_qo; ++t)
      for (int32_t h = 0; h < Hq; ++h)
        for (int32_t d = 0; d < dqk; ++d)
          c.q_vals[(t * Hq + h) * dqk + d] = put(c.q.data(), s.q_dtype, t * tok_stride + h * head_stride + d, 2.f * uni(rng));
    c.q_view = TensorView(c.q.data(), s.q_dtype, {total_qo, Hq, dqk}, {tok_stride, head_stride, 1});
  }

  // Logical K/V per request; stored values are what the dtype can hold (fp8: scaled into its range).
  const float k_div = s.k_scale, v_div = s.v_scale;
  c.k_vals.resize(B);
  c.v_vals.resize(B);
  // Request b's K then V values are one splitmix64 stream from a state drawn in order; value n of it only needs
  // state + n * gamma, so chunks of it are drawn in parallel and give the same values as one sequential pass.
  struct Chunk {
    float* out;
    int64_t count;
    uint64_t state;
    float div;
  };
  std::vector<Chunk> chunks;
  constexpr int64_t kChunk = 1 << 16;
  for (int32_t b = 0; b < B; ++b) {
    c.k_vals[b].resize(static_cast<size_t>(s.kv_lens[b]) * Hk * dqk);
    c.v_vals[b].resize(static_cast<size_t>(s.kv_lens[b]) * Hk * dvo);
    const uint64_t state = rng();
    const int64_t nk = static_cast<int64_t>(c.k_vals[b].size()), nv = static_cast<int64_t>(c.v_vals[b].size());
    for (int64_t n = 0; n < nk; n += kChunk)
      chunks.push_back(
          {c.k_vals[b].data() + n, std::min(kChunk, nk - n), state + static_cast<uint64_t>(n) * kGamma, k_div});
    for (int64_t n = 0; n < nv; n += kChunk)
      chunks.push_back({c.v_vals[b].data() + n, std::min(kChunk, nv - n),
                        state + static_cast<uint64_t>(nk + n) * kGamma, v_div});
  }
  parallel_for(static_cast<int64_t>(chunks.size()), [&](int64_t i) {
    Chunk ch = chunks[static_cast<size_t>(i)];
    for (int64_t n = 0; n < ch.count; ++n) ch.out[n] = fast_uniform(ch.state) / ch.div;
  });

  // KV storage.
  int64_t total_kv = 0;
  for (int32_t b = 0; b < B; ++b) total_kv += s.kv_lens[b];
  auto store_kv = [&](const TensorView& k, const TensorView& v, auto&& locate) {
    // locate(b, t) -> (page, slot); writes logical values and replaces them by what was stored. Tokens own
    // disjoint slots, so blocks of them are stored in parallel.
    constexpr int32_t kTokens = 256;
    std::vector<std::pair<int32_t, int32_t>> blocks;  // (request, first token)
    for (int32_t b = 0; b < B; ++b)
      for (int32_t t = 0; t < s.kv_lens[b]; t += kTokens) blocks.emplace_back(b, t);
    parallel_for(static_cast<int64_t>(blocks.size()), [&](int64_t n) {
      const auto [b, t0] = blocks[static_cast<size_t>(n)];
      for (int32_t t = t0; t < std::min(t0 + kTokens, s.kv_lens[b]); ++t) {
        const auto [page, slot] = locate(b, t);
        const bool nhd = s.format == KVFormat::kRagged || s.layout == KVLayout::kNHD;
        for (int32_t h = 0; h < Hk; ++h) {
          const int64_t ko = page * k.strides[0] + (s.format == KVFormat::kRagged ? 0 : slot * k.strides[nhd ? 1 : 2]) +
                             h * k.strides[s.format == KVFormat::kRagged ? 1 : (nhd ? 2 : 1)];
          const int64_t vo = page * v.strides[0] + (s.format == KVFormat::kRagged ? 0 : slot * v.strides[nhd ? 1 : 2]) +
                             h * v.strides[s.format == KVFormat::kRagged ? 1 : (nhd ? 2 : 1)];
          float* kl = &c.k_vals[b][(static_cast<size_t>(t) * Hk + h) * dqk];
          float* vl = &c.v_vals[b][(static_cast<size_t>(t) * Hk + h) * dvo];
          // Store whole rows, then read back what the dtype kept: the logical values are the stored ones.
          cpu::store_row(k.data, s.kv_dtype, ko, dqk, kl);
          cpu::load_row(k.data, s.kv_dtype, ko, dqk, 1.f, kl);
          cpu::store_row(v.data, s.kv_dtype, vo, dvo, vl);
          cpu::load_row(v.data, s.kv_dtype, vo, dvo, 1.f, vl);
        }
      }
    });
  };

  if (s.format == KVFormat::kRagged) {
    const int64_t rows = total_kv + std::max(0, s.spare_pages);
    const int64_t k_row = Hk * (dqk + pad) + pad, v_row = Hk * (dvo + pad) + pad;
    c.kv = Buffer::make(s.kv_dtype, static_cast<size_t>(std::max<int64_t>(1, rows * (k_row + v_row))));
    fill_nan(c.kv);
    c.ragged.k = TensorView(c.kv.data(), s.kv_dtype, {rows, Hk, dqk}, {k_row, dqk + pad, 1});
    c.ragged.v = TensorView(static_cast<uint8_t*>(c.kv.data()) + rows * k_row * dtype_bytes(s.kv_dtype), s.kv_dtype,
                            {rows, Hk, dvo}, {v_row, dvo + pad, 1});
    c.indptr = Buffer::make(DType::kInt32, B + 1);
    int32_t* ip = static_cast<int32_t*>(c.indptr.data());
    ip[0] = 0;
    for (int32_t b = 0; b < B; ++b) ip[b + 1] = ip[b] + s.kv_lens[b];
    store_kv(c.ragged.k, c.ragged.v, [&](int32_t b, int32_t t) { return std::pair<int64_t, int64_t>{ip[b] + t, 0}; });
    c.ragged.indptr = TensorView(ip, DType::kInt32, {B + 1});
    c.ragged.k_scale = s.k_scale;
    c.ragged.v_scale = s.v_scale;
  } else {
    const int32_t ps = s.page_size;
    std::vector<int32_t> pages_of(B);
    int64_t used = 0;
    int32_t max_pages = 0;
    for (int32_t b = 0; b < B; ++b) {
      pages_of[b] = (s.kv_lens[b] + ps - 1) / ps;
      used += pages_of[b];
      max_pages = std::max(max_pages, pages_of[b]);
    }
    const int64_t num_pages = used + std::max(0, s.spare_pages);
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    // Page layout: [ps, Hk, d] (NHD) or [Hk, ps, d] (HND), rows padded by `pad` (V's by 8 with padded_v_only).
    const bool nhd = s.layout == KVLayout::kNHD;
    auto page_dims = [&](int32_t d, int32_t row_pad, int64_t* page_elems, int64_t* tok_stride, int64_t* head_stride) {
      const int64_t row = d + row_pad;
      if (nhd) {
        *head_stride = row;
        *tok_stride = Hk * row + row_pad;
        *page_elems = ps * *tok_stride + row_pad;
      } else {
        *tok_stride = row;
        *head_stride = ps * row + row_pad;
        *page_elems = Hk * *head_stride + row_pad;
      }
    };
    int64_t kpe, kts, khs, vpe, vts, vhs;
    page_dims(dqk, pad, &kpe, &kts, &khs);
    page_dims(dvo, s.padded_v_only ? 8 : pad, &vpe, &vts, &vhs);
    const bool combined = s.combined_kv && dqk == dvo;
    c.kv = Buffer::make(s.kv_dtype, static_cast<size_t>(std::max<int64_t>(1, num_pages * (kpe + vpe))));
    fill_nan(c.kv);
    const int64_t k_page_stride = combined ? kpe + vpe : kpe;
    const int64_t v_page_stride = combined ? kpe + vpe : vpe;
    uint8_t* base = static_cast<uint8_t*>(c.kv.data());
    uint8_t* vbase = base + (combined ? kpe : num_pages * kpe) * dtype_bytes(s.kv_dtype);
    if (nhd) {
      c.paged.k = TensorView(base, s.kv_dtype, {num_pages, ps, Hk, dqk}, {k_page_stride, kts, khs, 1});
      c.paged.v = TensorView(vbase, s.kv_dtype, {num_pages, ps, Hk, dvo}, {v_page_stride, vts, vhs, 1});
    } else {
      c.paged.k = TensorView(base, s.kv_dtype, {num_pages, Hk, ps, dqk}, {k_page_stride, khs, kts, 1});
      c.paged.v = TensorView(vbase, s.kv_dtype, {num_pages, Hk, ps, dvo}, {v_page_stride, vhs, vts, 1});
    }
    c.paged.layout = s.layout;
    c.paged.k_scale = s.k_scale;
    c.paged.v_scale = s.v_scale;

    std::vector<std::vector<int32_t>> lists(B);
    int64_t next = 0;
    for (int32_t b = 0; b < B; ++b)
      for (int32_t j = 0; j < pages_of[b]; ++j) lists[b].push_back(perm[next++]);
    store_kv(c.paged.k, c.paged.v, [&](int32_t b, int32_t t) {
      return std::pair<int64_t, int64_t>{lists[b][t / ps], t % ps};
    });

    if (s.format == KVFormat::kPagedCSR) {
      c.indptr = Buffer::make(DType::kInt32, B + 1);
      c.page_ids = Buffer::make(DType::kInt32, used + 2);
      c.last_page_len = Buffer::make(DType::kInt32, std::max(1, B));
      int32_t* ip = static_cast<int32_t*>(c.indptr.data());
      int32_t* ids = static_cast<int32_t*>(c.page_ids.data());
      int32_t* last = static_cast<int32_t*>(c.last_page_len.data());
      ip[0] = 0;
      for (int32_t b = 0; b < B; ++b) {
        for (int32_t j = 0; j < pages_of[b]; ++j) ids[ip[b] + j] = lists[b][j];
        ip[b + 1] = ip[b] + pages_of[b];
        last[b] = pages_of[b] == 0 ? 0 : s.kv_lens[b] - (pages_of[b] - 1) * ps;
      }
      ids[used] = ids[used + 1] = -1;  // entries past indptr[batch] are never read
      c.paged.table = PageTable::csr(TensorView(ip, DType::kInt32, {B + 1}), TensorView(ids, DType::kInt32, {used + 2}),
                                     TensorView(last, DType::kInt32, {B}));
    } else {
      const int32_t cols = max_pages + 1;
      c.block_table = Buffer::make(DType::kInt32, static_cast<size_t>(std::max(1, B * cols)));
      c.seq_lens = Buffer::make(DType::kInt32, std::max(1, B));
      int32_t* bt = static_cast<int32_t*>(c.block_table.data());
      int32_t* sl = static_cast<int32_t*>(c.seq_lens.data());
      std::fill(bt, bt + B * cols, -1);  // unused entries: any read of them is a bug
      for (int32_t b = 0; b < B; ++b) {
        for (int32_t j = 0; j < pages_of[b]; ++j) bt[b * cols + j] = lists[b][j];
        sl[b] = s.kv_lens[b];
      }
      c.paged.table = PageTable::blocks(TensorView(bt, DType::kInt32, {B, cols}), TensorView(sl, DType::kInt32, {B}));
    }
  }

  // Options.
  const OptionSpec& o = s.options;
  AttentionOptions& opt = c.options;
  opt.sm_scale = o.sm_scale;
  opt.causal = o.causal;
  opt.window_left = o.window_left;
  opt.window_right = o.window_right;
  opt.logits_soft_cap = o.soft_cap;
  if (o.alibi) {
    c.alibi.resize(Hq);
    for (int32_t h = 0; h < Hq; ++h) c.alibi[h] = std::exp2(-8.f * (h + 1) / Hq);
    c.alibi_buf = Buffer::make(DType::kFloat32, Hq);
    std::memcpy(c.alibi_buf.data(), c.alibi.data(), Hq * sizeof(float));
    opt.alibi_slopes = TensorView(c.alibi_buf.data(), DType::kFloat32, {Hq});
  }
  if (o.sinks) {
    c.sinks.resize(Hq);
    for (float& x : c.sinks) x = 1.5f * uni(rng) + 0.5f;
    c.sinks_buf = Buffer::make(DType::kFloat32, Hq);
    std::memcpy(c.sinks_buf.data(), c.sinks.data(), Hq * sizeof(float));
    opt.sinks = TensorView(c.sinks_buf.data(), DType::kFloat32, {Hq});
  }
  if (o.custom_mask) {
    c.mask_indptr.assign(B + 1, 0);
    std::bernoulli_distribution keep(0.7);
    for (int32_t b = 0; b < B; ++b) {
      const int64_t bits = static_cast<int64_t>(s.qo_lens[b]) * s.kv_lens[b];
      c.mask_indptr[b + 1] = c.mask_indptr[b] + static_cast<int32_t>((bits + 7) / 8);
    }
    c.mask_bits.assign(c.mask_indptr[B], 0);
    for (int32_t b = 0; b < B; ++b) {
      const int64_t bits = static_cast<int64_t>(s.qo_lens[b]) * s.kv_lens[b];
      for (int64_t k = 0; k < bits; ++k)
        if (keep(rng)) c.mask_bits[c.mask_indptr[b] + k / 8] |= static_cast<uint8_t>(1u << (k % 8));
    }
    c.mask_buf = Buffer::make(DType::kUInt8, std::max<size_t>(1, c.mask_bits.size()));
    std::memcpy(c.mask_buf.data(), c.mask_bits.data(), c.mask_bits.size());
    c.mask_indptr_buf = Buffer::make(DType::kInt32, B + 1);
    std::memcpy(c.mask_indptr_buf.data(), c.mask_indptr.data(), (B + 1) * sizeof(int32_t));
    opt.custom_mask.bits = TensorView(c.mask_buf.data(), DType::kUInt8, {static_cast<int64_t>(c.mask_bits.size())});
    opt.custom_mask.indptr = TensorView(c.mask_indptr_buf.data(), DType::kInt32, {B + 1});
  }
  if (o.rope) {
    opt.rope.enabled = true;
    opt.rope.rotary_dim = o.rotary_dim;
    opt.rope.interleave = o.rope_interleave;
    opt.rope.theta = 1e4f;
    opt.rope.scale = 1.f;
    if (o.rope_llama31) {
      opt.rope.theta = 5e5f;
      opt.rope.llama31_factor = 8.f;
      opt.rope.llama31_low_freq_factor = 1.f;
      opt.rope.llama31_high_freq_factor = 4.f;
      opt.rope.llama31_old_context_len = 64.f;  // small, so test lengths reach every branch of the scaling
    }
    if (o.rope_offsets) {
      c.pos_offset.resize(B);
      std::uniform_int_distribution<int32_t> off(0, 64);
      for (int32_t& x : c.pos_offset) x = off(rng);
      c.pos_offset_buf = Buffer::make(DType::kInt32, std::max(1, B));
      std::memcpy(c.pos_offset_buf.data(), c.pos_offset.data(), B * sizeof(int32_t));
      opt.rope.pos_offset = TensorView(c.pos_offset_buf.data(), DType::kInt32, {B});
    }
  }

  // Outputs with guard rows before and after.
  c.out_guard = static_cast<int64_t>(Hq) * dvo;
  c.out = Buffer::make(s.o_dtype, static_cast<size_t>(total_qo * Hq * dvo + 2 * c.out_guard));
  c.out_view = TensorView(static_cast<uint8_t*>(c.out.data()) + c.out_guard * dtype_bytes(s.o_dtype), s.o_dtype,
                          {total_qo, Hq, dvo});
  c.lse = Buffer::make(DType::kFloat32, static_cast<size_t>(total_qo * Hq + 2 * Hq));
  c.lse_view = TensorView(static_cast<float*>(c.lse.data()) + Hq, DType::kFloat32, {total_qo, Hq});
  c.poison_outputs();
  return c;
}

void Case::poison_outputs() {
  fill_nan(out);
  fill_nan(lse);
}

bool Case::guards_intact() const {
  const int64_t n = static_cast<int64_t>(out.count);
  for (int64_t i = 0; i < out_guard; ++i) {
    if (!std::isnan(cpu::load_one(out.data(), out.dtype, i))) return false;
    if (!std::isnan(cpu::load_one(out.data(), out.dtype, n - 1 - i))) return false;
  }
  const float* l = static_cast<const float*>(lse.data());
  const int32_t Hq = spec.num_qo_heads;
  for (int32_t i = 0; i < Hq; ++i)
    if (!std::isnan(l[i]) || !std::isnan(l[lse.count - 1 - i])) return false;
  return true;
}

BatchPlanArgs Case::plan_args() const {
  BatchPlanArgs a;
  a.device = Device::cpu();
  a.shape = {spec.num_qo_heads, spec.num_kv_heads, spec.head_dim_qk, head_dim_vo(), spec.q_dtype, spec.kv_dtype, spec.o_dtype};
  a.qo_indptr = TensorView(const_cast<int32_t*>(qo_indptr.data()), DType::kInt32, {batch + 1});
  if (spec.format == KVFormat::kRagged)
    a.set_ragged(ragged.indptr);
  else
    a.set_paged(paged.table, spec.page_size);
  a.options = spec.plan;
  a.options.causal = a.options.causal || spec.options.causal;
  return a;
}

AttentionPlan plan_and_run(Case& c) {
  const BatchPlanArgs args = c.plan_args();
  AttentionPlan plan = c.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
  Buffer ws = Buffer::make(DType::kUInt8, plan.workspace_bytes);
  const Workspace w{plan.workspace_bytes ? ws.data() : nullptr, plan.workspace_bytes};
  const Outputs outs{c.out_view, c.lse_view};
  if (c.spec.format == KVFormat::kRagged)
    run(plan, c.q_view, c.ragged, outs, c.options, w);
  else
    run(plan, c.q_view, c.paged, outs, c.options, w);
  return plan;
}

}  // namespace attnforge::testing
