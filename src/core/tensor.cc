#include <fmt/format.h>

#include "attnforge/kv_cache.h"
#include "attnforge/plan.h"
#include "attnforge/tensor.h"
#include "core/check.h"

namespace attnforge {

namespace {
void set_shape(TensorView& t, std::initializer_list<int64_t> shape) {
  if (shape.size() > static_cast<size_t>(kMaxDims))
    detail::fail_arg("TensorView: {} dimensions; at most {} are supported", shape.size(), kMaxDims);
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
}
}  // namespace

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  set_shape(*this, shape_);
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_,
                       std::initializer_list<int64_t> strides_, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
  set_shape(*this, shape_);
  if (strides_.size() != shape_.size())
    detail::fail_arg("TensorView: {} strides for {} dimensions", strides_.size(), shape_.size());
  int i = 0;
  for (int64_t s : strides_) strides[i++] = s;
}

int64_t TensorView::numel() const {
  if (ndim == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

std::string to_string(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return fmt::format("dtype({})", static_cast<int>(t));
}

std::string to_string(Device d) {
  switch (d.type) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return fmt::format("cuda:{}", d.id);
  }
  return fmt::format("device({}:{})", static_cast<int>(d.type), d.id);
}

std::string to_string(KVLayout l) { return l == KVLayout::kNHD ? "NHD" : "HND"; }

std::string to_string(KVFormat f) {
  switch (f) {
    case KVFormat::kPagedCSR: return "paged-csr";
    case KVFormat::kBlockTable: return "block-table";
    case KVFormat::kRagged: return "ragged";
  }
  return fmt::format("format({})", static_cast<int>(f));
}

std::string shape_string(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", t.shape[i]);
  return s + "]";
}

std::string strides_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", t.strides[i]);
  return s + ")";
}

PageTable PageTable::csr(TensorView indptr, TensorView indices, TensorView last_page_len) {
  PageTable t;
  t.format = KVFormat::kPagedCSR;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last_page_len;
  return t;
}

PageTable PageTable::blocks(TensorView block_table, TensorView seq_lens) {
  PageTable t;
  t.format = KVFormat::kBlockTable;
  t.block_table = block_table;
  t.seq_lens = seq_lens;
  return t;
}

int64_t PageTable::batch_size() const {
  if (format == KVFormat::kBlockTable) return seq_lens.defined() ? seq_lens.shape[0] : 0;
  return indptr.defined() ? indptr.shape[0] - 1 : 0;
}

void BatchPlanArgs::set_paged(const PageTable& host_table, int32_t page_size_) {
  kv_format = host_table.format;
  page_size = page_size_;
  if (host_table.format == KVFormat::kPagedCSR) {
    kv_indptr = host_table.indptr;
    last_page_len = host_table.last_page_len;
  } else {
    seq_lens = host_table.seq_lens;
  }
}

void BatchPlanArgs::set_ragged(const TensorView& host_kv_indptr) {
  kv_format = KVFormat::kRagged;
  page_size = 1;
  kv_indptr = host_kv_indptr;
}

}  // namespace attnforge
