"""torch integration, active once torch has been imported by the program (attnforge never imports it itself).

run() of every wrapper is registered as the custom operator ``attnforge::batch_run`` with a fake (meta)
implementation, so ``torch.compile(fullgraph=True)`` traces through it. Eager calls bypass the dispatcher (it costs
microseconds) and call the extension directly; so do calls captured in a CUDA graph. The operator mutates ``out``
and ``lse`` and returns nothing.
"""
import itertools
import sys
import weakref

_wrappers = weakref.WeakValueDictionary()  # handle -> wrapper, for the operator's implementation
_next_handle = itertools.count(1)
_torch = None  # the torch module once the operators are registered


def _never():
    return False


# torch.compiler.is_compiling once torch is seen: dynamo evaluates it to True while tracing.
compiling = _never


def register_wrapper(wrapper):
    handle = next(_next_handle)
    _wrappers[handle] = wrapper
    return handle


def _register_ops(torch):
    global _torch, compiling
    from typing import Optional

    @torch.library.custom_op("attnforge::batch_run", mutates_args=("out", "lse"))
    def batch_run(handle: int, q: torch.Tensor, kv_a: torch.Tensor, kv_b: Optional[torch.Tensor],
                  out: torch.Tensor, lse: Optional[torch.Tensor], sm_scale: Optional[float],
                  window_left: Optional[int], logits_soft_cap: Optional[float], q_scale: Optional[float],
                  k_scale: Optional[float], v_scale: Optional[float], sinks: Optional[torch.Tensor]) -> None:
        _wrappers[handle]._run_now(q, kv_a, kv_b, out, lse, None, sm_scale, window_left, logits_soft_cap, q_scale,
                                   k_scale, v_scale, sinks)

    @batch_run.register_fake
    def _(handle, q, kv_a, kv_b, out, lse, sm_scale, window_left, logits_soft_cap, q_scale, k_scale, v_scale,
          sinks):
        return None

    _torch = torch
    compiling = torch.compiler.is_compiling


def ensure_registered():
    """Registers the operators if the program has imported torch (at import of attnforge and at every plan())."""
    if _torch is None and "torch" in sys.modules:
        _register_ops(sys.modules["torch"])


def run_traced(wrapper, q, kv_a, kv_b, out, lse, return_lse, sm_scale, window_left, logits_soft_cap, q_scale,
               k_scale, v_scale, sinks):
    """run() as torch.compile sees it: outputs from torch.empty, the work in the custom operator."""
    torch = _torch
    if out is None:
        out = torch.empty((q.shape[0], wrapper._num_qo_heads, wrapper._head_dim_vo),
                          dtype=getattr(torch, wrapper._o_dtype_name), device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((q.shape[0], wrapper._num_qo_heads), dtype=torch.float32, device=q.device)
    torch.ops.attnforge.batch_run(wrapper._handle, q, kv_a, kv_b, out, lse, sm_scale, window_left, logits_soft_cap,
                                  q_scale, k_scale, v_scale, sinks)
    return (out, lse) if return_lse else out
