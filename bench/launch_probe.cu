// Host time of kernel launches on this machine: empty kernels with 16-byte and 1 KB parameters, <<<>>> and
// cudaLaunchKernelEx (with the programmatic-serialization attribute), one and two launches a call; and the events'
// time around one call after a sync (what a plain-median bench figure pays beyond the kernels).
// Build: nvcc -O2 -arch=sm_90a -o launch_probe bench/launch_probe.cu (on any machine with nvcc; run it on the GPU machine).
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
struct Small { long long a, b; };
struct Big { long long a[128]; };
__global__ void k_small(Small s) { if (s.a == 12345) asm volatile("trap;"); }
__global__ void k_big(Big s) { if (s.a[0] == 12345) asm volatile("trap;"); }
template <class F> double median_host(F&& f, int n = 2000) {
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    if (i % 64 == 0) cudaDeviceSynchronize();
    auto h0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
template <class F> double median_events(F&& f, int n = 500) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    cudaDeviceSynchronize();
    cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms * 1e3);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
int main() {
  Small s{1, 2}; Big b{}; b.a[0] = 1;
  cudaLaunchAttribute attr{}; attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  auto ex_big = [&](bool pdl) {
    cudaLaunchConfig_t c{}; c.gridDim = dim3(128); c.blockDim = dim3(128); c.attrs = &attr; c.numAttrs = pdl ? 1 : 0;
    cudaLaunchKernelEx(&c, k_big, b);
  };
  k_small<<<1, 32>>>(s); k_big<<<1, 32>>>(b); cudaDeviceSynchronize();
  struct Row { const char* name; double host, events; };
  std::vector<Row> rows;
  auto add = [&](const char* n, auto f) { rows.push_back({n, median_host(f), median_events(f)}); };
  add("<<<>>> 16 B params", [&] { k_small<<<128, 128>>>(s); });
  add("<<<>>> 1 KB params", [&] { k_big<<<128, 128>>>(b); });
  add("cudaLaunchKernelEx 1 KB", [&] { ex_big(false); });
  add("cudaLaunchKernelEx 1 KB + PDL attribute", [&] { ex_big(true); });
  add("two launches, 1 KB, the second PDL (decode + merge)", [&] { ex_big(false); ex_big(true); });
  add("two launches, 16 B", [&] { k_small<<<128, 128>>>(s); k_small<<<128, 128>>>(s); });
  add("cudaGetDevice x5 + cudaGetLastError", [&] { int d; for (int i = 0; i < 5; ++i) cudaGetDevice(&d); cudaGetLastError(); });
  printf("%-55s %12s %14s\n", "launch", "host us", "events us");
  for (auto& r : rows) printf("%-55s %12.2f %14.2f\n", r.name, r.host, r.events);
  printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
}
