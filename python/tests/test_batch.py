"""The batch wrappers on the CPU backend against the float64 reference: paged (CSR and block table, NHD and HND,
split and combined caches), ragged, decode and prefill, per-layer options at plan() and at run()."""
import numpy as np
import pytest

import attnforge as flashinfer  # the drop-in import the package promises
from reference import assert_close, attention, paged_cache, rounded

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 64, 5  # GQA group of 3; a page size that divides none of the lengths
KV_LENS = [1, 17, 0, 33, 12]               # odd lengths and an empty request


def _decode_inputs(rng, dtype, layout, q_len=1, kv_lens=KV_LENS):
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, dtype,
                                                                        layout)
    q, q64 = rounded(rng.standard_normal((len(kv_lens) * q_len, HEADS, DIM)), dtype)
    return q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq


def _reference(q64, qo_indptr, k_seq, v_seq, **options):
    outs, lses = [], []
    for b in range(len(k_seq)):
        o, lse = attention(q64[qo_indptr[b]:qo_indptr[b + 1]], k_seq[b], v_seq[b], **options)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_paged(rng, workspace, dtype, layout):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, dtype, layout)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype)
    out, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)
    ref_out, ref_lse = _reference(q64, np.arange(len(KV_LENS) + 1), k_seq, v_seq)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, "float32" if dtype == "float32" else "float16", "lse")
    # One combined [num_pages, 2, ...] cache gives the same result.
    combined = np.stack([k_cache, v_cache], axis=1)
    assert np.array_equal(wrapper.run(q, combined).astype(np.float32), out.astype(np.float32))


def test_decode_lse_is_log2_and_outputs_in_place(rng, workspace):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
    out = np.full((len(KV_LENS), HEADS, DIM), 7.0, np.float32)
    lse = np.full((len(KV_LENS), HEADS), 7.0, np.float32)
    got_out, got_lse = wrapper.run(q, (k_cache, v_cache), out=out, lse=lse, return_lse=True)
    assert got_out is out and got_lse is lse
    # log2(sum exp(s)) directly, for request 1 head 0.
    s = (q64[1, 0] @ k_seq[1][:, 0].T) / np.sqrt(DIM)
    assert abs(lse[1, 0] - np.log2(np.exp(s).sum())) < 1e-4
    assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)  # the empty request


def test_decode_block_tables(rng, workspace):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD")
    max_pages = int(np.diff(indptr).max()) + 1
    table = np.full((len(KV_LENS), max_pages), -1, np.int32)  # unused entries hold -1
    for b in range(len(KV_LENS)):
        table[b, :indptr[b + 1] - indptr[b]] = indices[indptr[b]:indptr[b + 1]]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", block_tables=table,
                 seq_lens=np.array(KV_LENS, np.int32))
    ref_out, _ = _reference(q64, np.arange(len(KV_LENS) + 1), k_seq, v_seq)
    assert_close(wrapper.run(q, (k_cache, v_cache)), ref_out, "float32")


def test_decode_q_len_per_req_is_causal(rng, workspace):
    kv_lens = [3, 17, 8]
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD", 3, kv_lens)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=True)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", q_len_per_req=3)
    ref_out, _ = _reference(q64, np.arange(len(kv_lens) + 1) * 3, k_seq, v_seq, causal=True)
    assert_close(wrapper.run(q, (k_cache, v_cache)), ref_out, "float32")


def test_per_layer_options_at_plan_and_run(rng, workspace):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD")
    qo = np.arange(len(KV_LENS) + 1)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", sm_scale=0.3,
                 logits_soft_cap=4.0, window_left=7)
    assert_close(wrapper.run(q, (k_cache, v_cache)),
                 _reference(q64, qo, k_seq, v_seq, sm_scale=0.3, soft_cap=4.0, window_left=7)[0], "float32")
    # run() overrides each of them for one call (another layer), then the plan's values hold again.
    sinks = rng.standard_normal(HEADS).astype(np.float32)
    out = wrapper.run(q, (k_cache, v_cache), sm_scale=0.2, logits_soft_cap=2.5, window_left=3, sinks=sinks)
    assert_close(out, _reference(q64, qo, k_seq, v_seq, sm_scale=0.2, soft_cap=2.5, window_left=3, sinks=sinks)[0],
                 "float32")
    assert_close(wrapper.run(q, (k_cache, v_cache)),
                 _reference(q64, qo, k_seq, v_seq, sm_scale=0.3, soft_cap=4.0, window_left=7)[0], "float32")


def test_enable_pdl_reaches_run(rng, workspace):
    """FlashInfer's run(enable_pdl=): None and True launch the CUDA decode kernel as a programmatic dependent, False
    plainly (AttentionOptions::programmatic_launch); the result is the same, and a value that is not a bool is
    refused by the binding."""
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
    ref_out, _ = _reference(q64, np.arange(len(KV_LENS) + 1), k_seq, v_seq)
    for enable_pdl in (None, True, False):
        assert_close(wrapper.run(q, (k_cache, v_cache), enable_pdl=enable_pdl), ref_out, "float32")
    with pytest.raises(TypeError):
        wrapper.run(q, (k_cache, v_cache), enable_pdl="yes")


