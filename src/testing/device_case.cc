#include "testing/device_case.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace attnforge::testing {

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

DeviceCase::DeviceCase(const Case& host, int device) : host_(&host), device_(device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  for (const Buffer* b : {&host.q, &host.kv, &host.out, &host.lse, &host.page_ids, &host.indptr, &host.last_page_len,
                          &host.block_table, &host.seq_lens, &host.mask_buf, &host.mask_indptr_buf, &host.alibi_buf,
                          &host.sinks_buf, &host.pos_offset_buf}) {
    if (!b->storage) continue;
    Mirror m{static_cast<const uint8_t*>(b->data()), std::max<size_t>(1, b->bytes()), nullptr};
    check(cudaMalloc(&m.device, m.bytes), "cudaMalloc");
    check(cudaMemcpy(m.device, m.host, m.bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    mirrors_.push_back(m);
  }
  q = to_device(host.q_view);
  out = to_device(host.out_view);
  lse = to_device(host.lse_view);
  paged = host.paged;
  paged.k = to_device(host.paged.k);
  paged.v = to_device(host.paged.v);
  for (TensorView* t : {&paged.table.indptr, &paged.table.indices, &paged.table.last_page_len,
                        &paged.table.block_table, &paged.table.seq_lens})
    *t = to_device(*t);
  ragged = host.ragged;
  ragged.k = to_device(host.ragged.k);
  ragged.v = to_device(host.ragged.v);
  ragged.indptr = to_device(host.ragged.indptr);
  options = host.options;
  options.alibi_slopes = to_device(options.alibi_slopes);
  options.sinks = to_device(options.sinks);
  options.custom_mask.bits = to_device(options.custom_mask.bits);
  options.custom_mask.indptr = to_device(options.custom_mask.indptr);
  options.rope.pos_offset = to_device(options.rope.pos_offset);
}

DeviceCase::~DeviceCase() {
  for (const Mirror& m : mirrors_) cudaFree(m.device);
}

const DeviceCase::Mirror* DeviceCase::find(const void* host_ptr) const {
  const auto* p = static_cast<const uint8_t*>(host_ptr);
  for (const Mirror& m : mirrors_)
    if (p >= m.host && p < m.host + m.bytes) return &m;
  return nullptr;
}

TensorView DeviceCase::to_device(const TensorView& v) const {
  if (!v.defined()) return v;
  const Mirror* m = find(v.data);
  if (!m) throw std::runtime_error("DeviceCase: a view does not point into the case's buffers");
  TensorView d = v;
  d.data = m->device + (static_cast<const uint8_t*>(v.data) - m->host);
  d.device = Device::cuda(device_);
  return d;
}

void DeviceCase::upload(const Buffer& b) const {
  const Mirror* m = find(b.data());
  check(cudaMemcpy(m->device, m->host, m->bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

void DeviceCase::upload_outputs(const Case& host) const {
  upload(host.out);
  upload(host.lse);
}

void DeviceCase::download_outputs(Case& host) const {
  for (const Buffer* b : {&host.out, &host.lse}) {
    const Mirror* m = find(b->data());
    check(cudaMemcpy(const_cast<uint8_t*>(m->host), m->device, m->bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
}

AttentionPlan plan_and_run_cuda(Case& host, const DeviceCase& dev) {
  BatchPlanArgs args = host.plan_args();
  args.device = dev.q.device;
  AttentionPlan plan = host.spec.kind == PlanKind::kDecode ? plan_batch_decode(args) : plan_batch_prefill(args);
  void* ws = nullptr;
  void* staging = nullptr;
  check(cudaMalloc(&ws, std::max<size_t>(256, plan.workspace_bytes)), "cudaMalloc workspace");
  check(cudaMallocHost(&staging, std::max<size_t>(1, plan.staging_bytes)), "cudaMallocHost staging");
  struct Free {
    void* ws;
    void* staging;
    ~Free() {
      cudaFree(ws);
      cudaFreeHost(staging);
    }
  } free_at_exit{ws, staging};
  const Workspace w{ws, plan.workspace_bytes};
  upload_plan(plan, w, staging, plan.staging_bytes, nullptr);
  const Outputs outs{dev.out, dev.lse};
  if (host.spec.format == KVFormat::kRagged)
    run(plan, dev.q, dev.ragged, outs, dev.options, w, nullptr);
  else
    run(plan, dev.q, dev.paged, outs, dev.options, w, nullptr);
  check(cudaDeviceSynchronize(), "kernel execution");
  dev.download_outputs(host);
  return plan;
}

}  // namespace attnforge::testing
