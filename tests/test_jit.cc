// The run-time compiler and its kernel cache, without a GPU (NVRTC compiles on the host): every built-in decode
// and prefill kernel compiles for sm_80 and sm_90a from the embedded headers alone; keys, their names and their
// errors; the launch configuration; the cache key, the entry format, the cache modes, unsafe directories, damaged
// entries, and several processes and threads compiling one key at once; warm-up.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attnforge/error.h"
#include "attnforge/jit.h"
#include "backends/cuda/decode/decode.h"
#include "backends/cuda/jit_kernels.h"
#include "backends/cuda/prefill/prefill.h"
#include "jit/embedded_headers.h"
#include "jit/kernel_cache.h"
#include "jit/kernel_key.h"
#include "backends/cuda/tma.h"
#include "tma_probe.h"
#include "wgmma_probe.h"
#include "jit/nvrtc_compiler.h"
#include "testing/variant_reference.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace attnforge;
using namespace attnforge::jit;

namespace {

// The cheapest decode key to compile.
KernelKey small_key() {
  KernelKey k;
  k.q_dtype = k.kv_dtype = DType::kFloat16;
  k.head_dim_qk = k.head_dim_vo = 64;
  k.arch = "sm_80";
  return k;
}

// The module every cache test compiles: the small key's name, architecture and warm-up command (what the cache's
// log lines and errors name) over a kernel that compiles in a fraction of a second. The cache neither knows nor
// checks what a source holds; the decode kernel, compiled 19 times over in these tests at 5-10 s each, bought them
// nothing (the JitCompile tests compile it).
KernelSource small_source() {
  KernelSource s = small_key().render();
  s.source = "// attnforge kernel cache test\n"
             "__global__ void cache_test_kernel(float* x) { x[threadIdx.x] = 2.0f * x[threadIdx.x] + 1.0f; }\n";
  s.entry_points = {"&cache_test_kernel"};
  return s;
}

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "attnforge-jit-test-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, ec);
    fs::remove_all(path, ec);
  }
};

// Settings writing into `dir`, with the log lines collected.
struct Logged {
  std::mutex mutex;
  std::vector<std::string> lines;
  CacheSettings settings(const fs::path& dir, CacheMode mode = CacheMode::kOn) {
    CacheSettings s;
    s.dir = dir.string();
    s.mode = mode;
    s.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex);
      lines.push_back(line);
    };
    return s;
  }
  bool contains(const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const std::string& l : lines)
      if (l.find(text) != std::string::npos) return true;
    return false;
  }
};

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

fs::path entry_path(const fs::path& dir, const KernelSource& src) {
  return dir / entry_file_name(src.name, cache_key(src, compile_options(src.arch, src.default_device)));
}

// ---- compiling ----

// Compiles every key's rendered source on two threads; returns one message per key, empty when its module names
// the attention kernel (and nothing else: the merge kernels are a module of their own) and holds an ELF cubin (and,
// with `no_spills`, ptxas reported no spill).
std::vector<std::string> compile_all(const std::vector<KernelKey>& keys, bool no_spills) {
  std::vector<std::string> failures(keys.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < keys.size(); i = next++) {
      try {
        const CompiledModule m = compile(keys[i].render());
        if (m.lowered_names.size() != 1 || m.lowered_names[kAttentionEntry].empty())
          failures[i] = fmt::format("{} kernel names, expected the attention kernel's alone", m.lowered_names.size());
        else if (m.binary.size() < 4 || m.binary.compare(0, 4, "\x7f" "ELF") != 0)
          failures[i] = "not an ELF cubin";
        else if (no_spills && m.log.find("spill") != std::string::npos)
          failures[i] = "ptxas: " + m.log;
      } catch (const std::exception& e) {
        failures[i] = e.what();
      }
    }
  };
  std::thread a(worker), b(worker);
  a.join(), b.join();
  return failures;
}

// Every built-in decode configuration (head_dim 64/128/256 x fp16/bf16 Q x K/V in Q's dtype, e4m3 or e5m2, at
// the stages run() launches by default, and the small-batch pipeline's three stages where
// small_batch_decode_stages names them), for sm_80 and sm_90a (sm_90a converts e4m3 with cvt, sm_80 by bit
// arithmetic): 44 compiles on two threads. ptxas reports no spill.
TEST(JitCompile, EveryBuiltinDecodeKernelForSm80AndSm90a) {
  std::vector<KernelKey> keys;
  for (const char* arch : {"sm_80", "sm_90a"})
    for (int32_t d : {64, 128, 256})
      for (DType t : {DType::kFloat16, DType::kBFloat16})
        for (DType kv : {t, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
          AttentionShape shape{32, 8, d, d, t, kv, t};
          keys.push_back(decode_key(shape, arch));
          if (const int stages = attnforge::cuda::small_batch_decode_stages(d, t, kv))
            keys.push_back(decode_key(shape, arch, DecodeTile{stages}));
        }
  EXPECT_EQ(keys.size(), 44u);
  const std::vector<std::string> failures = compile_all(keys, /*no_spills=*/true);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(failures[i].empty()) << keys[i].name() << ": " << failures[i];
}

// The split-KV merge modules of each architecture: the merge kernel alone ("merge_sm90a", what every split plan
// launches), and the streamed merge alone ("merge_stream_sm90a", only under ATTNFORGE_DECODE_KERNEL_MERGE=stream);
// each an ELF cubin of its own kernel and not the other's (nor merge_states_kernel, the nvcc build's operator), no
// spill; nothing but the merge kernel header in their sources.
TEST(JitCompile, MergeModulesForSm80AndSm90a) {
  for (const char* arch : {"sm_80", "sm_90a"})
    for (bool streamed : {false, true}) {
      const KernelSource src = merge_source(arch, streamed);
      const std::string kernel = streamed ? "merge_stream_kernel" : "merge_kernel";
      const std::string other = streamed ? "merge_kernel" : "merge_stream_kernel";
      EXPECT_EQ(src.name, std::string(streamed ? "merge_stream_" : "merge_") +
                              (arch == std::string("sm_80") ? "sm80" : "sm90a"));
      ASSERT_EQ(src.entry_points.size(), 1u);
      EXPECT_EQ(src.entry_points[kMergeEntry], "&attnforge::cuda::" + kernel);
      EXPECT_NE(src.source.find("#include \"backends/cuda/merge/merge_kernel.cuh\""), std::string::npos);
      EXPECT_EQ(src.source.find("decode_kernel"), std::string::npos) << src.source;
      const CompiledModule m = compile(src);
      ASSERT_EQ(m.lowered_names.size(), 1u) << src.name;
      EXPECT_NE(m.lowered_names[0].find(kernel), std::string::npos) << m.lowered_names[0];
      ASSERT_GE(m.binary.size(), 4u);
      EXPECT_EQ(m.binary.compare(0, 4, "\x7f" "ELF"), 0) << src.name;
      // Symbol names in the cubin: "...19merge_stream_kernel..." or "...12merge_kernel..." (mangled lengths).
      EXPECT_EQ(m.binary.find(std::to_string(other.size()) + other), std::string::npos) << src.name << " holds " << other;
      EXPECT_EQ(m.binary.find("merge_states_kernel"), std::string::npos) << src.name;
      EXPECT_EQ(m.log.find("spill"), std::string::npos) << src.name << ": " << m.log;
    }
  try {
    merge_source("compute_90");
    ADD_FAILURE() << "merge_source accepted a virtual architecture";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("arch 'compute_90'"), std::string::npos) << e.what();
  }
}

