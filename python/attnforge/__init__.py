"""attnforge: attention for LLM inference serving.

The FlashInfer-compatible subset works by changing one import (``import attnforge as flashinfer``); the
differences are listed in docs/python-compat.md. Arrays go in and out through DLPack (numpy with ml_dtypes for
bfloat16 and fp8, torch, cupy); torch is not a dependency.
"""
from . import _C, _torch
from ._C import CustomVariant, builtin_variant
from ._errors import (BackendError, Error, InvalidArgumentError, PlanMismatchError, UnsupportedError,
                      WorkspaceError)
from . import distributed
from .cascade import merge_state, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from .distributed import (ContextParallelBatchDecodeWithPagedKVCacheWrapper,
                          ContextParallelBatchPrefillWithPagedKVCacheWrapper)
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                      single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse)
from .rope import (apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids,
                   apply_llama31_rope_pos_ids_inplace, apply_rope, apply_rope_inplace, apply_rope_pos_ids,
                   apply_rope_pos_ids_inplace)

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
    "single_decode_with_kv_cache", "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
    "merge_state", "merge_states", "append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens",
    "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace", "apply_llama31_rope",
    "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids", "apply_llama31_rope_pos_ids_inplace",
    "Error", "InvalidArgumentError", "UnsupportedError", "WorkspaceError", "PlanMismatchError", "BackendError",
    "build_info", "cuda_available", "CustomVariant", "builtin_variant", "distributed",
    "ContextParallelBatchDecodeWithPagedKVCacheWrapper", "ContextParallelBatchPrefillWithPagedKVCacheWrapper",
]
__version__ = _C.version()
_torch.register_now_or_after_torch_import()


def build_info():
    """Version, commit, compiler and CUDA configuration of the C++ library this module was built with."""
    return _C.build_info()


def cuda_available():
    """Whether this build has the CUDA backend and sees a GPU it can run attention on."""
    return _C.cuda_available()
