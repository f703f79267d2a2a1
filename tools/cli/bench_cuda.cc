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
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "attnforge/context_parallel.h"
#include "attnforge/devices.h"
#include "attnforge/jit.h"
#include "backends/cuda/prefill/prefill.h"
#include "ops/prepare.h"
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
  bool warm_code = false;  // --warm-code: a small run of the same kernels before every timed call
};

// One run() of a case copy on the device with its plan and workspace.
void run_case(const AttentionPlan& plan, const testing::DeviceCase& d, KVFormat format, const Workspace& w,
              cudaStream_t stream) {
  if (format == KVFormat::kRagged)
    run(plan, d.q, d.ragged, Outputs{d.out, d.lse}, d.options, w, stream);
  else
    run(plan, d.q, d.paged, Outputs{d.out, d.lse}, d.options, w, stream);
}

// --warm-code: a problem of the case's shape (heads, dims, dtypes, layout, options) cut down to one request of 256
// KV tokens and at most 128 query tokens, planned like the case (decode splits it in two, so the merge kernel runs
// too: its warp-per-row form, which serves merges of up to 32 states). Run and waited for before each timed call,
// it leaves the kernels' code in the L2 (and in the instruction caches of the SMs its CTAs ran on) but not the
// case's K/V, plan or Q: the difference from the plain figure is what fetching the code from DRAM costs a call.
struct WarmCodeRun {
  std::unique_ptr<testing::Case> host;
  std::unique_ptr<testing::DeviceCase> dev;
  AttentionPlan plan;
  std::unique_ptr<DeviceBuffer> ws;
  std::unique_ptr<PinnedBuffer> staging;

