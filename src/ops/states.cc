// merge_state and merge_states: validation and launch.
#include "attnforge/ops.h"
#include "backends/backend.h"
#include "core/check.h"

namespace attnforge {

namespace {

using namespace detail;

const auto kValueTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

StateView state_view(const TensorView& v, const TensorView& s, int v_axis_head, int s_axis_head) {
  StateView r{};
  r.v = v.data;
  r.v_dtype = v.dtype;
  r.v_stride_n = v.strides[0];
  r.v_stride_head = v.strides[v_axis_head];
  r.s = s.ptr<const float>();
  r.s_stride_n = s.strides[0];
  r.s_stride_head = s.strides[s_axis_head];
  return r;
}

void set_outputs(MergeStatesParams& p, const Outputs& o, int64_t n, int32_t heads, int32_t dim, Device dev) {
  expect_defined(o.out, "out");
  expect_device(o.out, "out", dev);
  expect_dtype(o.out, "out", kValueTypes);
  expect_ndim(o.out, "out", 3, "[n, num_heads, head_dim]");
  expect_dim(o.out, "out", 0, n, "n");
  expect_dim(o.out, "out", 1, heads, "num_heads");
  expect_dim(o.out, "out", 2, dim, "head_dim");
  expect_last_dim_contiguous(o.out, "out");
  p.o = o.out.data;
  p.o_dtype = o.out.dtype;
  p.o_stride_n = o.out.strides[0];
  p.o_stride_head = o.out.strides[1];
  if (o.lse.defined()) {
    expect_device(o.lse, "lse", dev);
    expect_dtype(o.lse, "lse", {DType::kFloat32});
    expect_ndim(o.lse, "lse", 2, "[n, num_heads]");
    expect_dim(o.lse, "lse", 0, n, "n");
    expect_dim(o.lse, "lse", 1, heads, "num_heads");
    p.lse = o.lse.ptr<float>();
    p.lse_stride_n = o.lse.strides[0];
    p.lse_stride_head = o.lse.strides[1];
  }
  p.n = n;
  p.num_heads = heads;
  p.head_dim = dim;
}

}  // namespace

void merge_state(const TensorView& v_a, const TensorView& s_a, const TensorView& v_b, const TensorView& s_b,
                 const Outputs& outputs, Stream stream) {
  expect_defined(v_a, "v_a");
  const Device dev = v_a.device;
  expect_ndim(v_a, "v_a", 3, "[n, num_heads, head_dim]");
  const int64_t n = v_a.shape[0];
  const int32_t heads = static_cast<int32_t>(v_a.shape[1]), dim = static_cast<int32_t>(v_a.shape[2]);
  for (auto [v, s, vn, sn] : {std::tuple{&v_a, &s_a, "v_a", "s_a"}, std::tuple{&v_b, &s_b, "v_b", "s_b"}}) {
    expect_defined(*v, vn);
    expect_device(*v, vn, dev);
    expect_dtype(*v, vn, kValueTypes);
    expect_ndim(*v, vn, 3, "[n, num_heads, head_dim]");
    expect_dim(*v, vn, 0, n, "n of v_a");
    expect_dim(*v, vn, 1, heads, "num_heads of v_a");
    expect_dim(*v, vn, 2, dim, "head_dim of v_a");
    expect_last_dim_contiguous(*v, vn);
    expect_defined(*s, sn);
    expect_device(*s, sn, dev);
    expect_dtype(*s, sn, {DType::kFloat32});
    expect_ndim(*s, sn, 2, "[n, num_heads]");
    expect_dim(*s, sn, 0, n, "n of v_a");
    expect_dim(*s, sn, 1, heads, "num_heads of v_a");
  }
  MergeStatesParams p{};
  set_outputs(p, outputs, n, heads, dim, dev);
  p.num_sources = 2;
  p.num_states = 2;
  p.sources[0] = state_view(v_a, s_a, 1, 1);
  p.sources[1] = state_view(v_b, s_b, 1, 1);
  backend_for(dev).merge_states(p, stream);
}

void merge_states(const TensorView& v, const TensorView& s, const Outputs& outputs, Stream stream) {
  expect_defined(v, "v");
  const Device dev = v.device;
  expect_dtype(v, "v", kValueTypes);
  expect_ndim(v, "v", 4, "[n, num_states, num_heads, head_dim]");
  expect_last_dim_contiguous(v, "v");
  expect_defined(s, "s");
  expect_device(s, "s", dev);
  expect_dtype(s, "s", {DType::kFloat32});
  expect_ndim(s, "s", 3, "[n, num_states, num_heads]");
  expect_dim(s, "s", 0, v.shape[0], "n of v");
  expect_dim(s, "s", 1, v.shape[1], "num_states of v");
  expect_dim(s, "s", 2, v.shape[2], "num_heads of v");
  MergeStatesParams p{};
  set_outputs(p, outputs, v.shape[0], static_cast<int32_t>(v.shape[2]), static_cast<int32_t>(v.shape[3]), dev);
  p.num_sources = 0;
  p.num_states = static_cast<int32_t>(v.shape[1]);
  p.stacked = state_view(v, s, 2, 2);
  p.v_stride_state = v.strides[1];
  p.s_stride_state = s.strides[1];
  backend_for(dev).merge_states(p, stream);
}

}  // namespace attnforge