// The wgmma probe kernels (tests/wgmma_probe.h) compile for sm_90a, and their SASS is the warpgroup product the
// prefill kernel will be built on: an ELF cubin naming both kernels, no spill.
TEST(JitCompile, WgmmaProbeKernelsForSm90a) {
  const CompiledModule m = compile(attnforge::testing::wgmma_probe_source());
  ASSERT_EQ(m.lowered_names.size(), std::size(attnforge::testing::kWgmmaProbes));
  for (const std::string& name : m.lowered_names) EXPECT_FALSE(name.empty());
  ASSERT_GE(m.binary.size(), 4u);
  EXPECT_EQ(m.binary.compare(0, 4, "\x7f" "ELF"), 0);
  EXPECT_EQ(m.log.find("spill"), std::string::npos) << m.log;
}

// The tensor-memory-accelerator probe (tests/tma_probe.h: tensor-map boxes into wgmma panels, an mbarrier counting
// their bytes) compiles for sm_90a without spills.
TEST(JitCompile, TmaProbeKernelForSm90a) {
  const CompiledModule m = compile(attnforge::testing::tma_probe_source());
  ASSERT_EQ(m.lowered_names.size(), 1u);
  EXPECT_FALSE(m.lowered_names[0].empty());
  ASSERT_GE(m.binary.size(), 4u);
  EXPECT_EQ(m.binary.compare(0, 4, "\x7f" "ELF"), 0);
  EXPECT_EQ(m.log.find("spill"), std::string::npos) << m.log;
}

// A bf16 NHD paged cache of 8 KV heads of head_dim 128 and pages of `page` tokens, for the tensor-map checks (no
// memory behind it but a 16-byte aligned address).
KVParams nhd_paged_kv(int page) {
  alignas(16) static uint16_t cache[64];
  KVParams kv{};
  kv.k = kv.v = cache;
  kv.dtype = DType::kBFloat16;
  kv.format = KVFormat::kPagedCSR;
  kv.page_size = page, kv.num_kv_heads = 8, kv.num_pages = 100;
  kv.k_stride_head = kv.v_stride_head = 128;
  kv.k_stride_token = kv.v_stride_token = 8 * 128;
  kv.k_stride_page = kv.v_stride_page = int64_t{page} * 8 * 128;
  return kv;
}

// K/V layouts a tensor map cannot describe are refused before the driver is asked (no GPU or driver needed), each
// error naming the value and what is allowed.
TEST(TmaMaps, LayoutsTheMapCannotDescribeAreRefusedByName) {
  const KVParams kv = nhd_paged_kv(16);
  auto refusal = [](const KVParams& p, int head_dim, cuda::KVBox box) -> std::string {
    try {
      cuda::kv_tensor_map(p, false, head_dim, box);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
      return e.what();
    }
    return "";
  };
  KVParams fp8 = kv;
  fp8.dtype = DType::kFloat8E4M3;
  EXPECT_NE(refusal(fp8, 128, {16, 1}).find("allowed: bfloat16, float16"), std::string::npos);
  EXPECT_NE(refusal(kv, 96, {16, 1}).find("head_dim 96"), std::string::npos);
  EXPECT_NE(refusal(kv, 128, {32, 1}).find("32 slots"), std::string::npos);  // past the page
  EXPECT_NE(refusal(kv, 128, {16, 300}).find("300 pages"), std::string::npos);
  KVParams odd = kv;
  odd.k = static_cast<const uint8_t*>(kv.k) + 2;
  EXPECT_NE(refusal(odd, 128, {16, 1}).find("not 16-byte aligned"), std::string::npos);
  KVParams narrow = kv;
  narrow.k_stride_token = 4;  // 8 bytes
  EXPECT_NE(refusal(narrow, 128, {16, 1}).find("token stride of 8 bytes"), std::string::npos);
}

// Which K/V layouts the Hopper kernel's copier may take by tensor maps (prefill_tma), and in boxes of how
// many tokens: 16-bit pages of 8 tokens or more that divide or are divided by the tile, ragged rows; never fp8, short
// or odd pages, or strides the accelerator cannot step.
TEST(TmaMaps, BoxSlotsFollowTheLayout) {
  const auto paged = nhd_paged_kv;
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(16), 128), 16);
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(8), 64), 8);
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(256), 128), 128);  // two tiles a page
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(4), 128), 0);      // boxes of fewer than 8 rows
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(1), 128), 0);
  EXPECT_EQ(cuda::kv_tma_box_slots(paged(48), 128), 0);     // neither divides the other
  KVParams fp8 = paged(16);
  fp8.dtype = DType::kFloat8E4M3;
  EXPECT_EQ(cuda::kv_tma_box_slots(fp8, 128), 0);
  KVParams odd = paged(16);
  odd.v_stride_token = 8 * 128 + 4;  // 8 bytes past a 16-byte multiple
  EXPECT_EQ(cuda::kv_tma_box_slots(odd, 128), 0);
  KVParams unsized = paged(16);
  unsized.num_pages = 0;
  EXPECT_EQ(cuda::kv_tma_box_slots(unsized, 128), 0);
  KVParams ragged = paged(1);
  ragged.format = KVFormat::kRagged;
  ragged.page_size = 1;
  ragged.k_stride_head = ragged.v_stride_head = 128;
  ragged.k_stride_page = ragged.v_stride_page = 8 * 128;
  EXPECT_EQ(cuda::kv_tma_box_slots(ragged, 128), 1);
  // The map's axis order follows the strides: NHD's heads (the smaller stride) before its slots, HND's after.
  EXPECT_TRUE(cuda::kv_heads_inner(paged(16), false));
  KVParams hnd = paged(16);
  hnd.v_stride_token = 128, hnd.v_stride_head = 16 * 128;
  EXPECT_FALSE(cuda::kv_heads_inner(hnd, true));
  EXPECT_TRUE(cuda::kv_heads_inner(hnd, false));  // K keeps its own (NHD) strides
  EXPECT_TRUE(cuda::kv_heads_inner(ragged, true));
}

