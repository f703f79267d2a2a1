// Host time of kernel launches on this machine: empty kernels with 16-byte and 1 KB parameters, <<<>>> and
// cudaLaunchKernelEx (with the programmatic-serialization attribute), one and two launches a call; and the events'
// time around one call after a sync (what a plain-median bench figure pays beyond the kernels). "after sync": the
// host time of a call made right after cudaEventRecord following a sync, as the bench's plain loop times run();
// "100 KB smem": the launch asks for 100 KB of dynamic shared memory (the decode kernels' 3-stage head_dim 128 form).
// "graph of one": the same launch as a one-node graph instantiated once and launched with cudaGraphLaunch, its
// parameters unchanged or set anew before each launch (cudaGraphExecKernelNodeSetParams, as an eager run() that
// launched through a cached graph would have to: every layer's call has its own tensors).
// "driver": the same launch through cuLaunchKernelEx on the kernel's CUfunction (cudaGetFuncBySymbol, once), which
// skips the runtime's per-call bookkeeping (measured level with the runtime's launch: perf-notes v35).
// Build: nvcc -O2 -arch=sm_90a -o launch_probe bench/launch_probe.cu -lcuda (on any machine with nvcc; run it on the
// GPU machine).
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
struct Small { long long a, b; };
struct Big { long long a[128]; };
__global__ void k_small(Small s) { if (s.a == 12345) asm volatile("trap;"); }
__global__ void k_big(Big s) { if (s.a[0] == 12345) asm volatile("trap;"); }
__global__ void k_smem(Big s) {
  extern __shared__ long long sm[];
  if (s.a[0] == 12345) {
    sm[threadIdx.x] = 1;
    asm volatile("trap;");
  }
}
double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// Host time of f(): back to back with a sync every 64 calls, or (after_sync) each call right after a sync and an event
// record, as the bench's plain loop calls run().
template <class F> double median_host(F&& f, bool after_sync, int n = 2000) {
  cudaEvent_t e0; cudaEventCreate(&e0);
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    if (after_sync || i % 64 == 0) cudaDeviceSynchronize();
    if (after_sync) cudaEventRecord(e0);
    auto h0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
  }
  cudaDeviceSynchronize();
  cudaEventDestroy(e0);
  return median(t);
}
template <class F> double median_events(F&& f, int n = 500) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    cudaDeviceSynchronize();
    cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms * 1e3);
  }
  return median(t);
}
int main() {
  Small s{1, 2}; Big b{}; b.a[0] = 1;
  cudaLaunchAttribute attr{}; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  auto ex_big = [&](bool pdl) {
    cudaLaunchConfig_t c{}; c.gridDim = dim3(128); c.blockDim = dim3(128); c.attrs = &attr; c.numAttrs = pdl ? 1 : 0;
    cudaLaunchKernelEx(&c, k_big, b);
  };
  constexpr int kSmem = 100 * 1024;
  cudaFuncSetAttribute(k_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  auto ex_smem = [&](bool pdl, int grid) {
    cudaLaunchConfig_t c{}; c.gridDim = dim3(grid); c.blockDim = dim3(128); c.dynamicSmemBytes = kSmem;
    c.attrs = &attr; c.numAttrs = pdl ? 1 : 0;
    cudaLaunchKernelEx(&c, k_smem, b);
  };
  cudaFunction_t smem_fn = nullptr;
  cudaGetFuncBySymbol(&smem_fn, reinterpret_cast<const void*>(k_smem));
  auto drv_smem = [&](bool pdl, int grid) {
    CUlaunchAttribute a{}; a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    a.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig c{}; c.gridDimX = grid; c.gridDimY = c.gridDimZ = 1; c.blockDimX = 128; c.blockDimY = c.blockDimZ = 1;
    c.sharedMemBytes = kSmem; c.attrs = &a; c.numAttrs = pdl ? 1 : 0;
    void* args[] = {&b};
    cuLaunchKernelEx(&c, reinterpret_cast<CUfunction>(smem_fn), args, nullptr);
  };
  k_small<<<1, 32>>>(s); k_big<<<1, 32>>>(b); ex_smem(false, 1); drv_smem(false, 1); cudaDeviceSynchronize();
  // A one-node graph of ex_smem(false, 256), launched on the legacy stream as the rows above.
  void* node_args[] = {&b};
  cudaKernelNodeParams np{};
  np.func = reinterpret_cast<void*>(k_smem); np.gridDim = dim3(256); np.blockDim = dim3(128);
  np.sharedMemBytes = kSmem; np.kernelParams = node_args;
  cudaGraph_t graph; cudaGraphNode_t node; cudaGraphExec_t exec;
  cudaGraphCreate(&graph, 0);
  cudaGraphAddKernelNode(&node, graph, nullptr, 0, &np);
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphLaunch(exec, 0); cudaDeviceSynchronize();
  long long call = 0;
  auto graph_set = [&] {
    b.a[1] = ++call;  // new arguments each call, as a layer's tensors
    cudaGraphExecKernelNodeSetParams(exec, node, &np);
    cudaGraphLaunch(exec, 0);
  };
  struct Row { const char* name; double host, after_sync, events; };
  std::vector<Row> rows;
  auto add = [&](const char* n, auto f) { rows.push_back({n, median_host(f, false), median_host(f, true, 500), median_events(f)}); };
  add("<<<>>> 16 B params", [&] { k_small<<<128, 128>>>(s); });
  add("<<<>>> 1 KB params", [&] { k_big<<<128, 128>>>(b); });
  add("cudaLaunchKernelEx 1 KB", [&] { ex_big(false); });
  add("cudaLaunchKernelEx 1 KB + PDL attribute", [&] { ex_big(true); });
  add("cudaLaunchKernelEx 1 KB, 100 KB smem, 256 CTAs, PDL", [&] { ex_smem(true, 256); });
  add("cudaLaunchKernelEx 1 KB, 100 KB smem, 256 CTAs", [&] { ex_smem(false, 256); });
  add("driver: cuLaunchKernelEx, as the row above", [&] { drv_smem(false, 256); });
  add("driver: cuLaunchKernelEx, as the row above, PDL", [&] { drv_smem(true, 256); });
  add("graph of one: cudaGraphLaunch (as the 6th row)", [&] { cudaGraphLaunch(exec, 0); });
  add("graph of one: node params set, then cudaGraphLaunch", graph_set);
  add("two launches, 1 KB, the second PDL (decode + merge)", [&] { ex_big(false); ex_big(true); });
  add("two launches, 16 B", [&] { k_small<<<128, 128>>>(s); k_small<<<128, 128>>>(s); });
  add("cudaGetDevice x5 + cudaGetLastError", [&] { int d; for (int i = 0; i < 5; ++i) cudaGetDevice(&d); cudaGetLastError(); });
  printf("%-55s %12s %18s %14s\n", "launch", "host us", "host after sync", "events us");
  for (auto& r : rows) printf("%-55s %12.2f %18.2f %14.2f\n", r.name, r.host, r.after_sync, r.events);
  printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
}
