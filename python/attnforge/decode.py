"""Decode attention: FlashInfer's BatchDecodeWithPagedKVCacheWrapper and single_decode_with_kv_cache."""
from typing import Optional

import numpy as np

from . import _C
from ._arrays import data_dtype_name, device_of, dtype_of, empty, layout_of, outputs, stream_for
from ._errors import invalid
from ._options import attention_options
from ._torch import Tensor, operator
from ._wrapper import PagedWrapper, packed_mask, paged_metadata


class BatchDecodeWithPagedKVCacheWrapper(PagedWrapper):
    """Batch decode on a paged KV cache, FlashInfer's wrapper: plan() once per batch, run() once per layer.

    ``float_workspace_buffer`` (any array with __dlpack__, on the device that runs the batch) holds the plan's
    partial states and, on CUDA, its metadata and page table; plan() raises WorkspaceError naming the sizes when it
    is too small. The ``paged_kv_*_buffer`` arguments are optional even with ``use_cuda_graph=True``: attnforge keeps
    the page table at fixed addresses in the workspace; when given, they receive it instead.
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        if jit_args is not None:
            raise invalid("jit_args: custom variants are not available from Python yet; expected None")
        self._use_tensor_cores = use_tensor_cores
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         {"kv_indptr": paged_kv_indptr_buffer, "kv_indices": paged_kv_indices_buffer,
                          "last_page_len": paged_kv_last_page_len_buffer})

    @property
    def use_tensor_cores(self):
        return self._use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1, stream=None, num_workers=0):
        """Plans the batch. Metadata is read on the host: pass CPU arrays to avoid a device synchronization.

        attnforge additions (keyword-only): ``stream`` (CUDA stream handle for the metadata copies; default: torch's
        or cupy's current stream), ``num_workers`` (0: all CPU threads or SMs).
        """
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_len_per_req = int(q_len_per_req)
        if q_len_per_req < 1:
            raise invalid(f"q_len_per_req: {q_len_per_req}; expected a value >= 1")
        options, slopes = attention_options(causal=q_len_per_req > 1, pos_encoding_mode=pos_encoding_mode,
                                            sm_scale=sm_scale, window_left=window_left,
                                            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                                            rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        kv_format, metadata, kv_lens = paged_metadata(indptr, indices, last_page_len, block_tables, seq_lens, page_size,
                                                      ("indptr", "indices", "last_page_len"))
        batch_size = len(kv_lens)
        metadata["alibi_slopes"] = slopes
        qo_indptr = np.arange(batch_size + 1, dtype=np.int32) * q_len_per_req
        self._plan(kind=_C.PlanKind.decode, kv_format=kv_format, page_size=page_size, num_qo_heads=num_qo_heads,
                   num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim, q_data_type=q_data_type,
                   kv_data_type=kv_data_type, o_data_type=o_data_type, qo_indptr=qo_indptr, metadata=metadata,
                   options=options,
                   fixed_split_tokens=None if fixed_split_size is None else int(fixed_split_size) * int(page_size),
                   disable_split_kv=disable_split_kv, stream=stream, num_workers=num_workers)


@operator("single_attention", mutates_args=("out", "lse"))
def _single_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], decode: bool,
                      kv_layout: str, causal: bool, pos_encoding_mode: str, sm_scale: Optional[float],
                      q_scale: Optional[float], k_scale: Optional[float], v_scale: Optional[float],
                      window_left: Optional[int], logits_soft_cap: Optional[float], rope_scale: Optional[float],
                      rope_theta: Optional[float], custom_mask: Optional[Tensor], packed_custom_mask: Optional[Tensor],
                      sinks: Optional[Tensor], stream: Optional[int]) -> None:
    """single_decode (q [num_qo_heads, head_dim]) or single_prefill (q [qo_len, num_qo_heads, head_dim])."""
    options, slopes = attention_options(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                        window_left=window_left, logits_soft_cap=logits_soft_cap,
                                        rope_scale=rope_scale, rope_theta=rope_theta, num_qo_heads=q.shape[-2])
    if q_scale is not None:
        base = options.sm_scale if options.sm_scale > 0 else 1.0 / float(q.shape[-1]) ** 0.5
        options.sm_scale = base * float(q_scale)
    if slopes is not None and device_of(q)[0] == "cuda":
        raise invalid("pos_encoding_mode: 'ALIBI' for single-request attention on CUDA; pass ALiBi through a batch "
                      "wrapper")
    bits = None
    if custom_mask is not None or packed_custom_mask is not None:
        kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
        bits, _ = packed_mask(custom_mask, packed_custom_mask, np.array([q.shape[0]]), np.array([kv_len]))
    kind = _C.PlanKind.decode if decode else _C.PlanKind.prefill
    workspace = None
    device = device_of(q)
    if device[0] == "cuda":  # the plan and its split states live in device memory, allocated by q's framework
        nhd = kv_layout == "NHD"
        nbytes = _C.single_workspace_bytes(kind, q.shape[-2], k.shape[1] if nhd else k.shape[0], q.shape[-1],
                                           v.shape[-1], dtype_of(q.dtype, "q"), dtype_of(k.dtype, "k"),
                                           dtype_of(out.dtype, "out"), 1 if decode else q.shape[0],
                                           k.shape[0] if nhd else k.shape[1], device[1], causal)
        workspace = empty(q, (nbytes,), "uint8")
    _C.single_attention(kind, q, k, v, layout_of(kv_layout), out, lse, options, slopes, bits, sinks,
                        1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale),
                        stream_for(q, stream), workspace)


def _single(q, k, v, out, lse, return_lse, o_dtype, *args):
    """single-request attention: outputs allocated beside q, then attnforge::single_attention (args: its arguments
    after lse)."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    out, lse = outputs(q, out, lse, out_shape, None if o_dtype is None else data_dtype_name(o_dtype, "o_dtype"),
                       return_lse)
    _single_attention(q, k, v, out, lse, *args)
    return (out, lse) if return_lse else out


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False,
                                q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                                sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False, *, out=None,
                                lse=None, sinks=None, stream=None):
    """Decode attention of one request: q [num_qo_heads, head_dim], k/v [kv_len, num_kv_heads, head_dim] (NHD) or
    [num_kv_heads, kv_len, head_dim] (HND). Returns out [num_qo_heads, head_dim] (and lse [num_qo_heads], log2)."""
    return _single(q, k, v, out, lse, return_lse, None, True, kv_layout, False, pos_encoding_mode, sm_scale, q_scale,
                   k_scale, v_scale, window_left, logits_soft_cap, rope_scale, rope_theta, None, None, sinks, stream)
