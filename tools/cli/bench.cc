// `attnforge bench`: a suite of serving workloads, each checked against the float64 reference and then timed,
// reported next to ceilings measured in the same run (memory-bound decode in GB/s against the streaming-read
// ceiling, compute-bound prefill in GFLOP/s against the fp32 GEMM ceiling).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnforge/devices.h"
#include "bench_common.h"
#include "ceilings.h"
#include "commands.h"
#include "testing/compare.h"

namespace attnforge::cli {

namespace {

using testing::Case;
using testing::CaseSpec;

enum class Bound { kMemory, kCompute };

struct BenchCase {
  std::string name;
  CaseSpec spec;
  Bound bound;
};

// Sizes of the suite; --quick shrinks them so the whole run, ceilings included, stays under a minute on 2 cores.
struct SuiteSize {
  const char* suite;
  int32_t decode_batch, decode_len;  // uniform, Zipf (same total), fp8; MHA uses mha_batch
  int32_t mha_batch;
  int32_t append_batch, append_qo, append_prefix;
  int32_t prefill_len;
  int32_t iters, warmup, ceiling_passes;
};
constexpr SuiteSize kFullSuite{"serving", 16, 4096, 4, 4, 128, 1024, 1024, 20, 3, 21};
constexpr SuiteSize kQuickSuite{"serving-quick", 8, 1024, 2, 4, 64, 256, 256, 5, 1, 9};

// Memory-bound cases whose K/V are smaller than this are built several times and run in rotation, so each run
// reads K/V that the previous runs have evicted from the caches (32 MiB of L3 on the machine this was tuned on).
constexpr double kRotationBytes = 64.0 * (1 << 20);
constexpr int32_t kMaxCopies = 3;

std::vector<BenchCase> serving_suite(const SuiteSize& z) {
  const std::vector<int32_t> uniform(z.decode_batch, z.decode_len);
  const std::string bxl = fmt::format("{}x{}", z.decode_batch, z.decode_len);
  std::vector<BenchCase> suite;
  suite.push_back({"decode " + bxl, decode_spec(uniform), Bound::kMemory});
  suite.push_back({"decode zipf " + bxl,
                   decode_spec(zipf_lengths(z.decode_batch, static_cast<int64_t>(z.decode_batch) * z.decode_len)),
                   Bound::kMemory});
  CaseSpec mha = decode_spec(std::vector<int32_t>(z.mha_batch, z.decode_len));
  mha.num_kv_heads = 32;
  suite.push_back({fmt::format("decode mha {}x{}", z.mha_batch, z.decode_len), mha, Bound::kMemory});
  CaseSpec fp8 = decode_spec(uniform);
  fp8.kv_dtype = DType::kFloat8E4M3;
  suite.push_back({"decode fp8-e4m3 kv " + bxl, fp8, Bound::kMemory});
  // Chunked prefill: each request's new tokens are already appended to its pages, so kv_len = prefix + new.
  const std::vector<int32_t> append_qo(z.append_batch, z.append_qo);
  const std::vector<int32_t> append_kv(z.append_batch, z.append_prefix + z.append_qo);
  suite.push_back({fmt::format("append {}x{} onto {}", z.append_batch, z.append_qo, z.append_prefix),
                   serving_spec(PlanKind::kPrefill, KVFormat::kPagedCSR, append_qo, append_kv), Bound::kCompute});
  const CaseSpec prefill = serving_spec(PlanKind::kPrefill, KVFormat::kRagged, {z.prefill_len}, {z.prefill_len});
  suite.push_back({fmt::format("prefill causal 1x{}", z.prefill_len), prefill, Bound::kCompute});
  CaseSpec prefill_mha = prefill;
  prefill_mha.num_kv_heads = 32;
  suite.push_back({fmt::format("prefill causal mha 1x{}", z.prefill_len), prefill_mha, Bound::kCompute});
  return suite;
}

void run_case(const AttentionPlan& plan, const Case& c, const Workspace& ws) {
  const Outputs outs{c.out_view, c.lse_view};
  if (c.spec.format == KVFormat::kRagged)
    run(plan, c.q_view, c.ragged, outs, c.options, ws);
  else
    run(plan, c.q_view, c.paged, outs, c.options, ws);
}

struct Result {
  const BenchCase* bench;
  Measurement m;
  double ceiling;
  double pct() const { return m.rate() / ceiling * 100; }
};

// Builds the case (and its rotation copies), checks each copy against the reference, then times run().
Result bench_case(const BenchCase& bc, const SuiteSize& z, int32_t iters, const Ceiling& read, const Ceiling& gemm,
                  const std::string& progress) {
  const bool memory = bc.bound == Bound::kMemory;
  const double io_bytes = bytes_moved(bc.spec);
  // Prefill reuses each K/V row across a whole query tile, so its K/V is cache-resident in real serving too;
  // rotating would measure nothing real. Decode reads each byte once per step: it must come from DRAM.
  const int32_t copies =
      memory ? std::clamp(static_cast<int32_t>(std::ceil(kRotationBytes / io_bytes)), 1, kMaxCopies) : 1;
  fmt::print(stderr, "{} {}: building {} cop{} ({:.0f} MiB of Q/K/V/O each)\n", progress, bc.name, copies,
             copies == 1 ? "y" : "ies", io_bytes / (1 << 20));

  std::vector<Case> cases;
  for (int32_t i = 0; i < copies; ++i) {
    CaseSpec s = bc.spec;
    s.seed += i;
    cases.push_back(testing::make_case(s));
  }
  const BatchPlanArgs args = cases[0].plan_args();
  AttentionPlan plan = bc.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
  const testing::Buffer ws_buf = testing::Buffer::make(DType::kUInt8, plan.workspace_bytes);
  const Workspace ws{plan.workspace_bytes ? ws_buf.data() : nullptr, plan.workspace_bytes};
  upload_plan(plan, ws);  // the step ops.h asks for after every plan; on the CPU it only records the workspace

  const std::vector<int64_t> rows = sampled_rows(cases[0].total_qo());
  for (Case& c : cases) {
    run_case(plan, c, ws);
    const testing::Verdict v = testing::check_case(c, rows);
    if (!v.ok)
      throw std::runtime_error(fmt::format("{}: wrong result, not timing it: {} | {}", bc.name, v.message,
                                           c.spec.describe()));
  }
  const std::string checked = rows.empty() ? "all rows" : fmt::format("{} sampled rows", rows.size());
  fmt::print(stderr, "{} {}: checked ({}{}); {}\n", progress, bc.name, checked, copies > 1 ? ", every copy" : "",
             plan.describe());

  const double work = memory ? io_bytes : attention_flops(bc.spec);
  const int32_t warmup = std::max(z.warmup, copies);
  const Measurement m = measure(work, warmup, iters, [&](int32_t i) { run_case(plan, cases[i % copies], ws); });
  Result r{&bc, m, memory ? read.m.rate() : gemm.m.rate()};
  fmt::print(stderr, "{} {}: median {:.1f} us over {} runs, {:.2f} {} ({:.1f}% of ceiling)\n", progress, bc.name,
             m.median_us, iters, m.rate(), memory ? "GB/s" : "GFLOP/s", r.pct());
  return r;
}

// The device the bench runs on: the one asked for, or the best present (a GPU that runs attention, else the
// CPU).
DeviceInfo resolve_device(const std::string& requested) {
  std::string runs;
  const DeviceInfo* best = nullptr;
  const std::vector<DeviceInfo> devices = available_devices();
  for (const DeviceInfo& d : devices) {
    if (!d.attention) continue;
    if (!best || (best->device.type == DeviceType::kCPU && d.device.type == DeviceType::kCUDA)) best = &d;
    const bool any_gpu = requested == "cuda" && d.device.type == DeviceType::kCUDA;  // "cuda": the first GPU
    if (to_string(d.device) == requested || d.name == requested || any_gpu) return d;
    runs += (runs.empty() ? "" : ", ") + to_string(d.device);
    if (d.name != to_string(d.device)) runs += fmt::format(" ({})", d.name);
  }
  if (requested.empty() && best) return *best;
  throw std::runtime_error(fmt::format("--device {}: not a device that runs attention in this build; those that do: "
                                       "{} (`attnforge info` lists every device)", requested, runs));
}

const char* unit(Bound b) { return b == Bound::kMemory ? "GB/s" : "GFLOP/s"; }

nlohmann::json record(const std::string& suite, const std::string& name, const std::string& system,
                      const std::string& device, const Measurement& m, Bound bound, double ceiling,
                      const std::string& detail) {
  const bool memory = bound == Bound::kMemory;
  nlohmann::json j;
  j["suite"] = suite;
  j["case"] = name;
  j["system"] = system;
  j["device"] = device;
  j["median_us"] = m.median_us;
  j[memory ? "gbps" : "gflops"] = m.rate();
  j["pct_of_ceiling"] = m.rate() / ceiling * 100;
  j["ceiling"] = ceiling;
  j[memory ? "bytes" : "flops"] = m.work;
  j["iters"] = m.iters;
  j["commit"] = git_commit();
  j["detail"] = detail;
  return j;
}

}  // namespace

int run_bench(const BenchOptions& options) {
  const DeviceInfo device = resolve_device(options.device);
  if (device.device.type == DeviceType::kCUDA) {
#if ATTNFORGE_WITH_CUDA
    return run_bench_cuda(options, device);
#endif
  }
  const std::string device_name = to_string(device.device);
  if (options.warm_code)
    throw std::runtime_error(fmt::format("--warm-code: measures instruction fetches of GPU kernels; device {} is not "
                                         "a GPU (expected --device cuda:N)",
                                         device_name));
  const SuiteSize& z = options.quick ? kQuickSuite : kFullSuite;
  const int32_t iters = options.iters > 0 ? options.iters : z.iters;
  std::vector<BenchCase> suite = serving_suite(z);
  if (!options.case_filter.empty()) {
    std::erase_if(suite, [&](const BenchCase& c) { return !case_selected(c.name, options.case_filter); });
    if (suite.empty())
      throw std::runtime_error(
          fmt::format("--case {}: no case of suite {} has that in its name", options.case_filter, z.suite));
  }
  for (BenchCase& c : suite) {
    if (options.workers > 0) c.spec.plan.num_workers = options.workers;
    if (options.tile_rows > 0) c.spec.plan.tile_rows = options.tile_rows;
  }
  const size_t steps = suite.size() + 2;
  std::ofstream json;
  if (!options.json_path.empty()) {
    json.open(options.json_path);  // now, so a path that cannot be written fails before minutes of measuring
    if (!json) throw std::runtime_error(fmt::format("--json {}: cannot open the file for writing", options.json_path));
  }

  fmt::print(stderr, "[1/{}] ceiling: streaming read ...\n", steps);
  const Ceiling read = measure_read_bandwidth(z.ceiling_passes);
  fmt::print(stderr, "[2/{}] ceiling: fp32 gemm ...\n", steps);
  const Ceiling gemm = measure_fp32_gemm(z.ceiling_passes);
  std::vector<Result> results;
  for (size_t i = 0; i < suite.size(); ++i)
    results.push_back(bench_case(suite[i], z, iters, read, gemm, fmt::format("[{}/{}]", i + 3, steps)));

  fmt::print("attnforge bench, suite {}: {}\n", z.suite, build_info());
  fmt::print("device {}: {}\n", device_name, device.description);
  fmt::print("ceiling streaming read: {:8.2f} GB/s     ({})\n", read.m.rate(), read.detail);
  fmt::print("ceiling fp32 gemm:      {:8.2f} GFLOP/s  ({})\n\n", gemm.m.rate(), gemm.detail);
  fmt::print("{:<14} {:<28} {:<6} {:>12} {:>16} {:>13}\n", "suite", "case", "device", "median_us", "rate",
             "% of ceiling");
  for (const Result& r : results)
    fmt::print("{:<14} {:<28} {:<6} {:>12.1f} {:>8.2f} {:<7} {:>12.1f}%\n", z.suite, r.bench->name, device_name,
               r.m.median_us, r.m.rate(), unit(r.bench->bound), r.pct());
  fmt::print("(% of ceiling: GB/s against the streaming read, GFLOP/s against attnforge's own fp32 GEMM loop)\n");

  if (json.is_open()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& [c, bound] : {std::pair{&read, Bound::kMemory}, {&gemm, Bound::kCompute}})
      out.push_back(record(z.suite, c->name, "ceiling", device_name, c->m, bound, c->m.rate(), c->detail));
    for (const Result& r : results)
      out.push_back(record(z.suite, r.bench->name, "attnforge", device_name, r.m, r.bench->bound, r.ceiling,
                           r.bench->spec.describe()));
    json << out.dump(2) << "\n";
    json.close();
    if (!json) throw std::runtime_error(fmt::format("--json {}: could not write the file", options.json_path));
    fmt::print(stderr, "wrote {} records to {}\n", out.size(), options.json_path);
  }
  return 0;
}

}  // namespace attnforge::cli
