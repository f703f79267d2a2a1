"""Rotary embeddings: FlashInfer's apply_rope, apply_rope_pos_ids, apply_llama31_rope(_pos_ids) and their
_inplace forms. Positions: row r of request b (rows indptr[b] .. indptr[b+1]) is at r - indptr[b] + offsets[b],
or pos_ids[r]."""
from typing import List, Optional

from . import _C
from ._arrays import empty, stream_for
from ._options import rope_options
from ._torch import Tensor, operator


def _rope_now(q, k, q_rope, k_rope, indptr, offsets, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
              llama31):
    options = rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_scale=rope_scale,
                           rope_theta=rope_theta, llama31=None if llama31 is None else (rope_scale, *llama31))
    _C.apply_rope(q, k, q_rope, k_rope, indptr, offsets, pos_ids, options, stream_for(q, None))


# llama31: None, or Llama 3.1's [low_freq_factor, high_freq_factor, old_context_len] (rope_scale is its factor).
@operator("apply_rope", mutates_args=("q_rope", "k_rope"))
def _apply_rope(q: Tensor, k: Tensor, q_rope: Tensor, k_rope: Tensor, indptr: Optional[Tensor],
                offsets: Optional[Tensor], pos_ids: Optional[Tensor], rotary_dim: Optional[int], interleave: bool,
                rope_scale: float, rope_theta: float, llama31: Optional[List[float]]) -> None:
    _rope_now(q, k, q_rope, k_rope, indptr, offsets, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
              llama31)


@operator("apply_rope_inplace", mutates_args=("q", "k"))
def _apply_rope_inplace(q: Tensor, k: Tensor, indptr: Optional[Tensor], offsets: Optional[Tensor],
                        pos_ids: Optional[Tensor], rotary_dim: Optional[int], interleave: bool, rope_scale: float,
                        rope_theta: float, llama31: Optional[List[float]]) -> None:
    _rope_now(q, k, q, k, indptr, offsets, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, llama31)


def _rope(q, k, inplace, indptr, offsets, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, llama31=None):
    args = (indptr, offsets, pos_ids, None if rotary_dim is None else int(rotary_dim), bool(interleave),
            float(rope_scale), float(rope_theta), None if llama31 is None else [float(x) for x in llama31])
    if inplace:
        _apply_rope_inplace(q, k, *args)
        return None
    q_rope, k_rope = empty(q, tuple(q.shape)), empty(k, tuple(k.shape))
    _apply_rope(q, k, q_rope, k_rope, *args)
    return q_rope, k_rope


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    """Returns (q_rope, k_rope) for q [nnz, num_qo_heads, head_dim], k [nnz, num_kv_heads, head_dim]."""
    return _rope(q, k, False, indptr, offsets, None, rotary_dim, interleave, rope_scale, rope_theta)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _rope(q, k, True, indptr, offsets, None, rotary_dim, interleave, rope_scale, rope_theta)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    return _rope(q, k, False, None, None, pos_ids, rotary_dim, interleave, rope_scale, rope_theta)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _rope(q, k, True, None, None, pos_ids, rotary_dim, interleave, rope_scale, rope_theta)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                       low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    return _rope(q, k, False, indptr, offsets, None, rotary_dim, interleave, rope_scale, rope_theta,
                 (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    _rope(q, k, True, indptr, offsets, None, rotary_dim, interleave, rope_scale, rope_theta,
          (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                               low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    return _rope(q, k, False, None, None, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
                 (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    _rope(q, k, True, None, None, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
          (low_freq_factor, high_freq_factor, old_context_len))
