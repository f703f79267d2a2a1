"""Rotary embeddings: FlashInfer's apply_rope, apply_rope_pos_ids, apply_llama31_rope(_pos_ids) and their
_inplace forms. Positions: row r of request b (rows indptr[b] .. indptr[b+1]) is at r - indptr[b] + offsets[b],
or pos_ids[r]."""
from . import _C
from ._arrays import array_dtype, empty
from ._options import rope_options
from .cascade import _stream


def _rope(q, k, q_out, k_out, indptr, offsets, pos_ids, options, stream):
    if q_out is None:
        q_out = empty(q, tuple(q.shape), array_dtype(q))
    if k_out is None:
        k_out = empty(k, tuple(k.shape), array_dtype(k))
    _C.apply_rope(q, k, q_out, k_out, indptr, offsets, pos_ids, options, _stream(q, stream))
    return q_out, k_out


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    """Returns (q_rope, k_rope) for q [nnz, num_qo_heads, head_dim], k [nnz, num_kv_heads, head_dim]."""
    return _rope(q, k, None, None, indptr, offsets, None,
                 rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_scale=rope_scale,
                              rope_theta=rope_theta), None)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _rope(q, k, q, k, indptr, offsets, None,
          rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_scale=rope_scale, rope_theta=rope_theta),
          None)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    return _rope(q, k, None, None, None, None, pos_ids,
                 rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_scale=rope_scale,
                              rope_theta=rope_theta), None)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _rope(q, k, q, k, None, None, pos_ids,
          rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_scale=rope_scale, rope_theta=rope_theta),
          None)


def _llama31(rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len):
    return rope_options(rotary_dim=rotary_dim, interleave=interleave, rope_theta=rope_theta,
                        llama31=(rope_scale, low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                       low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    return _rope(q, k, None, None, indptr, offsets, None,
                 _llama31(rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                          old_context_len), None)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    _rope(q, k, q, k, indptr, offsets, None,
          _llama31(rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                   old_context_len), None)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
                               low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    return _rope(q, k, None, None, None, None, pos_ids,
                 _llama31(rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                          old_context_len), None)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    _rope(q, k, q, k, None, None, pos_ids,
          _llama31(rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                   old_context_len), None)
