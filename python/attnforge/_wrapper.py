"""What the three batch wrappers share: the workspace, plan() into the C++ BatchAttention, and run()."""
from typing import Optional

import numpy as np

from . import _C, _torch
from ._arrays import current_stream, device_of, dtype_name, dtype_of, host_array, layout_of, outputs
from ._errors import invalid
from ._torch import Tensor

_PLACEMENT_ORDER = ("kv_indptr", "last_page_len", "seq_lens", "alibi_slopes", "mask_indptr", "kv_indices",
                    "block_table", "mask")


def kv_lengths_paged(indptr, last_page_len, page_size):
    pages = np.diff(indptr)
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0).astype(np.int32)


def paged_metadata(indptr, indices, last_page_len, block_tables, seq_lens, page_size, names):
    """(KVFormat, metadata arrays on the host, KV lengths) of a paged cache given as FlashInfer's CSR arrays, or as
    block_tables with seq_lens. `names` names the three CSR arguments in errors."""
    if block_tables is not None:
        if seq_lens is None:
            raise invalid("seq_lens: None with block_tables given; expected int32 [batch_size] KV lengths")
        metadata = {"block_table": host_array(block_tables, np.int32, "block_tables"),
                    "seq_lens": host_array(seq_lens, np.int32, "seq_lens")}
        return _C.KVFormat.block_table, metadata, metadata["seq_lens"]
    metadata = {"kv_indptr": host_array(indptr, np.int32, names[0]),
                "kv_indices": host_array(indices, np.int32, names[1]),
                "last_page_len": host_array(last_page_len, np.int32, names[2])}
    return (_C.KVFormat.paged_csr, metadata,
            kv_lengths_paged(metadata["kv_indptr"], metadata["last_page_len"], int(page_size)))