def test_alibi_and_fp8_scales(rng, workspace):
    from attnforge._options import alibi_slopes

    kv_lens = [9, 30]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM,
                                                                        "float8_e4m3fn")
    q, q64 = rounded(rng.standard_normal((2, HEADS, DIM)), "bfloat16")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="bfloat16",
                 kv_data_type="float8_e4m3fn", pos_encoding_mode="ALIBI")
    out = wrapper.run(q, (k_cache, v_cache), k_scale=0.5, v_scale=2.0)
    ref, _ = _reference(q64, np.arange(3), k_seq, v_seq, alibi=alibi_slopes(HEADS), k_scale=0.5, v_scale=2.0)
    assert_close(out, ref, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_paged(rng, workspace, causal):
    kv_lens, qo_lens = [20, 7, 33, 0], [5, 7, 1, 0]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, "float32",
                                                                        "HND")
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q, q64 = rounded(rng.standard_normal((qo[-1], HEADS, DIM)), "float32")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
    wrapper.plan(qo, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, causal=causal, q_data_type="float32")
    out, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)
    ref_out, ref_lse = _reference(q64, qo, k_seq, v_seq, causal=causal)
    assert_close(out, ref_out, "float32")
    assert_close(lse, ref_lse, "float32", "lse")


def test_prefill_custom_mask(rng, workspace):
    kv_lens, qo_lens = [11, 6], [4, 3]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, "float32")
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q, q64 = rounded(rng.standard_normal((qo[-1], HEADS, DIM)), "float32")
    masks = [rng.random((m, n)) < 0.6 for m, n in zip(qo_lens, kv_lens)]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    packed = np.concatenate([np.packbits(m.reshape(-1), bitorder="little") for m in masks])
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace)
    ref = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k_seq[b], v_seq[b], mask=masks[b])[0] for b in range(2)])
    for kwargs in ({"custom_mask": flat}, {"packed_custom_mask": packed}):
        wrapper.plan(qo, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", **kwargs)
        assert_close(wrapper.run(q, (k_cache, v_cache)), ref, "float32")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_ragged(rng, workspace, layout):
    qo_lens, kv_lens = [3, 1, 9], [3, 40, 12]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q, q64 = rounded(rng.standard_normal((qo[-1], HEADS, DIM)), "bfloat16")
    k, k64 = rounded(rng.standard_normal((kv[-1], KV_HEADS, DIM)), "bfloat16")
    v, v64 = rounded(rng.standard_normal((kv[-1], KV_HEADS, 32)), "bfloat16")  # head_dim_vo differs
    if layout == "HND":
        k, v = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, layout)
    wrapper.plan(qo, kv, HEADS, KV_HEADS, DIM, head_dim_vo=32, causal=True, q_data_type="bfloat16")
    out = wrapper.run(q, k, v)
    ref = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k64[kv[b]:kv[b + 1]], v64[kv[b]:kv[b + 1]], causal=True)[0]
                          for b in range(3)])
    assert out.shape == (qo[-1], HEADS, 32)
    assert_close(out, ref, "bfloat16")


def test_replan_reuses_wrapper(rng, workspace):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    for kv_lens in ([4, 9], [50, 2, 7], [1]):
        q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD",
                                                                                       kv_lens=kv_lens)
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
        ref, _ = _reference(q64, np.arange(len(kv_lens) + 1), k_seq, v_seq)
        assert_close(wrapper.run(q, (k_cache, v_cache)), ref, "float32")


def test_reset_workspace_buffer(rng, workspace):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "HND")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(16, np.uint8), "HND", use_tensor_cores=True)
    wrapper.reset_workspace_buffer(workspace, np.zeros(16, np.uint8))
    assert wrapper.use_tensor_cores
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
    assert_close(wrapper.run(q, (k_cache, v_cache)), _reference(q64, np.arange(len(KV_LENS) + 1), k_seq, v_seq)[0],
                 "float32")


def test_split_kv_uses_the_workspace(rng):
    # One long request on many threads: the planner splits its KV and merges partial states in the workspace.
    kv_lens = [3000]
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD",
                                                                                   kv_lens=kv_lens)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8))
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", num_workers=8)
    assert wrapper.workspace_bytes_needed > 0, wrapper.describe_plan()
    assert_close(wrapper.run(q, (k_cache, v_cache)), _reference(q64, np.arange(2), k_seq, v_seq)[0], "float32")
    # Deterministic splits (FlashInfer's fixed_split_size, in pages) give the same values.
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", fixed_split_size=64)
    assert_close(wrapper.run(q, (k_cache, v_cache)), _reference(q64, np.arange(2), k_seq, v_seq)[0], "float32")


class _DLPackOnly:
    """An array that offers nothing but the DLPack protocol (as jax or a framework without a shortcut would)."""

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype = a.shape, a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer(rng, workspace):
    q, q64, k_cache, v_cache, indptr, indices, last, k_seq, v_seq = _decode_inputs(rng, "float32", "NHD")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
    out = np.zeros((len(KV_LENS), HEADS, DIM), np.float32)
    wrapper.run(_DLPackOnly(q), (_DLPackOnly(k_cache), _DLPackOnly(v_cache)), out=_DLPackOnly(out))
    assert_close(out, _reference(q64, np.arange(len(KV_LENS) + 1), k_seq, v_seq)[0], "float32")
