"""Paged KV cache utilities: FlashInfer's append_paged_kv_cache, get_batch_indices_positions and get_seq_lens."""
import sys
from typing import Optional

import numpy as np

from . import _C
from ._arrays import layout_of, stream_for
from ._torch import Tensor, operator


@operator("append_paged_kv_cache", mutates_args=("k_cache", "v_cache"))
def _append_paged_kv_cache(append_key: Tensor, append_value: Tensor, batch_indices: Tensor, positions: Tensor,
                           k_cache: Tensor, v_cache: Optional[Tensor], kv_indices: Tensor, kv_indptr: Tensor,
                           kv_last_page_len: Tensor, kv_layout: str, stream: Optional[int]) -> None:
    # v_cache None: k_cache is the whole [num_pages, 2, ...] cache (one argument, so that the operator's mutated
    # argument is the caller's array rather than two views of it).
    if v_cache is None:
        k_cache, v_cache = k_cache[:, 0], k_cache[:, 1]
    _C.append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                             layout_of(kv_layout), kv_indices, kv_indptr, kv_last_page_len,
                             stream_for(append_key, stream))


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout="NHD", *, stream=None):
    """Writes append_key/append_value [nnz, num_kv_heads, head_dim] into the paged cache: row r goes to request
    batch_indices[r] at token position positions[r] (int32 [nnz]). ``paged_kv_cache`` is a (k_cache, v_cache) pair
    or one [num_pages, 2, ...] array. Values are converted to the cache dtype."""
    k_cache, v_cache = paged_kv_cache if type(paged_kv_cache) is tuple else (paged_kv_cache, None)
    _append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices,
                           kv_indptr, kv_last_page_len, kv_layout, stream)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
    """KV length of each request from a CSR page table (numpy or torch arrays, any device)."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return (pages > 0) * ((pages - 1) * page_size + kv_last_page_len)


def get_batch_indices_positions(append_indptr, seq_lens, nnz):
    """(batch_indices, positions) int32 [nnz] for append_paged_kv_cache: row r of request b (rows
    append_indptr[b] .. append_indptr[b+1]) goes to position seq_lens[b] - append_len[b] + (r - append_indptr[b]),
    seq_lens being the KV lengths after the append. numpy or torch arrays (no host synchronization on CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(append_indptr, torch.Tensor):
        device = append_indptr.device
        counts = (append_indptr[1:] - append_indptr[:-1]).to(torch.int64)
        batch = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=nnz)
        rows = torch.arange(nnz, device=device)
        positions = rows - append_indptr.to(torch.int64)[batch] + (seq_lens.to(torch.int64) - counts)[batch]
        return batch.to(torch.int32), positions.to(torch.int32)
    append_indptr = np.asarray(append_indptr, dtype=np.int64)
    counts = np.diff(append_indptr)
    batch = np.repeat(np.arange(len(counts)), counts)[:nnz]
    rows = np.arange(nnz)
    positions = rows - append_indptr[batch] + (np.asarray(seq_lens, dtype=np.int64) - counts)[batch]
    return batch.astype(np.int32), positions.astype(np.int32)