// Q copied and O written by boxes (prefill.h: qo_tma_fits, tma.h: qo_tensor_map): 16-bit Q, and O in Q's type,
// whose group of query heads divides the box's packed rows (128 of Q, 64 of O) and whose address and strides step
// in 16 bytes; every other layout keeps the threads' copies, and the map refuses it by name before the driver is
// asked.
TEST(TmaMaps, QueryAndOutputBoxesFollowTheLayout) {
  alignas(16) static uint16_t q[64], out[64];
  AttentionParams p{};
  p.q_dtype = p.o_dtype = DType::kBFloat16;
  p.q = q, p.o = out;
  p.num_qo_tokens = 100, p.num_qo_heads = 32;
  p.q_stride_head = p.o_stride_head = 128, p.q_stride_token = p.o_stride_token = 32 * 128;
  for (bool o : {false, true}) {
    EXPECT_TRUE(cuda::qo_tma_fits(p, o, 4, 64));
    EXPECT_TRUE(cuda::qo_tma_fits(p, o, 1, 64));
    EXPECT_FALSE(cuda::qo_tma_fits(p, o, 3, 64));  // 64 rows are not whole tokens
  }
  EXPECT_TRUE(cuda::qo_tma_fits(p, false, 128, 128));
  EXPECT_FALSE(cuda::qo_tma_fits(p, true, 128, 64));
  AttentionParams f32 = p;
  f32.o_dtype = DType::kFloat32;
  EXPECT_FALSE(cuda::qo_tma_fits(f32, true, 4, 64));
  EXPECT_TRUE(cuda::qo_tma_fits(f32, false, 4, 128));  // Q's own layout still fits
  AttentionParams odd = p;
  odd.o_stride_token = 32 * 128 + 4;
  odd.q_stride_head = 132;
  EXPECT_FALSE(cuda::qo_tma_fits(odd, true, 4, 64));
  EXPECT_FALSE(cuda::qo_tma_fits(odd, false, 4, 128));
  AttentionParams shifted = p;
  shifted.o = out + 1;
  EXPECT_FALSE(cuda::qo_tma_fits(shifted, true, 4, 64));
  EXPECT_TRUE(cuda::qo_tma_fits(shifted, false, 4, 128));
  auto refusal = [](const AttentionParams& a, bool o, int head_dim, int group, int rows) -> std::string {
    try {
      cuda::qo_tensor_map(a, o, head_dim, group, rows);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal(p, true, 128, 3, 64).find("group size 3"), std::string::npos);
  EXPECT_NE(refusal(p, false, 96, 4, 128).find("tensor map of Q: head_dim 96"), std::string::npos);
  EXPECT_NE(refusal(f32, true, 128, 4, 64).find("allowed: bfloat16, float16"), std::string::npos);
  EXPECT_NE(refusal(odd, true, 128, 4, 64).find("token stride of 8200 bytes"), std::string::npos);
  EXPECT_NE(refusal(odd, false, 128, 4, 128).find("head stride of 264 bytes"), std::string::npos);
  EXPECT_NE(refusal(shifted, true, 128, 4, 64).find("not 16-byte aligned"), std::string::npos);
}

// Custom variants (testing/variant_reference.h: sigmoid without softmax, a per-head bias with its own mask, logits
// written to a tensor, query/key/output transforms, and the built-in options as hooks) in the decode and prefill
// kernels, for sm_80 and sm_90a, with NVRTC's -default-device for their plain C++ hooks; names carry the source
// hash. A custom prefill key with fused RoPE is refused (variants do their own).
TEST(JitCompile, CustomVariantsInTheDecodeAndPrefillKernels) {
  std::vector<KernelKey> keys;
  const AttentionShape shape{28, 4, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kFloat32};
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const CustomVariant* v : {&attnforge::testing::Sigmoid_variant, &attnforge::testing::HeadBias_variant,
                                   &attnforge::testing::LogitsOut_variant, &attnforge::testing::Shaped_variant}) {
      for (KernelKey k : {decode_key(shape, arch), prefill_key(shape, arch, false)}) {
        k.set_variant(v->name, v->source);
        keys.push_back(k);
      }
    }
  for (KernelKey k : {decode_key(AttentionShape{32, 8, 64, 64, DType::kFloat16, DType::kFloat16, DType::kFloat16}, "sm_90a"),
                      prefill_key(AttentionShape{32, 8, 256, 256, DType::kFloat16, DType::kFloat16, DType::kFloat16},
                                  "sm_90a", false)}) {
    k.set_variant(builtin_variant().name, builtin_variant().source);
    keys.push_back(k);
  }
  const std::vector<std::string> failures = compile_all(keys, /*no_spills=*/false);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(failures[i].empty()) << keys[i].name() << ": " << failures[i];
  EXPECT_NE(keys[0].name().find("decode_Sigmoid_"), std::string::npos) << keys[0].name();
  EXPECT_NE(keys[1].name().find("prefill_Sigmoid_"), std::string::npos) << keys[1].name();
  EXPECT_NE(keys[1].render().source.find("prefill_variant_kernel<"), std::string::npos);
  KernelKey other = keys[0];
  other.set_variant("Sigmoid", attnforge::testing::Sigmoid_variant.source + " ");
  EXPECT_NE(other.name(), keys[0].name()) << "another source under the same name must be another kernel";
  KernelKey rope = prefill_key(shape, "sm_90a", true);
  rope.set_variant("Sigmoid", attnforge::testing::Sigmoid_variant.source);
  try {
    rope.validate();
    ADD_FAILURE() << "a custom variant in a prefill key with fused RoPE was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a custom prefill key takes rope {false}"), std::string::npos) << e.what();
  }
}