  WarmCodeRun(const testing::CaseSpec& spec, int device, cudaStream_t stream) {
    testing::CaseSpec s = spec;
    const int32_t qo = std::clamp(s.qo_lens.empty() ? 1 : s.qo_lens[0], 1, 128);
    s.qo_lens = {qo};
    s.kv_lens = {std::max(256, qo)};
    s.seed += 1000;
    host = std::make_unique<testing::Case>(testing::make_case(s));
    dev = std::make_unique<testing::DeviceCase>(*host, device);
    BatchPlanArgs args = host->plan_args();
    args.device = Device::cuda(device);
    plan = s.kind == PlanKind::kPrefill ? plan_batch_prefill(args) : plan_batch_decode(args);
    ws = std::make_unique<DeviceBuffer>(plan.workspace_bytes);
    staging = std::make_unique<PinnedBuffer>(plan.staging_bytes);
    upload_plan(plan, Workspace{ws->ptr, plan.workspace_bytes}, staging->ptr, plan.staging_bytes, stream);
  }
  void run_and_wait(KVFormat format, cudaStream_t stream) const {
    run_case(plan, *dev, format, Workspace{ws->ptr, plan.workspace_bytes}, stream);
    check(cudaStreamSynchronize(stream), "--warm-code run");
  }
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
    v.push_back({"decode 16x2048", gpu_decode(16, 2048), true});
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
  // The split steps are timed in graphs too (the host's launch is a share of their time).
  v.push_back({"decode 1x32768", gpu_decode(1, 32768), true});
  v.push_back({"decode 16x2048", gpu_decode(16, 2048), true});
  v.push_back({"decode 1x2048", gpu_decode(1, 2048), true});
  // HND pages (a KV head's slice of a page in one piece: 4 KB at page size 16, where NHD's is 16 rows 2 KB apart).
  auto hnd = [](testing::CaseSpec s) {
    s.layout = KVLayout::kHND;
    return s;
  };
  v.push_back({"decode 64x8192 hnd", hnd(gpu_decode(64, 8192))});
  v.push_back({"decode 1x32768 hnd", hnd(gpu_decode(1, 32768)), true});
  // The same split steps at head_dim 64 and 256 (256 runs the small-batch pipeline too; 64 keeps two stages).
  for (const int32_t d : {64, 256})
    for (const auto& [batch, kv] : {std::pair{1, 32768}, std::pair{16, 2048}}) {
      testing::CaseSpec s = gpu_decode(batch, kv);
      s.head_dim_qk = d;
      v.push_back({fmt::format("decode {}x{} d{}", batch, kv, d), s, true});
    }
  // A batch that fills the GPU at head_dim 256 (two stages, one CTA an SM; the planner cuts each request in two,
  // toward two waves).
  testing::CaseSpec d256 = gpu_decode(32, 8192);
  d256.head_dim_qk = 256;
  v.push_back({"decode 32x8192 d256", d256});
  v.push_back({"decode 64x4096 uniform", gpu_decode(64, 4096)});
  testing::CaseSpec zipf = gpu_decode(64, 4096);
  zipf.kv_lens = zipf_lengths(64, 64 * 4096);
  v.push_back({"decode 64x4096 zipf", zipf});
  v.push_back({"decode 128x2048 qo1", gpu_decode(128, 2048)});
  v.push_back({"decode 128x2048 qo4 causal", gpu_decode(128, 2048, 16, 4)});
  // fp8 K/V with 16 rows a CTA: the fp8 kernels' second row pass (two n8 tiles of rows).
  v.push_back({"decode 128x2048 qo4 causal fp8", fp8(gpu_decode(128, 2048, 16, 4))});
  return v;
}


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
  // Speculative verification: 8 draft tokens onto each of 64 caches of 4K (32 packed rows a request: the short
  // 64-row tile).
  v.push_back({"verify 64x8+4096", gpu_prefill(square(64, 8), square(64, 4104), true)});
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
  // graph_us: one call captured in a graph, replayed alone after the previous one finished (the host's launch of
  // the graph included); chain_us: `copies` calls captured in one graph, replayed whole, over the calls (a serving
  // engine's step, whose graph holds every layer's call: one launch for all of them).
  // host_us: the host's time in one run() call (validation, launches), the median of the plain calls.
  // host_prepare_us: of host_us, run()'s checks and params alone (paged K/V; no launch).
  double median_us = 0, graph_us = 0, chain_us = 0, host_us = 0, host_prepare_us = 0, bytes = 0, flops = 0;
  double nvrtc_us = 0;  // with compare_nvrtc: the same launches with the NVRTC-compiled kernels
  int32_t iters = 0;
  std::string plan;
};

