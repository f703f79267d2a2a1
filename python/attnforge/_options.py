"""FlashInfer-style per-layer arguments -> attnforge's AttentionOptions (the C++ struct, bound in _C)."""
import math

import numpy as np

from . import _C
from ._errors import invalid

_POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def alibi_slopes(num_heads):
    """The ALiBi paper's head slopes (what FlashInfer uses for pos_encoding_mode="ALIBI"), float32 [num_heads]."""
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = (2.0 ** (-8.0 / n)) ** np.arange(1, n + 1)
    if n < num_heads:
        extra = (2.0 ** (-4.0 / n)) ** np.arange(1, 1 + 2 * (num_heads - n), 2)
        slopes = np.concatenate([slopes, extra])
    return slopes.astype(np.float32)


def rope_options(*, rotary_dim=None, interleave=False, rope_scale=None, rope_theta=None, llama31=None):
    """RopeOptions; llama31 = (factor, low_freq_factor, high_freq_factor, old_context_len) or None."""
    r = _C.RopeOptions()
    r.enabled = True
    r.rotary_dim = 0 if rotary_dim is None else int(rotary_dim)
    r.interleave = bool(interleave)
    r.theta = 1e4 if rope_theta is None else float(rope_theta)
    if llama31 is None:
        r.scale = 1.0 if rope_scale is None else float(rope_scale)
    else:
        # Llama 3.1 scales frequencies, not positions: FlashInfer's rope_scale is the frequency factor there.
        (r.llama31_factor, r.llama31_low_freq_factor, r.llama31_high_freq_factor,
         r.llama31_old_context_len) = (float(x) for x in llama31)
    return r


def attention_options(*, causal=False, pos_encoding_mode="NONE", sm_scale=None, window_left=-1,
                      logits_soft_cap=None, rope_scale=None, rope_theta=None, num_qo_heads=0):
    """(AttentionOptions, alibi slopes or None) for FlashInfer's plan()/single-request arguments."""
    if pos_encoding_mode not in _POS_ENCODING_MODES:
        raise invalid(f"pos_encoding_mode: {pos_encoding_mode!r}; expected one of {{'NONE', 'ROPE_LLAMA', 'ALIBI'}}")
    o = _C.AttentionOptions()
    o.causal = bool(causal)
    o.sm_scale = 0.0 if sm_scale is None else float(sm_scale)
    o.window_left = -1 if window_left is None else int(window_left)
    o.logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    slopes = None
    if pos_encoding_mode == "ROPE_LLAMA":
        o.rope = rope_options(rope_scale=rope_scale, rope_theta=rope_theta)
    elif pos_encoding_mode == "ALIBI":
        slopes = alibi_slopes(num_qo_heads)
    return o, slopes
