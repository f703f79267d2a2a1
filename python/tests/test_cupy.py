"""cupy arrays in and out (outputs allocated with cupy on q's device, cupy's current stream) against the same batch
on numpy arrays and the float64 reference. Skipped without cupy, or without a GPU and a CUDA build of attnforge."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import attnforge as flashinfer  # noqa: E402
from reference import assert_close, attention, paged_cache  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 128, 16
pytestmark = pytest.mark.skipif(not flashinfer.cuda_available(), reason="needs a GPU and attnforge built with CUDA")


def _decode(q, k_cache, v_cache, meta, workspace):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float16")
    return wrapper.run_return_lse(q, (k_cache, v_cache))


def test_cupy_batch_decode(rng):
    kv_lens = [1, 300, 0, 45]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, "float16")
    q = rng.standard_normal((len(kv_lens), HEADS, DIM)).astype(np.float16)
    ref = np.concatenate([attention(q[b:b + 1].astype(np.float64), k_seq[b], v_seq[b])[0]
                          for b in range(len(kv_lens))])
    meta = (indptr, indices, last)  # host metadata: plan() never synchronizes
    out_np, lse_np = _decode(q, k_cache, v_cache, meta, np.zeros(32 << 20, np.uint8))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = _decode(cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), meta,
                           cupy.zeros(32 << 20, cupy.uint8))
        assert isinstance(out, cupy.ndarray) and out.dtype == np.float16 and lse.dtype == np.float32
        out_host, lse_host = cupy.asnumpy(out, stream=stream), cupy.asnumpy(lse, stream=stream)
    stream.synchronize()
    assert_close(out_host, ref, "float16")
    assert_close(out_host, out_np.astype(np.float64), "float16")
    assert_close(lse_host, lse_np, "float16", "lse")


def test_cupy_merge_state(rng):
    """merge_state on cupy arrays (the CUDA merge operator) gives what the numpy arrays of the same states give."""
    v = rng.standard_normal((5, HEADS, DIM)).astype(np.float32)
    s = rng.standard_normal((5, HEADS)).astype(np.float32)
    v_np, s_np = flashinfer.merge_state(v, s, v, s + 1)
    assert_close(s_np, s + 1 + np.log2(1 + 2.0 ** -1), "float32", "lse")
    v_cp, s_cp = flashinfer.merge_state(cupy.asarray(v), cupy.asarray(s), cupy.asarray(v), cupy.asarray(s + 1))
    assert_close(cupy.asnumpy(v_cp), v_np, "float32")
    assert_close(cupy.asnumpy(s_cp), s_np, "float32", "lse")