// Microseconds of the host's clock since t0.
double host_us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

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
  auto launch = [&](int32_t i) { run_case(plan, *devs[i % copies], bc.spec.format, w, stream); };
  const std::unique_ptr<WarmCodeRun> warm = bc.warm_code ? std::make_unique<WarmCodeRun>(bc.spec, device, stream)
                                                         : nullptr;

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
  double host_us = 0;  // the last time_calls' median host time of a call
  auto time_calls = [&](auto&& call) {
    for (int32_t i = 0; i < std::max(5, copies); ++i) call(i);
    std::vector<double> us, host;
    for (int32_t i = 0; i < iters; ++i) {
      if (warm) warm->run_and_wait(bc.spec.format, stream);
      cudaEventRecord(e0, stream);
      const auto h0 = std::chrono::steady_clock::now();
      call(i);
      host.push_back(host_us_since(h0));
      cudaEventRecord(e1, stream);
      check(cudaEventSynchronize(e1), "timed run");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      us.push_back(ms * 1e3);
    }
    host_us = median(host);
    return median(us);
  };
  GpuResult r;
  r.name = bc.warm_code ? bc.name + " warm-code" : bc.name;
  r.spec = bc.spec;
  r.median_us = time_calls(launch);
  r.host_us = host_us;
  r.bytes = kv_bytes;
  r.flops = attention_flops(bc.spec);
  r.iters = iters;
  r.plan = plan.describe();
  if (bc.spec.format != KVFormat::kRagged) {
    const testing::DeviceCase& d = *devs[0];
    std::vector<double> prep;
    for (int32_t i = 0; i < 50; ++i) {
      const auto h0 = std::chrono::steady_clock::now();
      detail::PreparedRun prepared;
      const KVParams kv = detail::paged_run_params(plan, d.paged);
      detail::prepare_run(prepared, plan, d.q, kv, d.paged.k, d.paged.v, d.paged.layout, Outputs{d.out, d.lse},
                          d.options, w);
      prep.push_back(host_us_since(h0));
    }
    r.host_prepare_us = median(prep);
  }
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
    // At least 16 calls in the chain; each call reads its own copy of the inputs, so none finds its K/V in the L2.
    const int32_t chain = std::max(copies, 16);
    cudaGraph_t g;
    cudaGraphExec_t chain_exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    for (int32_t i = 0; i < chain; ++i) launch(i);
    check(cudaStreamEndCapture(stream, &g), "capture");
    check(cudaGraphInstantiate(&chain_exec, g, 0), "instantiate");
    cudaGraphDestroy(g);
    r.chain_us = time_calls([&](int32_t) { check(cudaGraphLaunch(chain_exec, stream), "graph launch"); }) / chain;
    cudaGraphExecDestroy(chain_exec);
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  if (compare_nvrtc) fmt::print(stderr, "{} {}: NVRTC-compiled kernels {:.1f} us\n", progress, bc.name, r.nvrtc_us);
  fmt::print(stderr,
             "{} {}: checked ({} rows); median {:.1f} us (host {:.1f} us in run(), {:.1f} of them its checks){}, "
             "{:.2f} TB/s, {:.1f} TFLOP/s; {}\n",
             progress, bc.name, rows.empty() ? hosts[0]->total_qo() : static_cast<int64_t>(rows.size()), r.median_us,
             r.host_us, r.host_prepare_us,
             r.graph_us > 0
                 ? fmt::format(" ({:.1f} us as a graph, {:.1f} us a call in a graph of many)", r.graph_us, r.chain_us)
                 : "",
             kv_bytes / (r.median_us * 1e6), r.flops / (r.median_us * 1e6), r.plan);
  return r;
}

// Suite "long" (issue 7; not in "all", to keep the full run within a device call): decode of one request of 1M
// tokens (32 query heads over 8 KV heads, head_dim 128, bf16: 4.3 GB of K/V) on 1 GPU and split over 2, 4 and 8
// (up to --gpus, default every visible GPU) with run_context_parallel: one thread and one GPU per rank, one NCCL
// communicator, each rank's K/V pages on its own GPU. Each step (the rank's run, the all-gather of the states and
// the merge) is captured in a CUDA graph and replayed back to back after a barrier of the threads; the figure is
// rank 0's median over samples of kCpReps replays. The merged result of every world size and partition is checked
// against the float64 reference, and every rank's result must equal rank 0's bit for bit.
struct CpResult {
  int32_t world;
  KVPartition partition;
  double median_us;
  double max_rank_kv_bytes;  // the K/V bytes of the rank with the most pages
  size_t state_bytes;        // one rank's packed (o float32, lse) state: the all-gather's payload per rank
};

constexpr int32_t kCpReps = 10;

