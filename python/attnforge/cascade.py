"""Attention states: FlashInfer's merge_state and merge_states. States are (v, s) with s = log2(sum exp(logit)),
FlashInfer's unit too; an empty KV segment is (0, -inf)."""
from . import _C
from ._arrays import array_dtype, current_stream, device_of, empty


def _stream(like, stream):
    if stream is not None:
        return stream
    kind, index = device_of(like)
    return current_stream(like, index) if kind == "cuda" else 0


def merge_state(v_a, s_a, v_b, s_b, *, out=None, lse=None, stream=None):
    """Merges two states of the same queries: v [seq_len, num_heads, head_dim], s float32 [seq_len, num_heads].
    Returns (V, S). attnforge additions (keyword-only): out, lse (output buffers), stream."""
    if out is None:
        out = empty(v_a, tuple(v_a.shape), array_dtype(v_a))
    if lse is None:
        lse = empty(v_a, tuple(s_a.shape), _C.DType.float32)
    _C.merge_state(v_a, s_a, v_b, s_b, out, lse, _stream(v_a, stream))
    return out, lse


def merge_states(v, s, *, out=None, lse=None, stream=None):
    """Merges num_states states: v [seq_len, num_states, num_heads, head_dim], s float32 [seq_len, num_states,
    num_heads]. Returns (V [seq_len, num_heads, head_dim], S [seq_len, num_heads])."""
    if out is None:
        out = empty(v, (v.shape[0], v.shape[2], v.shape[3]), array_dtype(v))
    if lse is None:
        lse = empty(v, (s.shape[0], s.shape[2]), _C.DType.float32)
    _C.merge_states(v, s, out, lse, _stream(v, stream))
    return out, lse
