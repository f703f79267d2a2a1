// attnforge._C: the nanobind module. Thin by design: arrays become TensorViews (arrays.cc), arguments become the
// C++ API's structs, and attnforge::Error becomes the Python exception of its kind (set by attnforge/_errors.py).
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "arrays.h"
#include "attnforge/attnforge.h"
#include "attnforge/context_parallel.h"
#include "attnforge/devices.h"
#include "batch.h"

namespace nb = nanobind;
using namespace attnforge;
using attnforge::python::optional_view;
using attnforge::python::view_of;

namespace {

// Python exception types per ErrorKind; RuntimeError until attnforge/_errors.py installs its classes.
PyObject* g_error_types[5] = {};

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    PyObject* type = g_error_types[static_cast<int>(e.kind())];
    PyErr_SetString(type ? type : PyExc_RuntimeError, e.what());
  }
}

Stream as_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

void single_attention(PlanKind kind, nb::handle q, nb::handle k, nb::handle v, KVLayout layout, nb::handle out,
                      nb::handle lse, const AttentionOptions& base, nb::handle alibi_slopes, nb::handle mask_bits,
                      nb::handle sinks, float k_scale, float v_scale, uintptr_t stream, nb::handle workspace) {
  AttentionOptions options = base;
  options.alibi_slopes = optional_view(alibi_slopes, "alibi_slopes");
  options.sinks = optional_view(sinks, "sinks");
  int32_t mask_indptr[2] = {0, 0};
  if (!mask_bits.is_none()) {
    options.custom_mask.bits = view_of(mask_bits, "packed_custom_mask");
    mask_indptr[1] = static_cast<int32_t>(options.custom_mask.bits.numel());
    options.custom_mask.indptr = TensorView(mask_indptr, DType::kInt32, {2});
  }
  const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  const Outputs outputs{view_of(out, "out"), optional_view(lse, "lse")};
  const TensorView ws = optional_view(workspace, "workspace");
  const Workspace w{ws.defined() ? ws.data : nullptr, ws.defined() ? static_cast<size_t>(ws.numel()) : 0};
  nb::gil_scoped_release release;
  if (kind == PlanKind::kDecode)
    single_decode(qv, kv, vv, layout, outputs, options, k_scale, v_scale, as_stream(stream), w);
  else
    single_prefill(qv, kv, vv, layout, outputs, options, k_scale, v_scale, as_stream(stream), w);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "attnforge C++ library bindings (use the attnforge package, not this module)";
  python::init_arrays();
  nb::register_exception_translator(translate_error);
  m.def("_set_error_types", [](nb::tuple types) {
    if (types.size() != 5) throw nb::value_error("expected 5 exception types, one per attnforge::ErrorKind");
    for (size_t i = 0; i < 5; ++i) {
      nb::object t = types[i];
      g_error_types[i] = t.release().ptr();  // kept for the life of the process
    }
  });

  nb::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("float8_e4m3fn", DType::kFloat8E4M3)
      .value("float8_e5m2", DType::kFloat8E5M2)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("uint8", DType::kUInt8);
  nb::enum_<KVLayout>(m, "KVLayout").value("NHD", KVLayout::kNHD).value("HND", KVLayout::kHND);
  nb::enum_<KVFormat>(m, "KVFormat")
      .value("paged_csr", KVFormat::kPagedCSR)
      .value("block_table", KVFormat::kBlockTable)
      .value("ragged", KVFormat::kRagged);
  nb::enum_<PlanKind>(m, "PlanKind").value("decode", PlanKind::kDecode).value("prefill", PlanKind::kPrefill);

  nb::class_<AttentionShape>(m, "AttentionShape")
      .def(nb::init<>())
      .def_rw("num_qo_heads", &AttentionShape::num_qo_heads)
      .def_rw("num_kv_heads", &AttentionShape::num_kv_heads)
      .def_rw("head_dim_qk", &AttentionShape::head_dim_qk)
      .def_rw("head_dim_vo", &AttentionShape::head_dim_vo)
      .def_rw("q_dtype", &AttentionShape::q_dtype)
      .def_rw("kv_dtype", &AttentionShape::kv_dtype)
      .def_rw("o_dtype", &AttentionShape::o_dtype);
  nb::class_<PlanOptions>(m, "PlanOptions")
      .def(nb::init<>())
      .def_rw("num_workers", &PlanOptions::num_workers)
      .def_rw("deterministic", &PlanOptions::deterministic)
      .def_rw("fixed_split_size", &PlanOptions::fixed_split_size)
      .def_rw("disable_split", &PlanOptions::disable_split)
      .def_rw("causal", &PlanOptions::causal);
  nb::class_<RopeOptions>(m, "RopeOptions")
      .def(nb::init<>())
      .def_rw("enabled", &RopeOptions::enabled)
      .def_rw("rotary_dim", &RopeOptions::rotary_dim)
      .def_rw("interleave", &RopeOptions::interleave)
      .def_rw("theta", &RopeOptions::theta)
      .def_rw("scale", &RopeOptions::scale)
      .def_rw("llama31_factor", &RopeOptions::llama31_factor)
      .def_rw("llama31_low_freq_factor", &RopeOptions::llama31_low_freq_factor)
      .def_rw("llama31_high_freq_factor", &RopeOptions::llama31_high_freq_factor)
      .def_rw("llama31_old_context_len", &RopeOptions::llama31_old_context_len);
  nb::class_<AttentionOptions>(m, "AttentionOptions")
      .def(nb::init<>())
      .def_rw("sm_scale", &AttentionOptions::sm_scale)
      .def_rw("causal", &AttentionOptions::causal)
      .def_rw("window_left", &AttentionOptions::window_left)
      .def_rw("window_right", &AttentionOptions::window_right)
      .def_rw("logits_soft_cap", &AttentionOptions::logits_soft_cap)
      .def_rw("rope", &AttentionOptions::rope);
  nb::class_<python::PlanRequest>(m, "PlanRequest")
      .def(nb::init<>())
      .def_rw("kind", &python::PlanRequest::kind)
      .def_rw("kv_format", &python::PlanRequest::kv_format)
      .def_rw("page_size", &python::PlanRequest::page_size)
      .def_rw("shape", &python::PlanRequest::shape)
      .def_rw("options", &python::PlanRequest::options);

  nb::class_<CustomVariant>(m, "CustomVariant")
      .def(nb::init<>())
      .def("__init__", [](CustomVariant* v, std::string name, std::string source) {
             new (v) CustomVariant{std::move(name), std::move(source)};
           }, nb::arg("name"), nb::arg("source"))
      .def_rw("name", &CustomVariant::name)
      .def_rw("source", &CustomVariant::source)
      .def("__repr__", [](const CustomVariant& v) { return "CustomVariant(" + v.name + ")"; });
  m.def("builtin_variant", &builtin_variant, "The built-in options written as a custom variant (BuiltinVariant)");

  nb::class_<python::BatchAttention>(m, "BatchAttention")
      .def(nb::init<nb::handle, KVLayout>(), nb::arg("float_workspace_buffer"), nb::arg("layout"))
      .def("plan", &python::BatchAttention::plan, nb::arg("request"), nb::arg("qo_indptr").none(),
           nb::arg("metadata"), nb::arg("defaults"), nb::arg("stream"))
      .def(
          "run",
          [](python::BatchAttention& self, nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
             nb::handle lse, uintptr_t stream, std::optional<float> sm_scale, std::optional<int32_t> window_left,
             std::optional<float> logits_soft_cap, std::optional<float> q_scale, std::optional<float> k_scale,
             std::optional<float> v_scale, nb::handle sinks, std::optional<bool> enable_pdl) {
            self.run(q, kv_a, kv_b, out, lse, stream,
                     {sm_scale, logits_soft_cap, q_scale, k_scale, v_scale, window_left, sinks, enable_pdl});
          },
          nb::arg("q"), nb::arg("kv_a"), nb::arg("kv_b").none(), nb::arg("out"), nb::arg("lse").none(),
          nb::arg("stream"), nb::arg("sm_scale").none(), nb::arg("window_left").none(),
          nb::arg("logits_soft_cap").none(), nb::arg("q_scale").none(), nb::arg("k_scale").none(),
          nb::arg("v_scale").none(), nb::arg("sinks").none(), nb::arg("enable_pdl").none() = nb::none())
      .def(
          "run_variant",
          [](python::BatchAttention& self, nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
             nb::handle lse, uintptr_t stream, std::optional<float> sm_scale, std::optional<float> k_scale,
             std::optional<float> v_scale, const CustomVariant& variant, const std::vector<float>& scalars,
             const std::vector<nb::handle>& tensors) {
            self.run_variant(q, kv_a, kv_b, out, lse, stream, {sm_scale, {}, {}, k_scale, v_scale, {}, nb::none()},
                             variant, scalars, tensors);
          },
          nb::arg("q"), nb::arg("kv_a"), nb::arg("kv_b").none(), nb::arg("out"), nb::arg("lse").none(),
          nb::arg("stream"), nb::arg("sm_scale").none(), nb::arg("k_scale").none(), nb::arg("v_scale").none(), nb::arg("variant"),
          nb::arg("scalars"), nb::arg("tensors"))
      .def("check_context_parallel", &python::BatchAttention::check_context_parallel, nb::arg("partition"))
      .def(
          "run_context_parallel",
          [](python::BatchAttention& self, nb::handle q, nb::handle kv_a, nb::handle kv_b, nb::handle out,
             nb::handle lse, uintptr_t stream, std::optional<float> sm_scale, std::optional<int32_t> window_left,
             std::optional<float> logits_soft_cap, std::optional<float> q_scale, std::optional<float> k_scale,
             std::optional<float> v_scale, nb::handle sinks, std::optional<bool> enable_pdl,
             const RankStateLayout& layout, KVPartition partition, nb::handle gathered, int32_t rank,
             int32_t world_size, uintptr_t communicator) {
            self.run_context_parallel(
                q, kv_a, kv_b, out, lse, stream,
                {sm_scale, logits_soft_cap, q_scale, k_scale, v_scale, window_left, sinks, enable_pdl}, layout,
                partition, gathered, rank, world_size, communicator);
          },
          nb::arg("q"), nb::arg("kv_a"), nb::arg("kv_b").none(), nb::arg("out").none(), nb::arg("lse").none(),
          nb::arg("stream"), nb::arg("sm_scale").none(), nb::arg("window_left").none(),
          nb::arg("logits_soft_cap").none(), nb::arg("q_scale").none(), nb::arg("k_scale").none(),
          nb::arg("v_scale").none(), nb::arg("sinks").none(), nb::arg("enable_pdl").none(), nb::arg("layout"),
          nb::arg("partition"), nb::arg("gathered"), nb::arg("rank"), nb::arg("world_size"), nb::arg("communicator"))
      .def("time_cpp_run", &python::BatchAttention::time_repeated_run, nb::arg("q"), nb::arg("kv_a"),
           nb::arg("kv_b").none(), nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"), nb::arg("iterations"))
      .def_prop_ro("workspace_bytes", &python::BatchAttention::workspace_bytes)
      .def_prop_ro("used_workspace_bytes", &python::BatchAttention::used_workspace_bytes)
      .def_prop_ro("plan_workspace_bytes", [](const python::BatchAttention& self) { return self.attention_plan().workspace_bytes; })
      .def_prop_ro("total_qo", [](const python::BatchAttention& self) { return self.attention_plan().total_qo; })
      .def_prop_ro("batch_size", [](const python::BatchAttention& self) { return self.attention_plan().batch_size; })
      .def("describe", [](const python::BatchAttention& self) { return self.attention_plan().describe(); });

  m.def("single_attention", &single_attention, nb::arg("kind"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("layout"), nb::arg("out"), nb::arg("lse").none(), nb::arg("options"), nb::arg("alibi_slopes").none(),
        nb::arg("packed_custom_mask").none(), nb::arg("sinks").none(), nb::arg("k_scale"), nb::arg("v_scale"),
        nb::arg("stream"), nb::arg("workspace").none() = nb::none());
  m.def(
      "single_workspace_bytes",
      [](PlanKind kind, int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim_qk, int32_t head_dim_vo,
         DType q_dtype, DType kv_dtype, DType o_dtype, int32_t qo_len, int32_t kv_len, int32_t device, bool causal) {
        const AttentionShape shape{num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q_dtype, kv_dtype, o_dtype};
        return single_workspace_bytes(kind, shape, qo_len, kv_len, Device::cuda(device), causal);
      },
      "Device memory (bytes) single_decode / single_prefill need on CUDA device `device`");
  m.def(
      "merge_state",
      [](nb::handle v_a, nb::handle s_a, nb::handle v_b, nb::handle s_b, nb::handle out, nb::handle lse,
         uintptr_t stream) {
        const TensorView va = view_of(v_a, "v_a"), sa = view_of(s_a, "s_a"), vb = view_of(v_b, "v_b"),
                         sb = view_of(s_b, "s_b");
        const Outputs o{view_of(out, "out"), optional_view(lse, "lse")};
        nb::gil_scoped_release release;
        merge_state(va, sa, vb, sb, o, as_stream(stream));
      },
      nb::arg("v_a"), nb::arg("s_a"), nb::arg("v_b"), nb::arg("s_b"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("stream"));
  m.def(
      "merge_states",
      [](nb::handle v, nb::handle s, nb::handle out, nb::handle lse, uintptr_t stream) {
        const TensorView vv = view_of(v, "v"), sv = view_of(s, "s");
        const Outputs o{view_of(out, "out"), optional_view(lse, "lse")};
        nb::gil_scoped_release release;
        merge_states(vv, sv, o, as_stream(stream));
      },
      nb::arg("v"), nb::arg("s"), nb::arg("out"), nb::arg("lse").none(), nb::arg("stream"));
  m.def(
      "append_paged_kv_cache",
      [](nb::handle append_key, nb::handle append_value, nb::handle batch_indices, nb::handle positions,
         nb::handle k_cache, nb::handle v_cache, KVLayout layout, nb::handle kv_indices, nb::handle kv_indptr,
         nb::handle kv_last_page_len, uintptr_t stream) {
        PagedKVCache cache;
        cache.k = view_of(k_cache, "paged_kv_cache[0]");
        cache.v = view_of(v_cache, "paged_kv_cache[1]");
        cache.layout = layout;
        cache.table = PageTable::csr(view_of(kv_indptr, "kv_indptr"), view_of(kv_indices, "kv_indices"),
                                     view_of(kv_last_page_len, "kv_last_page_len"));
        const TensorView ak = view_of(append_key, "append_key"), av = view_of(append_value, "append_value"),
                         bi = view_of(batch_indices, "batch_indices"), pos = view_of(positions, "positions");
        nb::gil_scoped_release release;
        append_paged_kv_cache(ak, av, bi, pos, cache, as_stream(stream));
      },
      nb::arg("append_key"), nb::arg("append_value"), nb::arg("batch_indices"), nb::arg("positions"),
      nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("layout"), nb::arg("kv_indices"), nb::arg("kv_indptr"),
      nb::arg("kv_last_page_len"), nb::arg("stream"));
  m.def(
      "apply_rope",
      [](nb::handle q, nb::handle k, nb::handle q_out, nb::handle k_out, nb::handle indptr, nb::handle offsets,
         nb::handle pos_ids, const RopeOptions& rope, uintptr_t stream) {
        const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), qo = view_of(q_out, "q_rope"),
                         ko = view_of(k_out, "k_rope");
        if (!pos_ids.is_none()) {
          const TensorView pv = view_of(pos_ids, "pos_ids");
          nb::gil_scoped_release release;
          apply_rope_pos_ids(qv, kv, qo, ko, pv, rope, as_stream(stream));
          return;
        }
        const TensorView iv = view_of(indptr, "indptr"), ov = view_of(offsets, "offsets");
        nb::gil_scoped_release release;
        apply_rope(qv, kv, qo, ko, iv, ov, rope, as_stream(stream));
      },
      nb::arg("q"), nb::arg("k"), nb::arg("q_rope"), nb::arg("k_rope"), nb::arg("indptr").none(),
      nb::arg("offsets").none(), nb::arg("pos_ids").none(), nb::arg("rope"), nb::arg("stream"));

  // Context parallelism (attnforge/context_parallel.h).
  nb::enum_<KVPartition>(m, "KVPartition")
      .value("contiguous", KVPartition::kContiguous)
      .value("round_robin_pages", KVPartition::kRoundRobinPages);
  nb::class_<RankStateLayout>(m, "RankStateLayout")
      .def(nb::init<>())
      .def("__init__", [](RankStateLayout* l, int64_t n, int32_t num_heads, int32_t head_dim, DType o_dtype) {
             new (l) RankStateLayout{n, num_heads, head_dim, o_dtype};
           }, nb::arg("n"), nb::arg("num_heads"), nb::arg("head_dim"), nb::arg("o_dtype") = DType::kFloat32)
      .def_rw("n", &RankStateLayout::n)
      .def_rw("num_heads", &RankStateLayout::num_heads)
      .def_rw("head_dim", &RankStateLayout::head_dim)
      .def_rw("o_dtype", &RankStateLayout::o_dtype)
      .def_prop_ro("lse_offset", &RankStateLayout::lse_offset)
      .def_prop_ro("rank_bytes", &RankStateLayout::rank_bytes)
      .def("__repr__", [](const RankStateLayout& l) {
        return fmt::format("RankStateLayout(n={}, num_heads={}, head_dim={}, o_dtype={}, rank_bytes={})", l.n,
                           l.num_heads, l.head_dim, to_string(l.o_dtype), l.rank_bytes());
      });
  m.def(
      "check_context_parallel_options",
      [](const AttentionOptions& base, nb::handle alibi_slopes, nb::handle mask_bits, KVPartition partition) {
        AttentionOptions options = base;
        options.alibi_slopes = optional_view(alibi_slopes, "alibi_slopes");
        options.custom_mask.bits = optional_view(mask_bits, "custom_mask");
        check_context_parallel_options(options, partition);
      },
      nb::arg("options"), nb::arg("alibi_slopes").none(), nb::arg("mask").none(), nb::arg("partition"));
  m.def(
      "partition_pages",
      [](nb::handle indptr, nb::handle indices, nb::handle last_page_len, nb::handle block_table,
         nb::handle seq_lens, int32_t page_size, int32_t world_size, int32_t rank, KVPartition partition) {
        const PageTable table =
            block_table.is_none()
                ? PageTable::csr(view_of(indptr, "indptr"), view_of(indices, "indices"),
                                 view_of(last_page_len, "last_page_len"))
                : PageTable::blocks(view_of(block_table, "block_table"), view_of(seq_lens, "seq_lens"));
        RankPageTable share = partition_pages(table, page_size, world_size, rank, partition);
        return nb::make_tuple(std::move(share.indptr), std::move(share.indices), std::move(share.last_page_len),
                              std::move(share.kv_len));
      },
      nb::arg("indptr").none(), nb::arg("indices").none(), nb::arg("last_page_len").none(),
      nb::arg("block_table").none(), nb::arg("seq_lens").none(), nb::arg("page_size"), nb::arg("world_size"),
      nb::arg("rank"), nb::arg("partition"));
  m.def(
      "merge_gathered_states",
      [](const RankStateLayout& layout, nb::handle buffer, int32_t world_size, nb::handle out, nb::handle lse,
         uintptr_t stream) {
        Device device;
        const void* states = python::gathered_states(buffer, layout, world_size, &device);
        const Outputs o{view_of(out, "out"), optional_view(lse, "lse")};
        nb::gil_scoped_release release;
        merge_gathered_states(layout, states, world_size, o, device, as_stream(stream));
      },
      nb::arg("layout"), nb::arg("buffer"), nb::arg("world_size"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("stream"));
  m.def("nccl_unique_id", [] {
    const std::string id = nccl_unique_id();
    return nb::bytes(id.data(), id.size());
  });
  m.def(
      "nccl_comm_init_rank",
      [](int32_t world_size, int32_t rank, nb::bytes unique_id, int32_t device) {
        const std::string id(unique_id.c_str(), unique_id.size());
        nb::gil_scoped_release release;  // blocks until every rank has joined
        return reinterpret_cast<uintptr_t>(nccl_comm_init_rank(world_size, rank, id, device));
      },
      nb::arg("world_size"), nb::arg("rank"), nb::arg("unique_id"), nb::arg("device"));
  m.def("nccl_comm_destroy", [](uintptr_t comm) { nccl_comm_destroy(reinterpret_cast<void*>(comm)); },
        nb::arg("communicator"));
  m.def(
      "nccl_comm_info",
      [](uintptr_t comm) {
        const NcclCommInfo info = nccl_comm_info(reinterpret_cast<void*>(comm));
        return std::make_tuple(info.world_size, info.rank, info.cuda_device);
      },
      nb::arg("communicator"));

  m.def("version", &version);
  m.def("build_info", &build_info);
  m.def("torch_reader_status", &python::torch_reader_status,
        "How torch tensors are read: from their C++ objects (attnforge._torch_reader) or their attributes, and why");
  m.def("cuda_available", [] {
    for (const DeviceInfo& d : available_devices())
      if (d.device.type == DeviceType::kCUDA && d.attention) return true;
    return false;
  });
}
