"""Attention states: FlashInfer's merge_state and merge_states. States are (v, s) with s = log2(sum exp(logit)),
FlashInfer's unit too; an empty KV segment is (0, -inf)."""
from typing import Optional

from . import _C
from ._arrays import outputs, stream_for
from ._torch import Tensor, operator


@operator("merge_state", mutates_args=("out", "lse"))
def _merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, out: Tensor, lse: Tensor,
                 stream: Optional[int]) -> None:
    _C.merge_state(v_a, s_a, v_b, s_b, out, lse, stream_for(v_a, stream))


@operator("merge_states", mutates_args=("out", "lse"))
def _merge_states(v: Tensor, s: Tensor, out: Tensor, lse: Tensor, stream: Optional[int]) -> None:
    _C.merge_states(v, s, out, lse, stream_for(v, stream))


def merge_state(v_a, s_a, v_b, s_b, *, out=None, lse=None, stream=None):
    """Merges two states of the same queries: v [seq_len, num_heads, head_dim], s float32 [seq_len, num_heads].
    Returns (V, S). attnforge additions (keyword-only): out, lse (output buffers), stream."""
    out, lse = outputs(v_a, out, lse, tuple(v_a.shape))
    _merge_state(v_a, s_a, v_b, s_b, out, lse, stream)
    return out, lse


def merge_states(v, s, *, out=None, lse=None, stream=None):
    """Merges num_states states: v [seq_len, num_states, num_heads, head_dim], s float32 [seq_len, num_states,
    num_heads]. Returns (V [seq_len, num_heads, head_dim], S [seq_len, num_heads])."""
    out, lse = outputs(v, out, lse, (v.shape[0], v.shape[2], v.shape[3]))
    _merge_states(v, s, out, lse, stream)
    return out, lse