def packed_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens):
    """(bits uint8, byte indptr int32) for FlashInfer's custom_mask (booleans of every request's [qo_len, kv_len]
    mask, concatenated) or packed_custom_mask (the same, bit-packed per request, little bit order)."""
    if custom_mask is None and packed_custom_mask is None:
        return None, None
    sizes = qo_lens.astype(np.int64) * kv_lens
    byte_indptr = np.zeros(len(sizes) + 1, dtype=np.int32)
    byte_indptr[1:] = np.cumsum((sizes + 7) // 8)
    if packed_custom_mask is not None:
        return host_array(packed_custom_mask, np.uint8, "packed_custom_mask"), byte_indptr
    flat = host_array(custom_mask, np.bool_, "custom_mask").reshape(-1)
    if flat.size != sizes.sum():
        raise invalid(f"custom_mask: {flat.size} elements; the batch's [qo_len, kv_len] masks hold {int(sizes.sum())}")
    bits = np.zeros(int(byte_indptr[-1]), dtype=np.uint8)
    start = 0
    for b, n in enumerate(sizes):
        packed = np.packbits(flat[start:start + n], bitorder="little")
        bits[byte_indptr[b]:byte_indptr[b] + packed.size] = packed
        start += n
    return bits, byte_indptr


class BatchWrapper:
    def __init__(self, float_workspace_buffer, kv_layout, use_cuda_graph, buffers):
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_layout = kv_layout
        self._impl = _C.BatchAttention(float_workspace_buffer, layout_of(kv_layout))
        kind, self._device_index = device_of(float_workspace_buffer)
        self._on_cuda = kind == "cuda"
        self._use_cuda_graph = bool(use_cuda_graph)
        self._buffers = {name: b for name, b in buffers.items() if b is not None}
        self._fixed_batch_size = None
        self._handle = _torch.register_wrapper(self)
        self._planned = False

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Replaces the workspace (plan() again before run()). attnforge has no int workspace: that argument is
        accepted and unused."""
        BatchWrapper.__init__(self, float_workspace_buffer, self._kv_layout, self._use_cuda_graph, self._buffers)

    def _plan(self, *, kind, kv_format, page_size, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
              q_data_type, kv_data_type, o_data_type, qo_indptr, metadata, options, fixed_split_tokens,
              disable_split_kv, stream, num_workers=0, deterministic=False):
        request = _C.PlanRequest()
        request.kind = kind
        request.kv_format = kv_format
        request.page_size = int(page_size)
        shape = _C.AttentionShape()
        shape.num_qo_heads = int(num_qo_heads)
        shape.num_kv_heads = int(num_kv_heads)
        shape.head_dim_qk = int(head_dim_qk)
        shape.head_dim_vo = int(head_dim_qk if head_dim_vo is None else head_dim_vo)
        shape.q_dtype = dtype_of(q_data_type, "q_data_type")
        shape.kv_dtype = shape.q_dtype if kv_data_type is None else dtype_of(kv_data_type, "kv_data_type")
        shape.o_dtype = shape.q_dtype if o_data_type is None else dtype_of(o_data_type, "o_data_type")
        request.shape = shape
        plan_options = _C.PlanOptions()
        plan_options.causal = options.causal
        plan_options.num_workers = int(num_workers)
        plan_options.disable_split = bool(disable_split_kv)
        if fixed_split_tokens is not None:
            plan_options.deterministic = True
            plan_options.fixed_split_size = int(fixed_split_tokens)
        plan_options.deterministic = plan_options.deterministic or bool(deterministic)
        request.options = plan_options

        batch_size = len(metadata["kv_indptr"]) - 1 if metadata.get("kv_indptr") is not None \
            else len(metadata["seq_lens"])
        if self._use_cuda_graph:
            if self._fixed_batch_size is None:
                self._fixed_batch_size = batch_size
            elif batch_size != self._fixed_batch_size:
                raise invalid(f"batch size: {batch_size}; this wrapper runs in CUDA-graph mode and was planned for "
                              f"{self._fixed_batch_size} (use one wrapper per batch size)")
        # Arrays of a fixed size for a batch size first, so that their device addresses, which a captured CUDA graph
        # holds, stay put when a re-plan has more pages (the variable-size arrays come last).
        items = [(name, metadata[name], self._buffers.get(name)) for name in _PLACEMENT_ORDER
                 if metadata.get(name) is not None]
        if stream is None:
            stream = current_stream(self._float_workspace_buffer, self._device_index) if self._on_cuda else 0
        _torch.ensure_registered()
        self._planned = False
        self._impl.plan(request, qo_indptr, items, options, stream)
        self._metadata = items  # host arrays stay alive: on the CPU, run() reads them in place
        self._qo_indptr_host = qo_indptr
        self._num_qo_heads = shape.num_qo_heads
        self._head_dim_vo = shape.head_dim_vo
        self._cached_q_data_type = shape.q_dtype
        self._cached_kv_data_type = shape.kv_dtype
        self._o_dtype_name = dtype_name(shape.o_dtype)
        self._planned = True

    def _run(self, q, kv_a, kv_b, out, lse, return_lse, stream, sm_scale, window_left, logits_soft_cap, q_scale,
             k_scale, v_scale, sinks, enable_pdl=None):
        if out is None or (lse is None and return_lse):  # the shape tuple costs time on the hot path (out= given)
            out, lse = outputs(q, out, lse, (q.shape[0], self._num_qo_heads, self._head_dim_vo), self._o_dtype_name,
                               return_lse)
        if _torch.tracing():
            _batch_run(self._handle, q, kv_a, kv_b, out, lse, stream, sm_scale, window_left, logits_soft_cap, q_scale,
                       k_scale, v_scale, sinks, enable_pdl)
        else:
            self._run_now(q, kv_a, kv_b, out, lse, stream, sm_scale, window_left, logits_soft_cap, q_scale, k_scale,
                          v_scale, sinks, enable_pdl)
        return (out, lse) if return_lse else out

    def _run_now(self, q, kv_a, kv_b, out, lse, stream, sm_scale, window_left, logits_soft_cap, q_scale, k_scale,
                 v_scale, sinks, enable_pdl=None):
        if stream is None:
            stream = current_stream(q, self._device_index) if self._on_cuda else 0
        self._impl.run(q, kv_a, kv_b, out, lse, stream, sm_scale, window_left, logits_soft_cap, q_scale, k_scale,
                       v_scale, sinks, enable_pdl)

    def _run_variant(self, q, kv_a, kv_b, out, lse, return_lse, stream, sm_scale, k_scale, v_scale, variant, scalars,
                     tensors):
        if _torch.tracing():
            raise NotImplementedError("run(variant=...): custom variants are not registered as torch custom ops")
        out, lse = outputs(q, out, lse, (q.shape[0], self._num_qo_heads, self._head_dim_vo), self._o_dtype_name,
                           return_lse)
        if stream is None:
            stream = current_stream(q, self._device_index) if self._on_cuda else 0
        self._impl.run_variant(q, kv_a, kv_b, out, lse, stream, sm_scale, k_scale, v_scale, variant,
                               [float(x) for x in scalars], list(tensors))
        return (out, lse) if return_lse else out

    # attnforge additions (not in FlashInfer)
    @property
    def workspace_bytes_needed(self):
        """Bytes of float_workspace_buffer the current plan uses (plan, partial states and device metadata)."""
        return self._impl.used_workspace_bytes

    def describe_plan(self):
        """The C++ AttentionPlan::describe() of the current plan."""
        return self._impl.describe()


# Only while torch.compile traces: eager run() calls _run_now directly (the dispatcher costs microseconds).
@_torch.operator("batch_run", mutates_args=("out", "lse"))
def _batch_run(handle: int, q: Tensor, kv_a: Tensor, kv_b: Optional[Tensor], out: Tensor, lse: Optional[Tensor],
               stream: Optional[int], sm_scale: Optional[float], window_left: Optional[int],
               logits_soft_cap: Optional[float], q_scale: Optional[float], k_scale: Optional[float],
               v_scale: Optional[float], sinks: Optional[Tensor], enable_pdl: Optional[bool]) -> None:
    _torch.wrapper(handle)._run_now(q, kv_a, kv_b, out, lse, stream, sm_scale, window_left, logits_soft_cap, q_scale,
                                    k_scale, v_scale, sinks, enable_pdl)


def no_custom_args(args, where):
    if args:
        raise TypeError(f"{where}: {len(args)} extra positional arguments; attnforge has no JIT variant arguments "
                        "(FlashInfer's *args of custom kernels)")


class PagedWrapper(BatchWrapper):
    """run() of the two paged-cache wrappers (decode and prefill)."""

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, sm_scale=None, logits_soft_cap=None,
            stream=None, variant=None, variant_scalars=(), variant_tensors=()):
        """Attention of q [total_qo, num_qo_heads, head_dim_qk] (decode: batch_size * q_len_per_req rows) over the
        paged cache.

        ``paged_kv_cache``: a (k_cache, v_cache) pair of [num_pages, page_size, num_kv_heads, head_dim] (NHD) or
        [num_pages, num_kv_heads, page_size, head_dim] (HND) arrays, or one [num_pages, 2, ...] array. Returns out
        [total_qo, num_qo_heads, head_dim_vo] (and lse [total_qo, num_qo_heads], log2 units, when return_lse).
        attnforge additions (keyword-only): ``sm_scale`` and ``logits_soft_cap`` override the plan's for this call;
        ``window_left`` may differ from the plan's; ``stream`` overrides the framework's current stream.
        ``enable_pdl``: None or True launches the CUDA decode kernel as a programmatic dependent of the kernel before
        it on sm_90+ (AttentionOptions::programmatic_launch), False launches it plainly; ignored elsewhere.
        ``variant``: an ``attnforge.CustomVariant`` (C++ hooks compiled at run time and cached, see
        attnforge/variant.h) run instead of the built-in options, with ``variant_scalars`` (up to 8 floats) and
        ``variant_tensors`` (up to 4 arrays whose data pointers the hooks receive). CPU plans made with
        ``disable_split_kv=True``; without softmax the LSE is NaN. On CUDA the variant runs on the stream a plain
        run() would (decode and prefill plans, K/V in q's dtype).
        """
        if args:
            no_custom_args(args, "run")
        if type(paged_kv_cache) is tuple:
            kv_a, kv_b = paged_kv_cache
        else:
            kv_a, kv_b = paged_kv_cache, None
        if variant is not None:
            return self._run_variant(q, kv_a, kv_b, out, lse, return_lse, stream, sm_scale, k_scale, v_scale, variant,
                                     variant_scalars, variant_tensors)
        return self._run(q, kv_a, kv_b, out, lse, return_lse, stream, sm_scale, window_left, logits_soft_cap, q_scale,
                         k_scale, v_scale, sinks, enable_pdl)

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)