// Every built-in prefill configuration run() launches (head_dim 64/128/256 x fp16/bf16 x RoPE off/on, the default
// tiles), for sm_80 and sm_90a, from the source its key renders: 24 compiles on two threads; and the stages of two
// softmax steps on sm_90a (3 more). Spills are not checked: the nvcc build of these kernels spills a few bytes too
// (prefill_kernel.cuh).
TEST(JitCompile, EveryBuiltinPrefillKernelForSm80AndSm90a) {
  std::vector<KernelKey> keys;
  for (const char* arch : {"sm_80", "sm_90a"})
    for (int32_t d : {64, 128, 256})
      for (DType t : {DType::kFloat16, DType::kBFloat16})
        for (bool rope : {false, true})
          keys.push_back(prefill_key({32, 8, d, d, t, t, t}, arch, rope));
  for (int32_t d : {64, 128, 256})
    keys.push_back(prefill_key({32, 8, d, d, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, "sm_90a", false,
                               PrefillTile{2}));
  // The short row tile (one m16 tile per warp), which run() picks for plans of short query tiles.
  for (const char* arch : {"sm_80", "sm_90a"})
    for (int32_t d : {64, 128})
      for (bool rope : {false, true})
        keys.push_back(prefill_key({32, 8, d, d, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, arch, rope,
                                   PrefillTile{1, 64}));
  const std::vector<std::string> failures = compile_all(keys, /*no_spills=*/false);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(failures[i].empty()) << keys[i].name() << ": " << failures[i];
}

// The embedded text is the source tree's, and every kernel header is there.
TEST(JitEmbedded, HeadersMatchTheSourceTree) {
  std::vector<std::string> names;
  for (const EmbeddedHeader& h : embedded_headers()) {
    names.push_back(h.name);
    const bool api = std::string(h.name).rfind("attnforge/", 0) == 0;
    const fs::path p = fs::path(ATTNFORGE_SOURCE_DIR) / (api ? "include" : "src") / h.name;
    EXPECT_EQ(read_all(p), h.text) << h.name << " differs from " << p;
  }
  for (const char* expected : {"attnforge/kernel/params.h", "attnforge/kernel/types.h", "attnforge/kernel/variant.h",
                               "attnforge/kernel/state.h", "backends/cuda/decode/decode_kernel.cuh",
                               "backends/cuda/device/ptx.cuh"})
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected << " is not embedded";
}

TEST(JitCompile, ArchitectureOfADevice) {
  EXPECT_EQ(arch_for_device(9, 0), "sm_90a");
  EXPECT_EQ(arch_for_device(8, 0), "sm_80");
  EXPECT_EQ(arch_for_device(8, 6), "sm_86");
  EXPECT_EQ(arch_for_device(8, 9), "sm_89");
  try {
    arch_for_device(7, 5);
    ADD_FAILURE() << "7.5 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("7.5"), std::string::npos) << e.what();
  }
}

// ---- keys ----

TEST(JitKey, NamesAndRejectedFields) {
  KernelKey k;
  EXPECT_EQ(k.name(), "decode_d128_bf16_st2_sm90a");
  EXPECT_EQ(small_key().name(), "decode_d64_fp16_st2_sm80");
  KernelKey fp8 = k;
  fp8.kv_dtype = DType::kFloat8E4M3;
  fp8.decode_tile = default_decode_tile(fp8.kv_dtype);
  EXPECT_EQ(fp8.name(), "decode_d128_bf16_e4m3_st4_sm90a");
  EXPECT_NE(fp8.render().source.find("DecodeTraits<128, attnforge::cuda::Bf16, 4, attnforge::cuda::E4M3>"),
            std::string::npos);
  EXPECT_NE(fp8.warmup_command().find("--kv-dtype e4m3"), std::string::npos) << fp8.warmup_command();
  const AttentionShape e5m2_shape{32, 8, 64, 64, DType::kFloat16, DType::kFloat8E5M2, DType::kFloat16};
  EXPECT_EQ(decode_key(e5m2_shape, "sm_80").name(), "decode_d64_fp16_e5m2_st4_sm80");
  const AttentionShape bf16{32, 8, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const AttentionShape fp16{16, 8, 64, 64, DType::kFloat16, DType::kFloat16, DType::kFloat16};
  EXPECT_EQ(prefill_key(bf16, "sm_90a", true).name(), "prefill_d128_bf16_rope_sm90a");
  EXPECT_EQ(prefill_key(bf16, "sm_90a", false).name(), "prefill_d128_bf16_sm90a");
  EXPECT_EQ(prefill_key(fp16, "sm_80", false).name(), "prefill_d64_fp16_sm80");
  EXPECT_EQ(prefill_key(bf16, "sm_90a", false, PrefillTile{2}).name(), "prefill_d128_bf16_stage64_sm90a");
  EXPECT_EQ(prefill_key(bf16, "sm_90a", true, PrefillTile{1, 64}).name(), "prefill_d128_bf16_rope_rows64_sm90a");
  EXPECT_EQ(prefill_key(bf16, "sm_90a", false, PrefillTile{2, 64}).name(), "prefill_d128_bf16_stage64_rows64_sm90a");
  // A tile's rows equal to the head dim's own are the default key.
  EXPECT_EQ(prefill_key(bf16, "sm_90a", false, PrefillTile{1, 128}), prefill_key(bf16, "sm_90a", false));
  EXPECT_NE(prefill_key(bf16, "sm_80", false, PrefillTile{1, 64}).render().source.find(
                "PrefillTraits<128, attnforge::cuda::Bf16, false, 32, 64>"),
            std::string::npos);
  // Each change of a valid key, and the words of the error it must raise.
  struct Bad {
    std::function<void(KernelKey&)> change;
    const char* words;
  };
  auto rejects = [](const KernelKey& valid, const std::vector<Bad>& bads) {
    for (const Bad& bad : bads) {
      KernelKey key = valid;
      bad.change(key);
      try {
        key.render();
        ADD_FAILURE() << key.name() << " accepted; expected: " << bad.words;
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
        EXPECT_NE(std::string(e.what()).find(bad.words), std::string::npos) << e.what();
      }
    }
  };
  rejects(k, {
      {[](KernelKey& b) { b.head_dim_qk = b.head_dim_vo = 96; },
       "head_dim 96/96: the decode kernel takes equal Q/K and V head dims in {64, 128, 256}"},
      {[](KernelKey& b) { b.kv_dtype = DType::kFloat16; },
       "kv_dtype float16 with q_dtype bfloat16: the decode kernel takes K/V in {bfloat16, float8_e4m3, float8_e5m2}"},
      {[](KernelKey& b) { b.decode_tile.stages = 5; }, "decode_tile.stages 5: the decode kernel takes {2, 3}"},
      {[](KernelKey& b) { b.decode_tile.stages = 4; },
       "decode_tile.stages 4: the decode kernel takes {2, 3} ({2, 3, 4} with fp8 K/V)"},
      {[](KernelKey& b) { b.variant = "sigmoid"; }, "variant sigmoid: no source; set custom variants with KernelKey::set_variant"},
      {[](KernelKey& b) { b.variant_source = "struct X {};"; }, "variant builtin: takes no variant_source"},
      {[](KernelKey& b) { b.rope = true; },
       "rope true: the decode kernel reads RoPE from params at run time; a decode key takes {false}"},
      {[](KernelKey& b) { b.prefill_tile.stage_steps = 2; },
       "prefill_tile {stage_steps 2, rows 0}: a decode key takes the default {1, 0}"},
      {[](KernelKey& b) { b.family = static_cast<KernelFamily>(7); },
       "kernel family 7: the run-time compiler builds {decode, prefill}"},
  });
  rejects(fp8, {
      {[](KernelKey& b) { b.decode_tile.stages = 5; },
       "decode_tile.stages 5: the decode kernel takes {2, 3}, and {2, 3, 4} with fp8 K/V"},
  });
  rejects(prefill_key(bf16, "sm_90a", true), {
      {[](KernelKey& b) { b.head_dim_qk = b.head_dim_vo = 96; },
       "head_dim 96/96: the prefill kernel takes equal Q/K and V head dims in {64, 128, 256}"},
      {[](KernelKey& b) { b.head_dim_vo = 64; }, "head_dim 128/64: the prefill kernel"},
      {[](KernelKey& b) { b.q_dtype = b.kv_dtype = DType::kFloat32; },
       "q_dtype float32: the prefill kernel takes {bfloat16, float16}"},
      {[](KernelKey& b) { b.kv_dtype = DType::kFloat8E4M3; },
       "kv_dtype float8_e4m3 with q_dtype bfloat16: the prefill kernel takes K/V in {bfloat16} (fp8 K/V is not "
       "built for CUDA prefill yet)"},
      {[](KernelKey& b) { b.prefill_tile.stage_steps = 3; },
       "prefill_tile.stage_steps 3: the prefill kernel takes {1, 2}"},
      {[](KernelKey& b) { b.prefill_tile.rows = 32; },
       "prefill_tile.rows 32: the prefill kernel at head_dim 128 takes {0 (its 128 rows), 64}"},
      {[](KernelKey& b) { b.prefill_tile.rows = 128; },
       "prefill_tile.rows 128: the prefill kernel at head_dim 128 takes {0 (its 128 rows), 64}"},
      {[](KernelKey& b) { b.head_dim_qk = b.head_dim_vo = 256, b.prefill_tile.rows = 64; },
       "prefill_tile.rows 64: the prefill kernel at head_dim 256 takes {0 (its 64 rows)}"},
      {[](KernelKey& b) { b.decode_tile.stages = 3; }, "decode_tile.stages 3: a prefill key takes the default {2}"},
      {[](KernelKey& b) { b.arch = "hopper"; }, "arch 'hopper'"},
  });
  try {
    prefill_key({32, 8, 80, 80, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, "sm_90a", false);
    ADD_FAILURE() << "prefill_key accepted head_dim 80";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 80/80"), std::string::npos) << e.what();
  }
}

// Every valid key of both families has its own name, and its own source: two keys with one name would share a
// log line and a disk entry's readable name, two with one source would be the same kernel under two names.
TEST(JitKey, NamesAndSourcesAreUniqueAcrossFamilies) {
  std::vector<KernelKey> keys;
  for (const char* arch : {"sm_80", "sm_86", "sm_90a"})
    for (int32_t d : {64, 128, 256})
      for (DType t : {DType::kFloat16, DType::kBFloat16}) {
        const AttentionShape shape{32, 8, d, d, t, t, t};
        for (int32_t stages : {2, 3}) keys.push_back(decode_key(shape, arch, DecodeTile{stages}));
        for (DType kv : {DType::kFloat8E4M3, DType::kFloat8E5M2})
          for (int32_t stages : {2, 3, 4}) keys.push_back(decode_key({32, 8, d, d, t, kv, t}, arch, DecodeTile{stages}));
        for (bool rope : {false, true})
          for (int32_t steps : {1, 2}) {
            keys.push_back(prefill_key(shape, arch, rope, PrefillTile{steps}));
            if (d < 256) keys.push_back(prefill_key(shape, arch, rope, PrefillTile{steps, 64}));
          }
      }
  std::map<std::string, std::string> source_by_name;
  std::set<std::string> sources;
  for (const KernelKey& k : keys) {
    const KernelSource src = k.render();
    EXPECT_EQ(src.name, k.name());
    EXPECT_TRUE(source_by_name.emplace(src.name, src.source).second) << "two keys named " << src.name;
    EXPECT_TRUE(sources.insert(src.arch + " " + src.entry_points[0]).second)
        << "two keys build the kernel of " << src.name;
  }
  // Per arch, head dim and dtype: 2 decode, 6 fp8 decode, 4 prefill; and 4 short-tile prefill below head_dim 256.
  EXPECT_EQ(source_by_name.size(), 3u * 3 * 2 * (2 + 2 * 3 + 4) + 3u * 2 * 2 * 4);
}

// The prefill translation unit: the kernel header alone (the merge kernels are a module of their own), and the nvcc
// build's instantiation
// (PrefillTraits' default stage is one softmax step and its default rows the head dim's, so the nvcc build's
// PrefillTraits<128, Bf16, true> is this type).
TEST(JitKey, PrefillSourceInstantiatesTheTraitsOfTheKey) {
  const AttentionShape bf16{32, 8, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const KernelSource src = prefill_key(bf16, "sm_90a", true).render();
  EXPECT_EQ(src.name, "prefill_d128_bf16_rope_sm90a");
  EXPECT_EQ(src.arch, "sm_90a");
  ASSERT_EQ(src.entry_points.size(), 1u);
  EXPECT_EQ(src.entry_points[kAttentionEntry],
            "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<128, attnforge::cuda::Bf16, true, 32, 128>>");
  EXPECT_NE(src.source.find("#include \"backends/cuda/prefill/prefill_kernel.cuh\""), std::string::npos) << src.source;
  EXPECT_EQ(src.source.find("merge_kernel"), std::string::npos) << src.source;
  EXPECT_NE(src.source.find("template __global__ void attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<"
                            "128, attnforge::cuda::Bf16, true, 32, 128>>(const attnforge::AttentionParams);"),
            std::string::npos)
      << src.source;
  EXPECT_EQ(src.warmup_command, "attnforge warmup --arch sm_90a --head-dim 128 --dtype bf16 --kv-dtype same");
  const AttentionShape fp16{16, 8, 64, 64, DType::kFloat16, DType::kFloat16, DType::kFloat16};
  EXPECT_EQ(prefill_key(fp16, "sm_80", false, PrefillTile{2}).render().entry_points[kAttentionEntry],
            "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<64, attnforge::cuda::F16, false, 128, 128>>");
  EXPECT_EQ(prefill_key(fp16, "sm_80", false, PrefillTile{1, 64}).render().entry_points[kAttentionEntry],
            "&attnforge::cuda::prefill_kernel<attnforge::cuda::PrefillTraits<64, attnforge::cuda::F16, false, 64, 64>>");
}

// The cache key follows the content: the source, any embedded header's text, the options, the architecture and
// the entry points; it ignores nothing of them and depends on nothing else.
TEST(JitKey, ChangesWithHeaderTextOptionsAndArch) {
  const KernelSource src = KernelKey{}.render();
  const std::vector<std::string> options = compile_options(src.arch);
  const Hash128 base = cache_key(src, options);
  EXPECT_EQ(base, cache_key(KernelKey{}.render(), compile_options("sm_90a"))) << "the key is not deterministic";

  const auto headers = embedded_headers();
  for (size_t i = 0; i < headers.size(); ++i) {
    std::vector<EmbeddedHeader> changed(headers.begin(), headers.end());
    std::string text = changed[i].text;
    text += "\n// one more line\n";
    changed[i].text = text.c_str();
    EXPECT_NE(base, cache_key(src, options, changed)) << "editing " << headers[i].name << " kept the key";
  }
  std::vector<std::string> more = options;
  more.push_back("--use_fast_math");
  EXPECT_NE(base, cache_key(src, more));
  std::vector<std::string> fewer(options.begin(), options.end() - 1);
  EXPECT_NE(base, cache_key(src, fewer));

  KernelKey other;
  other.arch = "sm_80";
  EXPECT_NE(base, cache_key(other.render(), compile_options("sm_80")));
  other = KernelKey{};
  other.decode_tile.stages = 3;
  EXPECT_NE(base, cache_key(other.render(), options));
  KernelSource renamed = src;
  renamed.name = "another_name";  // a name is never part of the key
  EXPECT_EQ(base, cache_key(renamed, options));
  KernelSource entry = src;
  entry.entry_points.pop_back();
  EXPECT_NE(base, cache_key(entry, options));
}

// ---- the entry format ----

TEST(JitEntry, EveryTruncationAndEveryFlippedByteIsRejected) {
  CompiledModule m;
  m.name = "decode_test";
  m.lowered_names = {"_Z6decodev", "_Z5mergev"};
  m.binary = std::string(300, '\x5a');
  const Hash128 key{1, 2};
  const std::string bytes = encode_entry(key, m);
  const DecodedEntry good = decode_entry(key, bytes);
  ASSERT_TRUE(good.ok) << good.problem;
  EXPECT_EQ(good.module.binary, m.binary);
  EXPECT_EQ(good.module.lowered_names, m.lowered_names);
  EXPECT_EQ(good.module.name, m.name);
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(decode_entry(key, bytes.substr(0, n)).ok) << "length " << n;
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string flipped = bytes;
    flipped[i] ^= 0x10;
    EXPECT_FALSE(decode_entry(key, flipped).ok) << "byte " << i;
  }
  EXPECT_FALSE(decode_entry(Hash128{1, 3}, bytes).ok) << "an entry under another key's name";
  EXPECT_FALSE(decode_entry(key, bytes + "x").ok) << "trailing bytes";
}

// ---- the cache ----

TEST(JitCache, CompilesOncePublishesAndLoads) {
  TempDir tmp;
  const fs::path dir = tmp.path / "nested" / "cache";
  Logged log;
  KernelCache cache;
  const Lookup first = cache.get(small_source(), log.settings(dir));
  EXPECT_EQ(first.origin, Origin::kCompiled);
  EXPECT_TRUE(log.contains("compiling decode_d64_fp16_st2_sm80 for sm_80 (cache key " + first.key.hex()));
  EXPECT_TRUE(log.contains("compiled decode_d64_fp16_st2_sm80 in "));
  struct stat st;
  ASSERT_EQ(0, stat(dir.c_str(), &st));
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "the cache directory must be private";
  ASSERT_EQ(0, stat((tmp.path / "nested").c_str(), &st));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const std::vector<fs::path> files = files_in(dir);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], entry_path(dir, small_source()));

  EXPECT_EQ(cache.get(small_source(), log.settings(dir)).origin, Origin::kMemory);
  KernelCache fresh;  // another process, as far as memory goes
  const Lookup again = fresh.get(small_source(), log.settings(dir));
  EXPECT_EQ(again.origin, Origin::kDisk);
  EXPECT_EQ(again.module->binary, first.module->binary);
  EXPECT_EQ(again.module->lowered_names, first.module->lowered_names);
}

// A damaged and a truncated entry are recompiled (and republished), never loaded.
TEST(JitCache, CorruptedAndTruncatedEntriesAreRecompiled) {
  TempDir tmp;
  Logged log;
  const Lookup first = KernelCache().get(small_source(), log.settings(tmp.path));
  const fs::path entry = entry_path(tmp.path, small_source());
  const std::string good = read_all(entry);

  std::string corrupted = good;
  corrupted[corrupted.size() / 2] ^= 0x01;
  write_all(entry, corrupted);
  const Lookup after_corruption = KernelCache().get(small_source(), log.settings(tmp.path));
  EXPECT_EQ(after_corruption.origin, Origin::kCompiled);
  EXPECT_TRUE(log.contains("is unusable (the payload does not match its hash"));
  EXPECT_EQ(after_corruption.module->binary, first.module->binary);
  EXPECT_EQ(read_all(entry), good) << "the recompiled entry replaces the damaged one";

  write_all(entry, good.substr(0, good.size() / 2));
  const Lookup after_truncation = KernelCache().get(small_source(), log.settings(tmp.path));
  EXPECT_EQ(after_truncation.origin, Origin::kCompiled);
  EXPECT_TRUE(log.contains("truncated?"));
  EXPECT_EQ(read_all(entry), good);
  EXPECT_EQ(files_in(tmp.path).size(), 1u);
}

TEST(JitCache, ReadOnlyModeLoadsButNeverWrites) {
  TempDir tmp;
  Logged log;
  const Lookup compiled = KernelCache().get(small_source(), log.settings(tmp.path, CacheMode::kReadOnly));
  EXPECT_EQ(compiled.origin, Origin::kCompiled);
  EXPECT_TRUE(files_in(tmp.path).empty()) << "read-only mode wrote to the cache";
  EXPECT_TRUE(log.contains("kept in memory (cache mode read-only)"));

  const fs::path missing = tmp.path / "absent";
  KernelCache().get(small_source(), log.settings(missing, CacheMode::kReadOnly));
  EXPECT_FALSE(fs::exists(missing)) << "read-only mode created the directory";

  KernelCache().get(small_source(), log.settings(tmp.path, CacheMode::kOn));
  EXPECT_EQ(KernelCache().get(small_source(), log.settings(tmp.path, CacheMode::kReadOnly)).origin,
            Origin::kDisk);
}

// Off: no compile; the error names the kernel, its key, the cache and the command that warms it.
TEST(JitCache, OffModeNamesTheMissingKeyAndHowToWarmIt) {
  TempDir tmp;
  Logged log;
  const KernelSource src = small_source();
  try {
    KernelCache().get(src, log.settings(tmp.path, CacheMode::kOff));
    ADD_FAILURE() << "off mode compiled";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(what.find("kernel decode_d64_fp16_st2_sm80"), std::string::npos) << what;
    EXPECT_NE(what.find(cache_key(src, compile_options(src.arch)).hex()), std::string::npos) << what;
    EXPECT_NE(what.find(tmp.path.string()), std::string::npos) << what;
    EXPECT_NE(what.find("attnforge warmup --arch sm_80 --head-dim 64 --dtype fp16"), std::string::npos) << what;
  }
  EXPECT_FALSE(log.contains("compiling")) << "off mode compiled";
  KernelCache().get(src, log.settings(tmp.path, CacheMode::kOn));
  EXPECT_EQ(KernelCache().get(src, log.settings(tmp.path, CacheMode::kOff)).origin, Origin::kDisk);
}

// A directory or entry that others can write (or that belongs to someone else) is neither read nor written.
TEST(JitCache, DirectoriesAndEntriesOthersCanWriteAreRefused) {
  TempDir tmp;
  Logged log;
  const fs::path dir = tmp.path / "cache";
  KernelCache().get(small_source(), log.settings(dir));
  const fs::path entry = entry_path(dir, small_source());
  const std::string good = read_all(entry);

  for (mode_t mode : {0770, 0707, 0777}) {
    ASSERT_EQ(0, chmod(dir.c_str(), mode));
    Logged l;
    const Lookup r = KernelCache().get(small_source(), l.settings(dir));
    EXPECT_EQ(r.origin, Origin::kCompiled) << std::oct << mode << ": the entry was loaded";
    EXPECT_TRUE(l.contains("not using the kernel cache " + dir.string() + ": mode")) << std::oct << mode;
    EXPECT_EQ(files_in(dir).size(), 1u) << "something was written to a refused directory";
  }
  ASSERT_EQ(0, chmod(dir.c_str(), 0700));

  ASSERT_EQ(0, chmod(entry.c_str(), 0620));
  Logged l;
  EXPECT_EQ(KernelCache().get(small_source(), l.settings(dir)).origin, Origin::kCompiled);
  EXPECT_TRUE(l.contains("refusing cache entry " + entry.string() + ": mode 0620 lets its group write it"));
  struct stat st;
  ASSERT_EQ(0, stat(entry.c_str(), &st));
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the refused entry was not replaced by a private one";

  // Owned by another user (testable when running as root).
  if (geteuid() == 0) {
    ASSERT_EQ(0, chown(dir.c_str(), 65534, 65534));
    Logged o;
    EXPECT_EQ(KernelCache().get(small_source(), o.settings(dir)).origin, Origin::kCompiled);
    EXPECT_TRUE(o.contains("owned by uid 65534"));
  }
}

// Threads of one process asking for one key at once: one compile, everyone gets the same module.
TEST(JitCache, ConcurrentThreadsCompileOnce) {
  TempDir tmp;
  Logged log;
  KernelCache cache;
  std::vector<Lookup> results(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i)
    threads.emplace_back([&, i] { results[i] = cache.get(small_source(), log.settings(tmp.path)); });
  for (std::thread& t : threads) t.join();
  int compiled = 0;
  for (const Lookup& r : results) {
    compiled += r.origin == Origin::kCompiled;
    EXPECT_EQ(r.module.get(), results[0].module.get());
  }
  EXPECT_EQ(compiled, 1);
}

// Several processes compiling one key into one empty cache at the same moment: each publishes a complete entry
// by rename, so exactly one valid entry remains and no temporary file.
TEST(JitCache, ConcurrentProcessesLeaveOneValidEntry) {
  TempDir tmp;
  const fs::path dir = tmp.path / "cache";
  const fs::path go = tmp.path / "go";
  constexpr int kProcesses = 4;
  std::vector<pid_t> pids;
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  for (int i = 0; i < kProcesses; ++i) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.push_back(*e);
    env_strings.push_back("ATTNFORGE_TEST_CHILD_DIR=" + dir.string());
    env_strings.push_back("ATTNFORGE_TEST_CHILD_GO=" + go.string());
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=JitCacheChild.CompileSmallKey";
    char* argv[] = {const_cast<char*>(self.c_str()), filter.data(), nullptr};
    pid_t pid;
    ASSERT_EQ(0, posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()));
    pids.push_back(pid);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // every child reaches the start line
  write_all(go, "go");
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(pid, waitpid(pid, &status, 0));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << pid << " status " << status;
  }
  const std::vector<fs::path> files = files_in(dir);
  ASSERT_EQ(files.size(), 1u) << "expected exactly one entry and no temporary file";
  EXPECT_EQ(files[0], entry_path(dir, small_source()));
  Logged log;
  EXPECT_EQ(KernelCache().get(small_source(), log.settings(dir)).origin, Origin::kDisk);
}

