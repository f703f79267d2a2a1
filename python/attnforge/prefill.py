"""Prefill (and append) attention: FlashInfer's BatchPrefillWithPagedKVCacheWrapper,
BatchPrefillWithRaggedKVCacheWrapper and single_prefill_with_kv_cache."""
import numpy as np

from . import _C
from ._arrays import int32_host
from ._errors import invalid
from ._options import attention_options
from ._wrapper import BatchWrapper, PagedWrapper, no_custom_args, packed_mask, paged_metadata
from .decode import _single

def _check_flags(use_fp16_qk_reduction):
    if use_fp16_qk_reduction:
        raise invalid("use_fp16_qk_reduction: True; attnforge accumulates Q.K in float32 only (expected False)")


class BatchPrefillWithPagedKVCacheWrapper(PagedWrapper):
    """Batch prefill / append attention on a paged KV cache (FlashInfer's wrapper). The buffer arguments are
    optional even with ``use_cuda_graph=True`` (see BatchDecodeWithPagedKVCacheWrapper); ``qo_indptr_buf`` is
    unused (run() reads the query layout from the plan)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None):
        if jit_args is not None:
            raise invalid("jit_args: custom variants are not available from Python yet; expected None")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         {"kv_indptr": paged_kv_indptr_buf, "kv_indices": paged_kv_indices_buf,
                          "last_page_len": paged_kv_last_page_len_buf, "mask": custom_mask_buf,
                          "mask_indptr": mask_indptr_buf})

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, seq_lens=None, block_tables=None, fixed_split_size=None,
             disable_split_kv=False, stream=None, num_workers=0):
        """Plans the batch (metadata read on the host; pass CPU arrays to avoid a device synchronization).
        attnforge additions (keyword-only): ``stream``, ``num_workers``."""
        _check_flags(use_fp16_qk_reduction)
        options, slopes = attention_options(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                            window_left=window_left, logits_soft_cap=logits_soft_cap,
                                            rope_scale=rope_scale, rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        qo = int32_host(qo_indptr, "qo_indptr")
        kv_format, metadata, kv_lens = paged_metadata(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, block_tables, seq_lens, page_size,
            ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        metadata["mask"], metadata["mask_indptr"] = packed_mask(custom_mask, packed_custom_mask, np.diff(qo), kv_lens)
        metadata["alibi_slopes"] = slopes
        self._plan(kind=_C.PlanKind.prefill, kv_format=kv_format, page_size=page_size, num_qo_heads=num_qo_heads,
                   num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                   q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, qo_indptr=qo,
                   metadata=metadata, options=options,
                   fixed_split_tokens=None if fixed_split_size is None else int(fixed_split_size) * int(page_size),
                   disable_split_kv=disable_split_kv, stream=stream, num_workers=num_workers)


class BatchPrefillWithRaggedKVCacheWrapper(BatchWrapper):
    """Batch prefill attention on ragged (packed) K/V (FlashInfer's wrapper)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None):
        if jit_args is not None:
            raise invalid("jit_args: custom variants are not available from Python yet; expected None")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         {"kv_indptr": kv_indptr_buf, "mask": custom_mask_buf, "mask_indptr": mask_indptr_buf})

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
             fixed_split_size=None, disable_split_kv=False, stream=None, num_workers=0):
        """Plans the batch (metadata read on the host). attnforge additions (keyword-only): ``stream``,
        ``num_workers``. ``fixed_split_size`` is in KV tokens."""
        _check_flags(use_fp16_qk_reduction)
        options, slopes = attention_options(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                            window_left=window_left, logits_soft_cap=logits_soft_cap,
                                            rope_scale=rope_scale, rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        qo = int32_host(qo_indptr, "qo_indptr")
        metadata = {"kv_indptr": int32_host(kv_indptr, "kv_indptr")}
        metadata["mask"], metadata["mask_indptr"] = packed_mask(custom_mask, packed_custom_mask, np.diff(qo),
                                                                np.diff(metadata["kv_indptr"]))
        metadata["alibi_slopes"] = slopes
        self._plan(kind=_C.PlanKind.prefill, kv_format=_C.KVFormat.ragged, page_size=1, num_qo_heads=num_qo_heads,
                   num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                   q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, qo_indptr=qo,
                   metadata=metadata, options=options, fixed_split_tokens=fixed_split_size,
                   disable_split_kv=disable_split_kv, stream=stream, num_workers=num_workers)

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False,
            enable_pdl=None, window_left=None, sinks=None, sm_scale=None, logits_soft_cap=None, stream=None):
        if args:
            no_custom_args(args, "run")
        return self._run(q, k, v, out, lse, return_lse, stream, sm_scale, window_left, logits_soft_cap, q_scale,
                         k_scale, v_scale, sinks, enable_pdl)

    run.__doc__ = ("Prefill attention of q [total_qo, num_qo_heads, head_dim_qk] over k, v [total_kv, num_kv_heads, "
                   "head_dim] (NHD) or [num_kv_heads, total_kv, head_dim] (HND); otherwise as PagedWrapper.run.")

    def run_return_lse(self, q, k, v, *args, **kwargs):
        return self.run(q, k, v, *args, return_lse=True, **kwargs)


def single_prefill_with_kv_cache(q, k, v, *, scale_q=None, scale_k=None, scale_v=None, o_dtype=None,
                                 custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 backend="auto", return_lse=False, out=None, lse=None, sinks=None, stream=None):
    """Prefill attention of one request: q [qo_len, num_qo_heads, head_dim], k/v [kv_len, num_kv_heads, head_dim]
    (NHD) or [num_kv_heads, kv_len, head_dim] (HND). Returns out [qo_len, num_qo_heads, head_dim_vo] (and lse
    [qo_len, num_qo_heads], log2)."""
    _check_flags(use_fp16_qk_reduction)
    return _single(q, k, v, out, lse, return_lse, o_dtype, False, kv_layout, causal, pos_encoding_mode, sm_scale,
                   scale_q, scale_k, scale_v, window_left, logits_soft_cap, rope_scale, rope_theta, custom_mask,
                   packed_custom_mask, sinks, stream)


# FlashInfer names kept for engines that call them.
def single_prefill_with_kv_cache_return_lse(q, k, v, **kwargs):
    return single_prefill_with_kv_cache(q, k, v, return_lse=True, **kwargs)
