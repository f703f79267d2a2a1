// `attnforge bench --device cuda:N`: the decode and prefill suites on a GPU, timed with CUDA events (warm-up,
// median of many runs, inputs rotated so that they exceed the L2 cache several times over). Decode is reported
// as TB/s of K/V read next to the device-to-device copy bandwidth, prefill as TFLOP/s (attended pairs only:
// causal counts about half of full attention) next to the bf16 matrix-product rate of cuBLAS, both ceilings
// measured in the same run. Every case is checked against the float64 reference (sampled rows) before it is
// timed. bench/peers.py reads the JSON and times PyTorch on the same shapes.
#include <cuda_runtime.h>
#include <fmt/format.h>
#if ATTNFORGE_WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnforge/devices.h"
#include "attnforge/jit.h"
#include "bench_common.h"
#include "commands.h"
#include "testing/compare.h"
#include "testing/device_case.h"

namespace attnforge::cli {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Device memory, pinned host memory, events and graphs released on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { check(cudaMalloc(&ptr, std::max<size_t>(bytes, 256)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
};
struct PinnedBuffer {
  void* ptr = nullptr;
  explicit PinnedBuffer(size_t bytes) { check(cudaMallocHost(&ptr, std::max<size_t>(bytes, 1)), "cudaMallocHost"); }
  ~PinnedBuffer() { cudaFreeHost(ptr); }
};

struct GpuBenchCase {
  std::string name;
  testing::CaseSpec spec;
  bool graph = false;  // also time a CUDA graph replay (small, launch-bound cases)
};

testing::CaseSpec gpu_decode(int32_t batch, int32_t kv_len, int32_t page_size = 16, int32_t qo = 1) {
  testing::CaseSpec s = decode_spec(std::vector<int32_t>(batch, kv_len));
  s.page_size = page_size;
  s.qo_lens.assign(batch, qo);
  s.options.causal = qo > 1;
  s.spare_pages = 64;
  return s;
}

// The issue-3 targets: bf16 (fp8 K/V where named), 32 query heads over 8 KV heads, head_dim 128, page size 16
// unless named.
std::vector<GpuBenchCase> gpu_suite(bool quick) {
  std::vector<GpuBenchCase> v;
  if (quick) {
    v.push_back({"decode 16x2048", gpu_decode(16, 2048)});
    v.push_back({"decode 1x2048", gpu_decode(1, 2048), true});
    return v;
  }
  // fp8 e4m3 K/V with per-tensor scales next to bf16 on the two largest cases (target: 1.7x faster); TB/s counts
  // the fp8 bytes read.
  auto fp8 = [](testing::CaseSpec s) {
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.5f, s.v_scale = 0.25f;
    return s;
  };
  v.push_back({"decode 64x8192", gpu_decode(64, 8192)});
  v.push_back({"decode 64x8192 fp8", fp8(gpu_decode(64, 8192))});
  v.push_back({"decode 64x8192 page1", gpu_decode(64, 8192, 1)});
  v.push_back({"decode 256x4096", gpu_decode(256, 4096)});
  v.push_back({"decode 256x4096 fp8", fp8(gpu_decode(256, 4096))});
  v.push_back({"decode 1x32768", gpu_decode(1, 32768)});
  v.push_back({"decode 16x2048", gpu_decode(16, 2048)});
  v.push_back({"decode 1x2048", gpu_decode(1, 2048), true});
  v.push_back({"decode 64x4096 uniform", gpu_decode(64, 4096)});
  testing::CaseSpec zipf = gpu_decode(64, 4096);
  zipf.kv_lens = zipf_lengths(64, 64 * 4096);
  v.push_back({"decode 64x4096 zipf", zipf});
  v.push_back({"decode 128x2048 qo1", gpu_decode(128, 2048)});
  v.push_back({"decode 128x2048 qo4 causal", gpu_decode(128, 2048, 16, 4)});
  return v;
}

// Suite "long" (not in "all", to keep the full run within a device call): one request of 1M tokens, the one-GPU
// baseline of issue 7's context-parallel decode (4.3 GB of bf16 K/V; the targets: 1.8x on 2 GPUs, 3.3x on 4).
std::vector<GpuBenchCase> gpu_long_suite() { return {{"decode 1x1048576", gpu_decode(1, 1 << 20)}}; }

testing::CaseSpec gpu_prefill(std::vector<int32_t> qo, std::vector<int32_t> kv, bool causal, int32_t head_dim = 128,
                              int32_t page_size = 16) {
  testing::CaseSpec s = decode_spec(std::move(kv));
  s.kind = PlanKind::kPrefill;
  s.qo_lens = std::move(qo);
  s.options.causal = causal;
  s.head_dim_qk = head_dim;
  s.page_size = page_size;
  s.spare_pages = 64;
  return s;
}

// The issue-4 targets: bf16, 32 query heads over 8 KV heads.
std::vector<GpuBenchCase> gpu_prefill_suite(bool quick) {
  std::vector<GpuBenchCase> v;
  auto square = [](int32_t batch, int32_t len) { return std::vector<int32_t>(batch, len); };
  if (quick) {
    v.push_back({"prefill 1x4096 causal", gpu_prefill(square(1, 4096), square(1, 4096), true)});
    return v;
  }
  v.push_back({"prefill 4x8192 causal", gpu_prefill(square(4, 8192), square(4, 8192), true)});
  v.push_back({"prefill 1x16384 causal", gpu_prefill(square(1, 16384), square(1, 16384), true)});
  v.push_back({"prefill 1x8192 full", gpu_prefill(square(1, 8192), square(1, 8192), false)});
  v.push_back({"prefill 2x8192 causal d64", gpu_prefill(square(2, 8192), square(2, 8192), true, 64)});
  v.push_back({"prefill 2x8192 causal d256", gpu_prefill(square(2, 8192), square(2, 8192), true, 256)});
  v.push_back({"append 64x512+4096", gpu_prefill(square(64, 512), square(64, 4608), true)});
  v.push_back({"append 64x512+4096 page1", gpu_prefill(square(64, 512), square(64, 4608), true, 128, 1)});
  // Ragged: 16 requests of lengths uniform in [512, 4096], against one request of the same total length.
  std::vector<int32_t> lens(16);
  for (int32_t i = 0; i < 16; ++i) lens[i] = 512 + (3584 * ((i * 7) % 16)) / 15;  // a fixed shuffle of the grid
  int32_t total = 0;
  for (int32_t l : lens) total += l;
  testing::CaseSpec ragged = gpu_prefill(lens, lens, true);
  ragged.format = KVFormat::kRagged;
  v.push_back({"prefill ragged 16x[512,4096]", ragged});
  testing::CaseSpec one = gpu_prefill({total}, {total}, true);
  one.format = KVFormat::kRagged;
  v.push_back({fmt::format("prefill ragged 1x{}", total), one});
  return v;
}

struct GpuResult {
  std::string name;
  testing::CaseSpec spec;
  double median_us = 0, graph_us = 0, bytes = 0, flops = 0;
  double nvrtc_us = 0;  // with compare_nvrtc: the same launches with the NVRTC-compiled kernels
  int32_t iters = 0;
  std::string plan;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Median time in microseconds of `runs` calls of f on the default stream, after `warmup` untimed ones.
template <typename F>
double median_event_us(int warmup, int runs, F&& f, const char* what) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  std::vector<double> us;
  for (int i = 0; i < warmup + runs; ++i) {
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    check(cudaEventSynchronize(e1), what);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= warmup) us.push_back(ms * 1e3);
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return median(us);
}

// Device-to-device copy of 2 GiB: bytes read plus bytes written over the median time.
struct CopyCeiling {
  double gbps, median_us;
};
CopyCeiling copy_bandwidth() {
  const size_t bytes = size_t{1} << 31;
  DeviceBuffer a(bytes), b(bytes);
  check(cudaMemset(a.ptr, 1, bytes), "cudaMemset");
  const double med = median_event_us(
      3, 10, [&] { check(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync"); }, "copy");
  return {2.0 * bytes / (med * 1e3), med};
}

// bf16 x bf16 -> fp32-accumulated matrix product of 8192^3 through cuBLAS: the tensor-core rate prefill is held
// against. 0 when the build has no cuBLAS.
double gemm_tflops(double* median_us) {
#if ATTNFORGE_WITH_CUBLAS
  const int n = 8192;
  const size_t bytes = size_t{2} * n * n;
  DeviceBuffer a(bytes), b(bytes), c(bytes);
  check(cudaMemset(a.ptr, 0x3c, bytes), "cudaMemset");  // bf16 0x3c3c: about 0.0115, finite
  check(cudaMemset(b.ptr, 0x3c, bytes), "cudaMemset");
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  const float alpha = 1.f, beta = 0.f;
  auto gemm = [&] {
    if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n, &beta,
                     c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cublasGemmEx failed");
  };
  *median_us = median_event_us(3, 20, gemm, "gemm");
  cublasDestroy(h);
  return 2.0 * n * n * static_cast<double>(n) / (*median_us * 1e6);
#else
  *median_us = 0;
  return 0;
#endif
}

// With compare_nvrtc, the case is also checked and timed with the NVRTC-compiled kernels on the same buffers and
// plan, alternating nvcc, NVRTC, nvcc, NVRTC so that drift in clocks or temperature hits both alike; each
// build's figure is the mean of its two medians.
GpuResult bench_gpu_case(const GpuBenchCase& bc, int device, int32_t iters, const std::string& progress,
                         bool compare_nvrtc = false) {
  const jit::CudaKernels selected = jit::cuda_kernels();
  if (compare_nvrtc) jit::set_cuda_kernels(jit::CudaKernels::kNvcc);  // plan and first timing with nvcc's build
  const double kv_bytes = kv_bytes_read(bc.spec);
  const bool prefill = bc.spec.kind == PlanKind::kPrefill;
  // Enough copies that one pass over them exceeds three L2 caches (60 MB on an H200); prefill reads its inputs
  // many times over from L2 within one call, so two copies keep calls from starting warm.
  const int32_t copies =
      prefill ? 2 : std::clamp(static_cast<int32_t>(std::ceil(3 * 60e6 / kv_bytes)), 1, 24);
  fmt::print(stderr, "{} {}: building {} cop{} of {:.0f} MB of K/V\n", progress, bc.name, copies,
             copies == 1 ? "y" : "ies", kv_bytes / 1e6);
  std::vector<std::unique_ptr<testing::Case>> hosts;
  std::vector<std::unique_ptr<testing::DeviceCase>> devs;
  for (int32_t i = 0; i < copies; ++i) {
    testing::CaseSpec s = bc.spec;
    s.seed += i;
    hosts.push_back(std::make_unique<testing::Case>(testing::make_case(s)));
    devs.push_back(std::make_unique<testing::DeviceCase>(*hosts.back(), device));
    if (i > 0) hosts.back()->k_vals.clear(), hosts.back()->v_vals.clear();  // only copy 0 is checked
  }
  BatchPlanArgs args = hosts[0]->plan_args();
  args.device = Device::cuda(device);
  AttentionPlan plan = prefill ? plan_batch_prefill(args) : plan_batch_decode(args);
  DeviceBuffer ws(plan.workspace_bytes);
  PinnedBuffer staging(plan.staging_bytes);
  const Workspace w{ws.ptr, plan.workspace_bytes};
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  upload_plan(plan, w, staging.ptr, plan.staging_bytes, stream);
  auto launch = [&](int32_t i) {
    const testing::DeviceCase& d = *devs[i % copies];
    if (bc.spec.format == KVFormat::kRagged)
      run(plan, d.q, d.ragged, Outputs{d.out, d.lse}, d.options, w, stream);
    else
      run(plan, d.q, d.paged, Outputs{d.out, d.lse}, d.options, w, stream);
  };

  const std::vector<int64_t> rows = sampled_rows(hosts[0]->total_qo());
  auto run_and_check = [&](const char* build) {
    hosts[0]->poison_outputs();
    devs[0]->upload_outputs(*hosts[0]);
    launch(0);
    check(cudaStreamSynchronize(stream), "first run");
    devs[0]->download_outputs(*hosts[0]);
    const testing::Verdict v = testing::check_case(*hosts[0], rows);
    if (!v.ok)
      throw std::runtime_error(fmt::format("{} ({} kernels): wrong result, not timing it: {}", bc.name, build, v.message));
  };
  run_and_check(compare_nvrtc ? "nvcc" : "the selected");

  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  auto time_calls = [&](auto&& call) {
    for (int32_t i = 0; i < std::max(5, copies); ++i) call(i);
    std::vector<double> us;
    for (int32_t i = 0; i < iters; ++i) {
      cudaEventRecord(e0, stream);
      call(i);
      cudaEventRecord(e1, stream);
      check(cudaEventSynchronize(e1), "timed run");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      us.push_back(ms * 1e3);
    }
    return median(us);
  };
  GpuResult r{bc.name, bc.spec, time_calls(launch), 0, kv_bytes, attention_flops(bc.spec), 0, iters, plan.describe()};
  if (compare_nvrtc) {
    auto use = [](jit::CudaKernels k) { jit::set_cuda_kernels(k); };
    use(jit::CudaKernels::kNvrtc);
    run_and_check("NVRTC");
    const double nvrtc1 = time_calls(launch);
    use(jit::CudaKernels::kNvcc);
    const double nvcc2 = time_calls(launch);
    use(jit::CudaKernels::kNvrtc);
    const double nvrtc2 = time_calls(launch);
    use(selected);
    r.median_us = (r.median_us + nvcc2) / 2;
    r.nvrtc_us = (nvrtc1 + nvrtc2) / 2;
  }
  if (bc.graph) {
    std::vector<cudaGraphExec_t> execs(copies);
    for (int32_t i = 0; i < copies; ++i) {
      cudaGraph_t g;
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      launch(i);
      check(cudaStreamEndCapture(stream, &g), "capture");
      check(cudaGraphInstantiate(&execs[i], g, 0), "instantiate");
      cudaGraphDestroy(g);
    }
    r.graph_us = time_calls([&](int32_t i) { check(cudaGraphLaunch(execs[i % copies], stream), "graph launch"); });
    for (auto e : execs) cudaGraphExecDestroy(e);
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  if (compare_nvrtc) fmt::print(stderr, "{} {}: NVRTC-compiled kernels {:.1f} us\n", progress, bc.name, r.nvrtc_us);
  fmt::print(stderr, "{} {}: checked ({} rows); median {:.1f} us{}, {:.2f} TB/s, {:.1f} TFLOP/s; {}\n", progress,
             bc.name, rows.empty() ? hosts[0]->total_qo() : static_cast<int64_t>(rows.size()), r.median_us,
             r.graph_us > 0 ? fmt::format(" ({:.1f} us as a graph)", r.graph_us) : "", kv_bytes / (r.median_us * 1e6),
             r.flops / (r.median_us * 1e6), r.plan);
  return r;
}

}  // namespace

std::vector<CompilerComparison> compare_kernel_builds(const DeviceInfo& device, bool quick, int32_t iters) {
  const int id = device.device.id;
  check(cudaSetDevice(id), "cudaSetDevice");
  // The decode and the prefill suite of `attnforge bench` (quick or whole), so both kernel families are compared.
  std::vector<GpuBenchCase> suite = gpu_suite(quick);
  for (GpuBenchCase& c : gpu_prefill_suite(quick)) suite.push_back(std::move(c));
  std::vector<CompilerComparison> out;
  for (size_t i = 0; i < suite.size(); ++i) {
    const GpuResult r = bench_gpu_case(suite[i], id, iters, fmt::format("[nvcc vs NVRTC {}/{}]", i + 1, suite.size()),
                                       /*compare_nvrtc=*/true);
    out.push_back({r.name, r.spec.kind == PlanKind::kPrefill, r.median_us, r.nvrtc_us, r.bytes, r.flops});
  }
  return out;
}

int run_bench_cuda(const BenchOptions& options, const DeviceInfo& device) {
  const int id = device.device.id;
  check(cudaSetDevice(id), "cudaSetDevice");
  const int32_t iters = options.iters > 0 ? options.iters : (options.quick ? 20 : 100);
  std::ofstream json;
  if (!options.json_path.empty()) {
    json.open(options.json_path);
    if (!json) throw std::runtime_error(fmt::format("--json {}: cannot open the file for writing", options.json_path));
  }
  std::vector<GpuBenchCase> suite;
  if (options.suite == "all" || options.suite == "decode") suite = gpu_suite(options.quick);
  if (options.suite == "all" || options.suite == "prefill")
    for (GpuBenchCase& c : gpu_prefill_suite(options.quick)) suite.push_back(std::move(c));
  if (options.suite == "long") suite = gpu_long_suite();
  if (suite.empty())
    throw std::runtime_error(fmt::format("--suite {}: expected one of {{all, decode, prefill, long}}", options.suite));
  if (!options.case_filter.empty()) {
    std::erase_if(suite, [&](const GpuBenchCase& c) { return c.name.find(options.case_filter) == std::string::npos; });
    if (suite.empty())
      throw std::runtime_error(fmt::format("--case {}: no case of suite {} has that in its name", options.case_filter,
                                           options.suite));
  }
  const size_t steps = suite.size() + 2;
  fmt::print(stderr, "[1/{}] ceiling: device-to-device copy ...\n", steps);
  const CopyCeiling copy = copy_bandwidth();
  const double copy_gbps = copy.gbps;
  fmt::print(stderr, "[2/{}] ceiling: cuBLAS bf16 matrix product 8192^3 ...\n", steps);
  double gemm_us = 0;
  const double gemm = gemm_tflops(&gemm_us);
  std::vector<GpuResult> results;
  for (size_t i = 0; i < suite.size(); ++i)
    results.push_back(bench_gpu_case(suite[i], id, iters, fmt::format("[{}/{}]", i + 3, steps)));

  const std::string dev = fmt::format("{} {}", to_string(device.device), device.name);
  fmt::print("attnforge bench, suite {}-gpu: {}\n", options.suite, build_info());
  fmt::print("device {}: {}\n", dev, device.description);
  fmt::print("ceiling device-to-device copy: {:.2f} TB/s (read + write)\n", copy_gbps / 1e3);
  fmt::print("ceiling cuBLAS bf16 matrix product: {}\n\n",
             gemm > 0 ? fmt::format("{:.0f} TFLOP/s", gemm) : std::string("n/a (built without cuBLAS)"));
  fmt::print("{:<30} {:>11} {:>11} {:>9} {:>10} {:>9} {:>10}\n", "case", "median_us", "graph_us", "TB/s", "% of copy",
             "TFLOP/s", "% of gemm");
  for (const GpuResult& r : results) {
    const double gbps = r.bytes / (r.median_us * 1e3), tflops = r.flops / (r.median_us * 1e6);
    const bool prefill = r.spec.kind == PlanKind::kPrefill;
    fmt::print("{:<30} {:>11.1f} {:>11} {:>9.3f} {:>9.1f}% {:>9.1f} {:>10}\n", r.name, r.median_us,
               r.graph_us > 0 ? fmt::format("{:.1f}", r.graph_us) : "-", gbps / 1e3, gbps / copy_gbps * 100, tflops,
               prefill && gemm > 0 ? fmt::format("{:.1f}%", tflops / gemm * 100) : "-");
  }
  if (json.is_open()) {
    nlohmann::json out = nlohmann::json::array();
    nlohmann::json c;
    c["suite"] = "decode", c["case"] = "device-to-device copy", c["system"] = "ceiling", c["device"] = dev;
    c["gbps"] = copy_gbps, c["ceiling"] = copy_gbps, c["median_us"] = copy.median_us, c["pct_of_ceiling"] = 100.0, c["iters"] = 10;
    c["bytes"] = 2.0 * (size_t{1} << 31), c["commit"] = git_commit();
    out.push_back(c);
    if (gemm > 0) {
      nlohmann::json g;
      g["suite"] = "prefill", g["case"] = "cuBLAS bf16 gemm 8192^3", g["system"] = "ceiling", g["device"] = dev;
      g["tflops"] = gemm, g["ceiling"] = gemm, g["pct_of_ceiling"] = 100.0, g["iters"] = 20, g["commit"] = git_commit();
      g["median_us"] = gemm_us;
      out.push_back(g);
    }
    for (const GpuResult& r : results) {
      const double gbps = r.bytes / (r.median_us * 1e3), tflops = r.flops / (r.median_us * 1e6);
      const bool prefill = r.spec.kind == PlanKind::kPrefill;
      nlohmann::json j;
      j["suite"] = prefill ? "prefill" : "decode", j["case"] = r.name, j["system"] = "attnforge", j["device"] = dev;
      j["median_us"] = r.median_us, j["gbps"] = gbps, j["tflops"] = tflops, j["flops"] = r.flops;
      j["ceiling"] = prefill ? gemm : copy_gbps;
      j["pct_of_ceiling"] = prefill ? (gemm > 0 ? tflops / gemm * 100 : 0.0) : gbps / copy_gbps * 100;
      j["bytes"] = r.bytes, j["iters"] = r.iters, j["commit"] = git_commit();
      if (r.graph_us > 0) j["graph_us"] = r.graph_us;
      j["detail"] = r.spec.describe() + "; " + r.plan;
      j["shape"] = {{"kv_lens", r.spec.kv_lens}, {"qo_lens", r.spec.qo_lens}, {"qo_len", r.spec.qo_lens[0]},
                    {"causal", r.spec.options.causal}, {"num_qo_heads", r.spec.num_qo_heads},
                    {"num_kv_heads", r.spec.num_kv_heads}, {"head_dim", r.spec.head_dim_qk},
                    {"page_size", r.spec.page_size}, {"kv_dtype", to_string(r.spec.kv_dtype)}};
      out.push_back(j);
    }
    json << out.dump(1) << "\n";
  }
  return 0;
}

}  // namespace attnforge::cli
