// Shapes and counts shared by the CPU benchmark (bench.cc) and the GPU benchmark (bench_cuda.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnforge/config.h"
#include "attnforge/devices.h"
#include "commands.h"
#include "testing/cases.h"

namespace attnforge::cli {

// Rows the reference computes for a check: all when there are few, else kCheckedRows spread over the batch.
constexpr int64_t kCheckedRows = 16;

// Serving defaults: 32 query heads over 8 KV heads, head_dim 128, bf16, pages of 16 shuffled among spares.
testing::CaseSpec serving_spec(PlanKind kind, KVFormat format, std::vector<int32_t> qo_lens, std::vector<int32_t> kv_lens);
testing::CaseSpec decode_spec(std::vector<int32_t> kv_lens);
// `batch` lengths summing to `total`, each >= 16, shaped like a Zipf law (fixed seed).
std::vector<int32_t> zipf_lengths(int32_t batch, int64_t total);
// K and V bytes of every token, Q read and O written: the least a step must move.
double bytes_moved(const testing::CaseSpec& s);
// K and V bytes of every token only (what the GPU decode target counts).
double kv_bytes_read(const testing::CaseSpec& s);
// 2 x (head_dim_qk + head_dim_vo) per head per attended (query, key) pair; causal bottom-right aligned.
double attention_flops(const testing::CaseSpec& s);
std::vector<int64_t> sampled_rows(int64_t total);
// Whether a bench case is selected by --case: its name contains the filter, or one of the filter's '|'-separated
// texts; a text ending in '$' must end the name ("decode 1x32768$" leaves out "decode 1x32768 hnd"). An empty filter
// selects every case.
bool case_selected(const std::string& name, const std::string& filter);

// The GPU benchmark (bench_cuda.cc, built with CUDA).
int run_bench_cuda(const BenchOptions& options, const DeviceInfo& device);

// The GPU suite's decode and prefill cases timed with the nvcc-compiled and the NVRTC-compiled kernels on the same
// buffers and plan (bench_cuda.cc); each is checked against the float64 reference with both first.
struct CompilerComparison {
  std::string name;
  bool prefill;  // rated in TFLOP/s, decode in TB/s
  double nvcc_us, nvrtc_us, bytes, flops;
};
std::vector<CompilerComparison> compare_kernel_builds(const DeviceInfo& device, bool quick, int32_t iters);

// `attnforge warmup`: the configurations the options select (warmup.cc), and `--bench` (warmup_bench.cc).
std::vector<AttentionConfig> warmup_configs(const WarmupCommandOptions& options);
int run_warmup_bench(const WarmupCommandOptions& options);

}  // namespace attnforge::cli
