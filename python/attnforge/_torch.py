"""torch integration, active only once torch has been imported by the program.

run() of every wrapper is registered as the custom operator ``attnforge::batch_run`` with a fake (meta)
implementation, so ``torch.compile(fullgraph=True)`` traces through it; eager calls bypass the dispatcher (it costs
microseconds) and call the extension directly. The operator mutates ``out`` and ``lse`` and returns nothing.
"""
import itertools
import sys
import weakref

_wrappers = weakref.WeakValueDictionary()  # handle -> wrapper, for the operator's implementation
_next_handle = itertools.count(1)
_registered = False


def register_wrapper(wrapper):
    handle = next(_next_handle)
    _wrappers[handle] = wrapper
    return handle


def compiling():
    """Whether torch.compile (dynamo) is tracing the caller right now."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _register_ops():
    global _registered
    if _registered:
        return
    import torch
    from typing import Optional

    @torch.library.custom_op("attnforge::batch_run", mutates_args=("out", "lse"))
    def batch_run(handle: int, q: torch.Tensor, kv_a: torch.Tensor, kv_b: Optional[torch.Tensor],
                  out: torch.Tensor, lse: Optional[torch.Tensor], sm_scale: Optional[float],
                  window_left: Optional[int], logits_soft_cap: Optional[float], q_scale: Optional[float],
                  k_scale: Optional[float], v_scale: Optional[float], sinks: Optional[torch.Tensor]) -> None:
        wrapper = _wrappers[handle]
        wrapper._run_now(q, kv_a, kv_b, out, lse, None, sm_scale, window_left, logits_soft_cap, q_scale, k_scale,
                         v_scale, sinks)

    @batch_run.register_fake
    def _(handle, q, kv_a, kv_b, out, lse, sm_scale, window_left, logits_soft_cap, q_scale, k_scale, v_scale,
          sinks):
        return None

    _registered = True


def ensure_registered():
    """Registers the operators if torch is imported (called by every wrapper's plan())."""
    if "torch" in sys.modules:
        _register_ops()


def run_traced(wrapper, q, kv_a, kv_b, out, lse, return_lse, sm_scale, window_left, logits_soft_cap, q_scale,
               k_scale, v_scale, sinks):
    """run() as torch.compile sees it: outputs from torch.empty, the work in the custom operator."""
    import torch

    if out is None:
        out = torch.empty((q.shape[0], wrapper._num_qo_heads, wrapper._head_dim_vo), dtype=wrapper._torch_o_dtype,
                          device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((q.shape[0], wrapper._num_qo_heads), dtype=torch.float32, device=q.device)
    torch.ops.attnforge.batch_run(wrapper._handle, q, kv_a, kv_b, out, lse, sm_scale, window_left, logits_soft_cap,
                                  q_scale, k_scale, v_scale, sinks)
    return (out, lse) if return_lse else out