CpResult bench_context_parallel(testing::Case& host, std::vector<std::unique_ptr<testing::DeviceCase>>& devs,
                                int32_t world, KVPartition partition, int32_t samples) {
  const testing::CaseSpec& s = host.spec;
  const std::string id = world > 1 ? nccl_unique_id() : std::string();
  const RankStateLayout layout{host.total_qo(), s.num_qo_heads, host.head_dim_vo(), DType::kFloat32};
  std::vector<std::string> failures(world);
  std::vector<std::vector<uint8_t>> results(world);
  std::vector<double> rank_bytes(world), rank_us(world);
  // The ranks meet before every collective: a rank that failed drops out of the barrier, and the others stop at
  // the meeting instead of waiting for it in an all-gather.
  std::barrier sync(world);
  std::atomic<bool> any_failed = false;
  auto meet = [&] {
    sync.arrive_and_wait();
    if (any_failed) throw std::runtime_error("stopped: another rank failed");
  };
  const size_t out_bytes = host.out.bytes(), lse_bytes = host.lse.bytes();
  auto rank_main = [&](int32_t r) {
    void* comm = nullptr;
    std::vector<void*> allocations;
    cudaStream_t stream = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    try {
      check(cudaSetDevice(r), "cudaSetDevice");
      if (world > 1) comm = nccl_comm_init_rank(world, r, id, r);
      const testing::DeviceCase& dev = *devs[r];
      const Device gpu = Device::cuda(r);
      const RankPageTable share = partition_pages(host.paged.table, s.page_size, world, r, partition);
      double tokens = 0;
      for (int32_t n : share.kv_len) tokens += n;
      rank_bytes[r] = tokens * s.num_kv_heads * (s.head_dim_qk + host.head_dim_vo()) * dtype_bytes(s.kv_dtype);
      BatchPlanArgs args = host.plan_args();
      args.device = gpu;
      args.set_paged(share.table(), s.page_size);
      if (world > 1) args.shape.o_dtype = DType::kFloat32;  // the states stay fp32 until the merge
      AttentionPlan plan = plan_batch_decode(args);
      auto device_alloc = [&](size_t bytes) {
        void* p = nullptr;
        check(cudaMalloc(&p, std::max<size_t>(bytes, 256)), "cudaMalloc");
        allocations.push_back(p);
        return p;
      };
      auto to_device = [&](const std::vector<int32_t>& v) {
        void* d = device_alloc(v.size() * 4);
        if (!v.empty()) check(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
        return TensorView(d, DType::kInt32, {static_cast<int64_t>(v.size())}, gpu);
      };
      const Workspace w{device_alloc(plan.workspace_bytes), plan.workspace_bytes};
      PinnedBuffer staging(plan.staging_bytes);
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      upload_plan(plan, w, staging.ptr, plan.staging_bytes, stream);
      PagedKVCache kv = dev.paged;
      kv.table = PageTable::csr(to_device(share.indptr), to_device(share.indices), to_device(share.last_page_len));
      void* gathered = device_alloc(world * layout.rank_bytes());
      const Outputs outs{dev.out, dev.lse};
      auto step = [&] {
        if (world == 1)
          run(plan, dev.q, kv, outs, dev.options, w, stream);
        else
          run_context_parallel(plan, dev.q, kv, outs, dev.options, w, layout, gathered, r, world, comm, stream);
      };
      // The run's and the merge's kernels launched once on this GPU before any collective: a launch that fails
      // here fails before the meeting, not inside an all-gather that the other ranks would wait on forever.
      run(plan, dev.q, kv, world == 1 ? outs : layout.rank_outputs(gathered, r, gpu), dev.options, w, stream);
      if (world > 1) merge_gathered_states(layout, gathered, world, outs, gpu, stream);
      // Checked first: outputs poisoned (the host case's NaN buffers), one eager step, every rank's bytes kept.
      dev.upload_outputs(host);
      check(cudaStreamSynchronize(stream), "upload");
      meet();
      step();
      check(cudaStreamSynchronize(stream), "checked step");
      meet();  // no rank allocates or instantiates while another's all-gather waits for it
      // The whole out and lse buffers, guards included (device copies of the host case's buffers).
      auto whole = [&](const testing::Buffer& b) {
        return dev.to_device(TensorView(b.data(), b.dtype, {static_cast<int64_t>(b.count)})).data;
      };
      results[r].resize(out_bytes + lse_bytes);
      check(cudaMemcpy(results[r].data(), whole(host.out), out_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy out");
      check(cudaMemcpy(results[r].data() + out_bytes, whole(host.lse), lse_bytes, cudaMemcpyDeviceToHost),
            "cudaMemcpy lse");
      cudaGraph_t g;
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      step();
      check(cudaStreamEndCapture(stream, &g), "capture");
      check(cudaGraphInstantiate(&exec, g, 0), "instantiate");
      cudaGraphDestroy(g);
      cudaEventCreate(&e0), cudaEventCreate(&e1);
      std::vector<double> us;
      for (int32_t i = 0; i < samples + 3; ++i) {
        meet();
        cudaEventRecord(e0, stream);
        for (int32_t k = 0; k < kCpReps; ++k) check(cudaGraphLaunch(exec, stream), "graph launch");
        cudaEventRecord(e1, stream);
        check(cudaEventSynchronize(e1), "timed steps");
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 3) us.push_back(ms * 1e3 / kCpReps);
      }
      rank_us[r] = median(us);
      meet();  // every rank's collectives are done before any frees (which synchronize implicitly)
    } catch (const std::exception& e) {
      failures[r] = e.what();
      any_failed = true;
      sync.arrive_and_drop();
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (e0) cudaEventDestroy(e0), cudaEventDestroy(e1);
    if (stream) cudaStreamDestroy(stream);
    for (void* p : allocations) cudaFree(p);
    if (comm) nccl_comm_destroy(comm);
  };
  fmt::print(stderr, "[long] {} GPU{} {}: communicator, plans, one step, then {} timed samples ...\n", world,
             world == 1 ? "" : "s", to_string(partition), samples);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r) threads.emplace_back(rank_main, r);
  for (std::thread& t : threads) t.join();
  fmt::print(stderr, "[long] {} GPU{} {}: timed; checking the merged result against float64 ...\n", world,
             world == 1 ? "" : "s", to_string(partition));
  std::string failed;
  for (int32_t r = 0; r < world; ++r)
    if (!failures[r].empty()) failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ", r, failures[r]);
  if (!failed.empty()) throw std::runtime_error(fmt::format("world {} {}: {}", world, to_string(partition), failed));
  for (int32_t r = 1; r < world; ++r)
    if (results[r] != results[0])
      throw std::runtime_error(fmt::format("world {} {}: rank {}'s merged result differs from rank 0's", world,
                                           to_string(partition), r));
  std::memcpy(host.out.data(), results[0].data(), out_bytes);
  std::memcpy(host.lse.data(), results[0].data() + out_bytes, lse_bytes);
  const testing::Verdict v = testing::check_case(host, sampled_rows(host.total_qo()));
  if (!v.ok)
    throw std::runtime_error(fmt::format("world {} {}: wrong result, not timing it: {}", world, to_string(partition),
                                         v.message));
  host.poison_outputs();
  return {world, partition, rank_us[0], *std::max_element(rank_bytes.begin(), rank_bytes.end()),
          world > 1 ? layout.rank_bytes() : 0};
}

int run_long_bench(const BenchOptions& options, const DeviceInfo& device) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device.device.id != 0)
    throw std::runtime_error("--suite long: ranks run on cuda:0 .. cuda:N-1; pass --device cuda:0 (or none)");
  const int32_t gpus = options.gpus > 0 ? options.gpus : std::min(count, 8);
  if (gpus > count)
    throw std::runtime_error(fmt::format("--gpus {}: {} GPU{} visible", gpus, count, count == 1 ? "" : "s"));
  std::vector<int32_t> worlds;
  for (int32_t w : {1, 2, 4, 8})
    if (w <= gpus) worlds.push_back(w);
  if (worlds.back() != gpus) worlds.push_back(gpus);
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on the machines we run on
  const int32_t samples = options.iters > 0 ? options.iters : 30;
  check(cudaSetDevice(0), "cudaSetDevice");
  fmt::print(stderr, "[long] ceiling: device-to-device copy on cuda:0 ...\n");
  const CopyCeiling copy = copy_bandwidth();
  testing::CaseSpec spec = gpu_decode(1, 1 << 20);
  fmt::print(stderr, "[long] building the batch (4.3 GB of K/V) on {} GPU{} ...\n", gpus, gpus == 1 ? "" : "s");
  testing::Case host = testing::make_case(spec);
  std::vector<std::unique_ptr<testing::DeviceCase>> devs(gpus);
  {
    std::vector<std::thread> uploads;
    for (int32_t g = 0; g < gpus; ++g)
      uploads.emplace_back([&, g] { devs[g] = std::make_unique<testing::DeviceCase>(host, g); });
    for (std::thread& t : uploads) t.join();
  }
  std::vector<CpResult> results;
  for (int32_t world : worlds)
    for (KVPartition p : {KVPartition::kContiguous, KVPartition::kRoundRobinPages}) {
      if (world == 1 && p == KVPartition::kRoundRobinPages) continue;  // one rank: both are the whole table
      results.push_back(bench_context_parallel(host, devs, world, p, samples));
      const CpResult& r = results.back();
      fmt::print(stderr, "[long] {} GPU{} {}: checked; median {:.1f} us\n", world, world == 1 ? "" : "s",
                 to_string(p), r.median_us);
    }
  const double one = results[0].median_us;
  const std::string dev = fmt::format("{} x{} {}", to_string(device.device), gpus, device.name);
  fmt::print("attnforge bench, suite long-gpu (context parallelism): {}\n", build_info());
  fmt::print("device {}: {}\n", dev, device.description);
  fmt::print("case: decode 1x1048576 (32 query heads over 8 KV heads, head_dim 128, bf16, pages of 16)\n");
  fmt::print("ceiling device-to-device copy (cuda:0): {:.2f} TB/s (read + write)\n\n", copy.gbps / 1e3);
  fmt::print("{:>5} {:<19} {:>10} {:>8} {:>13} {:>10} {:>15} {:>15}\n", "GPUs", "partition", "median_us", "speedup",
             "TB/s per GPU", "% of copy", "sent per rank", "recv per rank");
  nlohmann::json out = nlohmann::json::array();
  for (const CpResult& r : results) {
    const double gbps = r.max_rank_kv_bytes / (r.median_us * 1e3);
    const size_t recv = r.state_bytes * (r.world - 1);
    fmt::print("{:>5} {:<19} {:>10.1f} {:>7.2f}x {:>13.3f} {:>9.1f}% {:>13} B {:>13} B\n", r.world,
               to_string(r.partition), r.median_us, one / r.median_us, gbps / 1e3, gbps / copy.gbps * 100,
               r.state_bytes, recv);
    nlohmann::json j;
    j["suite"] = "long", j["case"] = fmt::format("decode 1x1048576 on {} GPU{}", r.world, r.world == 1 ? "" : "s");
    j["system"] = "attnforge", j["device"] = dev, j["world_size"] = r.world, j["partition"] = to_string(r.partition);
    j["median_us"] = r.median_us, j["speedup_vs_1"] = one / r.median_us, j["gbps_per_gpu"] = gbps;
    j["ceiling"] = copy.gbps, j["pct_of_ceiling"] = gbps / copy.gbps * 100, j["bytes"] = r.max_rank_kv_bytes;
    j["allgather_bytes_sent_per_rank"] = r.state_bytes, j["allgather_bytes_received_per_rank"] = recv;
    j["samples"] = samples, j["reps_per_sample"] = kCpReps, j["commit"] = git_commit();
    out.push_back(j);
  }
  if (!options.json_path.empty()) {
    std::ofstream json(options.json_path);
    if (!json) throw std::runtime_error(fmt::format("--json {}: cannot open the file for writing", options.json_path));
    json << out.dump(1) << "\n";
  }
  return 0;
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
  if (options.suite == "long") {
    if (options.warm_code)
      throw std::runtime_error("--warm-code: not for --suite long (its steps are timed as graphs of several calls); "
                               "expected --suite all, decode or prefill");
    return run_long_bench(options, device);
  }
  if (suite.empty())
    throw std::runtime_error(fmt::format("--suite {}: expected one of {{all, decode, prefill, long}}", options.suite));
  if (!options.case_filter.empty()) {
    std::erase_if(suite, [&](const GpuBenchCase& c) { return !case_selected(c.name, options.case_filter); });
    if (suite.empty())
      throw std::runtime_error(fmt::format("--case {}: no case of suite {} has that in its name", options.case_filter,
                                           options.suite));
  }
  for (GpuBenchCase& c : suite) {
    if (options.workers > 0) c.spec.plan.num_workers = options.workers;
    if (options.tile_rows > 0) c.spec.plan.tile_rows = options.tile_rows;
    c.warm_code = options.warm_code;
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
  // Which kernel ran the prefill cases (backends/cuda/prefill/prefill.h), so a record says what it measured.
  const char* wgmma_mode[] = {"auto", "0", "1"};
  const char* wgmma_form[] = {" (barrier form)", " (warp-specialized)", " (warp-specialized, pipelined over items)",
                              " (warp-specialized, pipelined over items, softmax overlapped with P V)"};
  const std::string prefill_kernels = fmt::format(
      "ATTNFORGE_PREFILL_WGMMA={}: {}", wgmma_mode[static_cast<int>(cuda::prefill_wgmma())],
      cuda::prefill_wgmma_serves(128, 128)
          ? fmt::format("Hopper wgmma kernel{} for 128-row tiles of head_dim 64, 128 and 256 without RoPE, portable "
                        "otherwise; {}",
                        wgmma_form[cuda::prefill_wgmma_form()], cuda::prefill_copy_settings())
          : std::string("portable mma.sync kernel"));
  fmt::print("attnforge bench, suite {}-gpu: {}\n", options.suite, build_info());
  fmt::print("device {}: {}\n", dev, device.description);
  fmt::print("ceiling device-to-device copy: {:.2f} TB/s (read + write)\n", copy_gbps / 1e3);
  fmt::print("ceiling cuBLAS bf16 matrix product: {}\n",
             gemm > 0 ? fmt::format("{:.0f} TFLOP/s", gemm) : std::string("n/a (built without cuBLAS)"));
  fmt::print("prefill kernels: {}\n\n", prefill_kernels);
  fmt::print("{:<30} {:>11} {:>11} {:>9} {:>9} {:>10} {:>9} {:>10}\n", "case", "median_us", "graph_us", "chain_us",
             "TB/s", "% of copy", "TFLOP/s", "% of gemm");
  for (const GpuResult& r : results) {
    const double gbps = r.bytes / (r.median_us * 1e3), tflops = r.flops / (r.median_us * 1e6);
    const bool prefill = r.spec.kind == PlanKind::kPrefill;
    fmt::print("{:<30} {:>11.1f} {:>11} {:>9} {:>9.3f} {:>9.1f}% {:>9.1f} {:>10}\n", r.name, r.median_us,
               r.graph_us > 0 ? fmt::format("{:.1f}", r.graph_us) : "-",
               r.chain_us > 0 ? fmt::format("{:.1f}", r.chain_us) : "-", gbps / 1e3, gbps / copy_gbps * 100, tflops,
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
      if (r.chain_us > 0) j["chain_us"] = r.chain_us;
      j["host_us"] = r.host_us;
      if (r.host_prepare_us > 0) j["host_prepare_us"] = r.host_prepare_us;
      j["detail"] = r.spec.describe() + "; " + r.plan;
      if (prefill) j["prefill_kernels"] = prefill_kernels;
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
