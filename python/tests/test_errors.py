"""Validation errors surface as Python exceptions of the C++ error's kind, with the C++ message."""
import numpy as np
import pytest

import attnforge as flashinfer
from reference import paged_cache


def _planned(rng, workspace):
    k_cache, v_cache, indptr, indices, last, _, _ = paged_cache(rng, [5, 9], 4, 2, 64, "float32")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, 6, 2, 64, 4, q_data_type="float32")
    return wrapper, k_cache, v_cache


def test_exception_classes():
    assert issubclass(flashinfer.InvalidArgumentError, ValueError)
    assert issubclass(flashinfer.WorkspaceError, ValueError)
    assert issubclass(flashinfer.PlanMismatchError, ValueError)
    assert issubclass(flashinfer.UnsupportedError, NotImplementedError)
    assert issubclass(flashinfer.BackendError, RuntimeError)
    for cls in (flashinfer.InvalidArgumentError, flashinfer.UnsupportedError, flashinfer.WorkspaceError,
                flashinfer.PlanMismatchError, flashinfer.BackendError):
        assert issubclass(cls, flashinfer.Error)


def test_cpp_messages(rng, workspace):
    wrapper, k_cache, v_cache = _planned(rng, workspace)
    q = np.zeros((2, 6, 64), np.float32)
    with pytest.raises(flashinfer.PlanMismatchError, match=r"^q: has 3 rows; the plan was made for 2 query tokens$"):
        wrapper.run(np.zeros((3, 6, 64), np.float32), (k_cache, v_cache))
    with pytest.raises(flashinfer.InvalidArgumentError,
                       match=r"^q: dtype float16; the plan was made for q_dtype float32$"):
        wrapper.run(q.astype(np.float16), (k_cache, v_cache))
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^kv\.k: dimension 2 is 3 \(shape \[\d+, 4, 3, 64\]\); expected 2 \(num_kv_heads\)$"):
        wrapper.run(q, (np.zeros((k_cache.shape[0], 4, 3, 64), np.float32), v_cache))
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^q: DLPack dtype \(code 2, 64 bits\) is not accepted"):
        wrapper.run(q.astype(np.float64), (k_cache, v_cache))
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^paged_kv_cache: shape \[3, 4\]; expected a"):
        wrapper.run(q, np.zeros((3, 4), np.float32))
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^out: dtype float16; the plan was made for o_dtype"):
        wrapper.run(q, (k_cache, v_cache), out=np.zeros((2, 6, 64), np.float16))
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^options\.sinks: dimension 0 is 5"):
        wrapper.run(q, (k_cache, v_cache), sinks=np.zeros(5, np.float32))


def test_plan_errors(rng, workspace):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    indptr, indices = np.array([0, 1, 3], np.int32), np.array([0, 1, 2], np.int32)
    with pytest.raises(flashinfer.InvalidArgumentError,
                       match=r"^last_page_len\[1\]: 9; expected a value in \[1, page_size=4\]$"):
        wrapper.plan(indptr, indices, np.array([2, 9], np.int32), 6, 2, 64, 4, q_data_type="float32")
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"num_qo_heads"):
        wrapper.plan(indptr, indices, np.array([2, 3], np.int32), 5, 2, 64, 4, q_data_type="float32")
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^q_data_type: dtype 'int8' is not accepted"):
        wrapper.plan(indptr, indices, np.array([2, 3], np.int32), 6, 2, 64, 4, q_data_type="int8")
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^pos_encoding_mode: 'ROPE'; expected one of"):
        wrapper.plan(indptr, indices, np.array([2, 3], np.int32), 6, 2, 64, 4, pos_encoding_mode="ROPE")
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^kv_layout: 'NDH'; expected one of"):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NDH")
    with pytest.raises(flashinfer.InvalidArgumentError, match=r"^plan: run\(\) or a plan query before plan\(\)"):
        wrapper.describe_plan()


def test_workspace_too_small_names_the_sizes(rng):
    k_cache, v_cache, indptr, indices, last, _, _ = paged_cache(rng, [3000], 16, 2, 64, "float32")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(4096, np.uint8))
    with pytest.raises(flashinfer.WorkspaceError,
                       match=r"^float_workspace_buffer: \d+ usable bytes .*; this plan needs \d+ "
                             r"\(AttentionPlan::workspace_bytes\)"):
        wrapper.plan(indptr, indices, last, 6, 2, 64, 16, q_data_type="float32", num_workers=8)


def test_keyword_only_extras_and_custom_args(rng, workspace):
    wrapper, k_cache, v_cache = _planned(rng, workspace)
    q = np.zeros((2, 6, 64), np.float32)
    with pytest.raises(TypeError):
        wrapper.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([1], np.int32), 6, 2, 64, 4,
                     "NONE")
    with pytest.raises(TypeError, match="extra positional arguments"):
        wrapper.run(q, (k_cache, v_cache), 1.0)