// The child of ConcurrentProcessesLeaveOneValidEntry; does nothing when run on its own.
TEST(JitCacheChild, CompileSmallKey) {
  const char* dir = std::getenv("ATTNFORGE_TEST_CHILD_DIR");
  const char* go = std::getenv("ATTNFORGE_TEST_CHILD_GO");
  if (!dir || !go) return;
  const KernelSource src = small_source();  // everything but the compile happens before the start
  while (!fs::exists(go)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CacheSettings s;
  s.dir = dir;
  s.quiet = true;
  const Lookup r = KernelCache().get(src, s);
  EXPECT_FALSE(r.module->binary.empty());
}

// ---- launch configuration (host code shared by the nvcc and NVRTC builds; no GPU call) ----

// ATTNFORGE_DECODE_STAGES picks the decode tile of the NVRTC kernels run() uses (tuning runs); bad values are
// refused by name, and an unset or empty variable leaves the default.
TEST(JitLaunch, DecodeStagesFromTheEnvironment) {
  const cuda::JitKernels jit(0, 9, 0);
  const AttentionShape bf16{32, 8, 128, 128, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const AttentionShape e4m3{32, 8, 128, 128, DType::kBFloat16, DType::kFloat8E4M3, DType::kBFloat16};
  unsetenv("ATTNFORGE_DECODE_STAGES");
  EXPECT_EQ(jit.key_for(PlanKind::kDecode, bf16).name(), "decode_d128_bf16_st2_sm90a");
  setenv("ATTNFORGE_DECODE_STAGES", "", 1);
  EXPECT_EQ(jit.key_for(PlanKind::kDecode, e4m3).name(), "decode_d128_bf16_e4m3_st4_sm90a");
  setenv("ATTNFORGE_DECODE_STAGES", "3", 1);
  EXPECT_EQ(jit.key_for(PlanKind::kDecode, bf16).name(), "decode_d128_bf16_st3_sm90a");
  EXPECT_EQ(jit.key_for(PlanKind::kPrefill, bf16).name(), "prefill_d128_bf16_sm90a");  // decode only
  for (const auto& [value, words] : std::vector<std::pair<const char*, const char*>>{
           {"4", "decode_tile.stages 4: the decode kernel takes {2, 3} ({2, 3, 4} with fp8 K/V)"},
           {"three", "ATTNFORGE_DECODE_STAGES 'three': expected an integer in [1, 16]"},
           {"0", "ATTNFORGE_DECODE_STAGES '0'"}}) {
    setenv("ATTNFORGE_DECODE_STAGES", value, 1);
    try {
      jit.key_for(PlanKind::kDecode, bf16);
      ADD_FAILURE() << "ATTNFORGE_DECODE_STAGES=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
  unsetenv("ATTNFORGE_DECODE_STAGES");
}

TEST(JitLaunch, OneConfigurationFromTheTraits) {
  // Shared memory: Q (16 rows) and `stages` K and V tiles of 64 tokens, 16-bit elements.
  auto smem = [](int d, int stages) { return 2 * (16 * d + 2 * stages * 64 * d); };
  for (int d : {64, 128, 256})
    for (int stages : {2, 3}) {
      const cuda::KernelAttributes a = cuda::decode_attributes(d, DType::kBFloat16, stages);
      EXPECT_EQ(a.threads, 128);
      EXPECT_EQ(a.max_dynamic_smem, smem(d, stages)) << "head_dim " << d << ", stages " << stages;
      EXPECT_EQ(a.carveout_percent, 100);
    }
  // fp8 K/V: stages of 1-byte elements; the cross-warp merge (16 rows x (d + 10) floats per warp) reuses them and
  // sets the size where the stages are smaller. The default fp8 tile uses the shared memory of the 16-bit one.
  auto merge = [](int d) { return 4 * 16 * (d + 10) * 4; };
  for (int d : {64, 128, 256})
    for (int stages : {2, 3, 4}) {
      const int expected = 2 * 16 * d + std::max(2 * stages * 64 * d, merge(d));
      EXPECT_EQ(cuda::decode_attributes(d, DType::kFloat8E4M3, stages).max_dynamic_smem, expected) << d << " " << stages;
      EXPECT_EQ(cuda::decode_attributes(d, DType::kFloat8E5M2, stages).max_dynamic_smem, expected) << d << " " << stages;
    }
  for (int d : {64, 128, 256})
    EXPECT_EQ(cuda::decode_attributes(d, DType::kFloat8E4M3, cuda::kDefaultDecodeStagesFp8).max_dynamic_smem,
              smem(d, cuda::kDefaultDecodeStages));
  AttentionParams p{};
  p.num_qo_heads = 32, p.num_kv_heads = 8, p.head_dim_qk = p.head_dim_vo = 128;
  p.qo_tile = 8;  // 8 tokens x 4 heads of a group = 32 rows = 2 blocks of 16
  p.item_capacity = 0, p.merge_capacity = 0;
  cuda::LaunchConfig c = cuda::decode_launch_config(p, 2);
  EXPECT_EQ(c.attention.grid.x, 1u) << "an empty plan still launches one CTA, which finds no item";
  EXPECT_EQ(c.attention.grid.y, 8u);
  EXPECT_EQ(c.attention.grid.z, 2u);
  EXPECT_EQ(c.attention.smem_bytes, static_cast<unsigned>(smem(128, 2)));
  EXPECT_FALSE(c.run_merge);
  p.item_capacity = 700, p.merge_capacity = 30, p.qo_tile = 1;
  c = cuda::decode_launch_config(p, 3);
  EXPECT_EQ(c.attention.grid.x, 700u);
  EXPECT_EQ(c.attention.grid.z, 1u);
  EXPECT_EQ(c.attention.smem_bytes, static_cast<unsigned>(smem(128, 3)));
  EXPECT_TRUE(c.run_merge);
  EXPECT_EQ(c.merge.grid.x, 30u);
  // The merge's launch shape (merge_kernel.cuh): a warp per (row, head), four heads per CTA, for merges of at most
  // kMergeWarpMaxStates (8) states; four warps per row, a head per CTA, above. Rows of a merge: grid z, up to 8.
  EXPECT_EQ(c.merge.grid.y, 8u) << "a plan without merges takes the warp shape";
  EXPECT_EQ(c.merge.grid.z, 1u);
  p.max_merge_states = 8, p.qo_tile = 5;
  EXPECT_EQ(cuda::decode_launch_config(p, 3).merge.grid.y, 8u);
  EXPECT_EQ(cuda::decode_launch_config(p, 3).merge.grid.z, 5u);
  p.max_merge_states = 9, p.qo_tile = 8, p.num_qo_heads = 30, p.num_kv_heads = 6;
  EXPECT_EQ(cuda::decode_launch_config(p, 3).merge.grid.y, 30u);
  EXPECT_EQ(cuda::decode_launch_config(p, 3).merge.grid.z, 8u);
  p.max_merge_states = 2;
  EXPECT_EQ(cuda::decode_launch_config(p, 3).merge.grid.y, 8u) << "30 heads: 8 CTAs of four, the last with two";
}

// The prefill kernel: 4 warps; Q rows, then the K and V stages (3 stages of one softmax step up to head_dim 128, 2
// at 256 or with two steps a stage), 16-bit elements; 128 rows a CTA up to head_dim 128, 64 at 256, and the short
// tile of 64 rows at every head dim.
TEST(JitLaunch, PrefillConfigurationFromTheTraits) {
  struct Expected {
    int d, step, rows, stages;
  };
  for (const Expected e : {Expected{64, 64, 128, 3}, Expected{128, 32, 128, 3}, Expected{256, 32, 64, 2}})
    for (int rows : {e.rows, cuda::kPrefillShortRows})
      for (int steps : {1, 2}) {
        const int stage_tokens = steps * e.step;
        const int stages = steps == 1 ? e.stages : 2;
        const cuda::KernelAttributes a = cuda::prefill_attributes(e.d, stage_tokens, rows);
        EXPECT_EQ(a.threads, 128);
        EXPECT_EQ(a.max_dynamic_smem, 2 * (rows * e.d + 2 * stages * stage_tokens * e.d))
            << "head_dim " << e.d << ", stage tokens " << stage_tokens << ", rows " << rows;
        EXPECT_EQ(a.carveout_percent, 100);
        EXPECT_EQ(cuda::prefill_rows(e.d), e.rows);
        EXPECT_EQ(cuda::prefill_tile_tokens(e.d), e.step);
      }
  EXPECT_EQ(cuda::kPrefillShortRows, 64);
  // The grid's x and y come from attention_launch_config (checked through decode above); prefill brings its rows
  // per CTA and its shared memory, and launches the merge kernel over the plan's merge capacity.
  AttentionParams p{};
  p.num_qo_heads = 32, p.num_kv_heads = 8;  // groups of 4 query heads
  p.item_capacity = 300, p.merge_capacity = 12;
  p.max_merge_states = 40;  // the merge's four-warp shape (more than 8 states): a head per CTA
  // Row blocks cover the longest query tile any re-plan of the shape can have (the head dim's tile), so a graph
  // captured with short tiles replays long ones; the short tile is run()'s pick when the plan's tiles fit it.
  struct Blocks {
    int d, qo_tile, rows;  // rows: what prefill_plan_rows picks
    unsigned row_blocks;
  };
  for (const Blocks b : {Blocks{64, 32, 128, 1}, Blocks{128, 64, 128, 2}, Blocks{128, 65, 128, 3},
                         Blocks{256, 17, 64, 2}, Blocks{128, 16, 64, 2}, Blocks{128, 3, 64, 2}, Blocks{256, 3, 64, 1},
                         Blocks{64, 17, 128, 1}}) {
    p.head_dim_qk = p.head_dim_vo = b.d, p.qo_tile = b.qo_tile;
    EXPECT_EQ(cuda::prefill_plan_rows(p), b.rows) << "head_dim " << b.d << ", qo_tile " << b.qo_tile;
    const cuda::LaunchConfig c = cuda::prefill_launch_config(p, cuda::prefill_tile_tokens(b.d), b.rows);
    EXPECT_EQ(c.attention.grid.x, 300u);
    EXPECT_EQ(c.attention.grid.y, 8u);
    // head_dim 256's long tile is 128 rows where the Hopper kernel serves it (prefill_tile_rows): two 64-row blocks.
    const unsigned row_blocks =
        std::max<unsigned>(b.row_blocks, (cuda::prefill_tile_rows(b.d) + b.rows - 1) / b.rows);
    EXPECT_EQ(c.attention.grid.z, row_blocks) << "head_dim " << b.d << ", qo_tile " << b.qo_tile;
    EXPECT_EQ(c.attention.block.x, 128u);
    EXPECT_EQ(c.attention.smem_bytes, static_cast<unsigned>(
                                          cuda::prefill_attributes(b.d, cuda::prefill_tile_tokens(b.d), b.rows)
                                              .max_dynamic_smem));
    EXPECT_TRUE(c.run_merge);
    EXPECT_EQ(c.merge.grid.x, 12u);
    EXPECT_EQ(c.merge.grid.y, 32u);
    EXPECT_EQ(c.merge.smem_bytes, 0u);
  }
  p.merge_capacity = 0;
  EXPECT_FALSE(cuda::prefill_launch_config(p, 32, 128).run_merge);
}

// ---- warm-up ----

// The default set holds, for each head dim and dtype, the decode kernels (K/V in Q's dtype, e4m3, e5m2) and both
// prefill kernels (RoPE off and on), and nothing the run-time kernels do not serve.
TEST(JitWarmup, DefaultSetHoldsDecodeAndPrefillKernels) {
  std::set<std::string> names;
  for (const AttentionConfig& c : default_warmup_configs())
    names.insert((c.kind == PlanKind::kDecode ? decode_key(c.shape, "sm_90a") : prefill_key(c.shape, "sm_90a", c.rope))
                     .name());
  std::set<std::string> expected;
  for (int d : {64, 128, 256})
    for (const char* t : {"fp16", "bf16"}) {
      expected.insert(fmt::format("decode_d{}_{}_st2_sm90a", d, t));
      expected.insert(fmt::format("decode_d{}_{}_e4m3_st4_sm90a", d, t));
      expected.insert(fmt::format("decode_d{}_{}_e5m2_st4_sm90a", d, t));
      expected.insert(fmt::format("prefill_d{}_{}_sm90a", d, t));
      expected.insert(fmt::format("prefill_d{}_{}_rope_sm90a", d, t));
    }
  EXPECT_EQ(names, expected);  // the configurations; warmup() adds each prefill one's short-tile key (below)
}

// Configurations that differ only in run-time values share kernels (page size, head counts; RoPE for decode);
// fp8 K/V gets decode kernels of its own; prefill kernels compile first (the long compiles); fp8 prefill is reported
// as skipped.
TEST(JitWarmup, DedupesConfigurationsAndReportsWhatItSkips) {
  TempDir tmp;
  set_cache_dir(tmp.path.string());
  std::vector<std::string> lines;
  std::mutex mutex;
  set_log_sink([&](const std::string& l) {
    std::lock_guard<std::mutex> lock(mutex);
    lines.push_back(l);
  });
  std::vector<AttentionConfig> configs;
  int fp8_configs = 0;
  for (const AttentionConfig& c : default_warmup_configs())
    if (c.shape.head_dim_qk == 64 && c.kind == PlanKind::kDecode && c.shape.kv_dtype == c.shape.q_dtype)
      configs.push_back(c);
    else if (c.shape.head_dim_qk == 64 && c.kind == PlanKind::kDecode)
      ++fp8_configs;
  ASSERT_EQ(configs.size(), 8u);  // two models x two dtypes x two page sizes
  EXPECT_EQ(fp8_configs, 16) << "the default set warms e4m3 and e5m2 K/V for each of them";
  AttentionConfig decode_rope = configs[0];
  decode_rope.rope = true;
  AttentionConfig prefill = configs[0];  // bf16, page size 1
  prefill.kind = PlanKind::kPrefill;
  AttentionConfig prefill_other = prefill;
  prefill_other.page_size = 16;
  prefill_other.shape.num_qo_heads = 32;
  AttentionConfig fp8 = configs[0];
  fp8.shape.kv_dtype = DType::kFloat8E4M3;
  AttentionConfig fp8_prefill = prefill;
  fp8_prefill.shape.kv_dtype = DType::kFloat8E4M3;
  configs.insert(configs.end(), {decode_rope, prefill, prefill_other, fp8, fp8_prefill});
  WarmupOptions options;
  options.archs = {"sm_80"};
  options.threads = 2;
  const WarmupReport first = warmup(configs, options);
  ASSERT_TRUE(first.ok());
  // prefill bf16 in both row tiles; the merge module; decode bf16, fp16, and bf16 with e4m3 K/V
  ASSERT_EQ(first.kernels.size(), 6u);
  EXPECT_EQ(first.kernels[0].name, "prefill_d64_bf16_sm80");
  EXPECT_EQ(first.kernels[1].name, "prefill_d64_bf16_rows64_sm80");
  EXPECT_EQ(first.kernels[2].name, "merge_sm80");
  EXPECT_EQ(first.kernels[3].name, "decode_d64_bf16_st2_sm80");
  EXPECT_EQ(first.kernels[4].name, "decode_d64_fp16_st2_sm80");
  EXPECT_EQ(first.kernels[5].name, "decode_d64_bf16_e4m3_st4_sm80");
  for (const WarmupReport::Kernel& k : first.kernels) EXPECT_EQ(k.origin, "compiled") << k.name;
  ASSERT_EQ(first.skipped.size(), 1u);
  EXPECT_NE(first.skipped[0].find("fp8 K/V is not built for CUDA prefill"), std::string::npos) << first.skipped[0];
  EXPECT_EQ(files_in(tmp.path).size(), 6u);
  const WarmupReport second = warmup(configs, options);
  for (const WarmupReport::Kernel& k : second.kernels) EXPECT_EQ(k.origin, "memory") << k.name;
  set_log_sink(nullptr);
  set_cache_dir("");
  // One line before and one after each of the six compiles (and NVRTC's warnings, such as ptxas's spill report
  // for the prefill kernel, on lines of their own).
  int compile_lines = 0;
  for (const std::string& l : lines)
    compile_lines += l.find("attnforge jit: compiling ") == 0 || l.find("attnforge jit: compiled ") == 0;
  EXPECT_EQ(compile_lines, 12) << fmt::format("{}", fmt::join(lines, "\n"));
}

TEST(JitSettings, ModesParseAndBadValuesAreNamed) {
  EXPECT_EQ(parse_cache_mode("on"), CacheMode::kOn);
  EXPECT_EQ(parse_cache_mode("read-only"), CacheMode::kReadOnly);
  EXPECT_EQ(parse_cache_mode("off"), CacheMode::kOff);
  try {
    parse_cache_mode("sometimes");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'sometimes': expected one of {on, read-only, off}"), std::string::npos);
  }
}

}  // namespace
