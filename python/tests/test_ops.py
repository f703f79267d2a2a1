"""Functional operators on the CPU backend against float64 references: single-request attention, merging attention
states, appending to a paged cache, RoPE."""
import numpy as np
import pytest

import attnforge as flashinfer
from reference import assert_close, attention, paged_cache, rope, rounded

HEADS, KV_HEADS, DIM = 6, 2, 64


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode(rng, layout):
    q, q64 = rounded(rng.standard_normal((HEADS, DIM)), "bfloat16")
    k, k64 = rounded(rng.standard_normal((29, KV_HEADS, DIM)), "bfloat16")
    v, v64 = rounded(rng.standard_normal((29, KV_HEADS, DIM)), "bfloat16")
    ref_out, ref_lse = attention(q64[None], k64, v64, soft_cap=3.0, window_left=11)
    if layout == "HND":
        k, v = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
    out, lse = flashinfer.single_decode_with_kv_cache(q, k, v, layout, logits_soft_cap=3.0, window_left=11,
                                                      return_lse=True)
    assert out.shape == (HEADS, DIM) and lse.shape == (HEADS,)
    assert_close(out, ref_out[0], "bfloat16")
    assert_close(lse, ref_lse[0], "float16", "lse")


def test_single_prefill_causal_and_mask(rng):
    q, q64 = rounded(rng.standard_normal((7, HEADS, DIM)), "float32")
    k, k64 = rounded(rng.standard_normal((19, KV_HEADS, DIM)), "float32")
    v, v64 = rounded(rng.standard_normal((19, KV_HEADS, DIM)), "float32")
    assert_close(flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True),
                 attention(q64, k64, v64, causal=True)[0], "float32")
    mask = rng.random((7, 19)) < 0.5
    ref = attention(q64, k64, v64, mask=mask)[0]
    assert_close(flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask), ref, "float32")
    packed = np.packbits(mask.reshape(-1), bitorder="little")
    out, lse = flashinfer.single_prefill_with_kv_cache_return_lse(q, k, v, packed_custom_mask=packed)
    assert_close(out, ref, "float32")


def test_merge_state_equals_attention_over_both_segments(rng):
    q, q64 = rounded(rng.standard_normal((5, HEADS, DIM)), "float32")
    k, k64 = rounded(rng.standard_normal((40, KV_HEADS, DIM)), "float32")
    v, v64 = rounded(rng.standard_normal((40, KV_HEADS, DIM)), "float32")
    a = flashinfer.single_prefill_with_kv_cache(q, k[:13], v[:13], return_lse=True)
    b = flashinfer.single_prefill_with_kv_cache(q, k[13:], v[13:], return_lse=True)
    v_merged, s_merged = flashinfer.merge_state(a[0], a[1], b[0], b[1])
    ref_out, ref_lse = attention(q64, k64, v64)
    assert_close(v_merged, ref_out, "float32")
    assert_close(s_merged, ref_lse, "float32", "lse")
    # merge_states over 3 segments, one of them empty: (0, -inf) is the identity.
    empty = (np.zeros_like(a[0]), np.full_like(a[1], -np.inf))
    vs = np.stack([a[0], empty[0], b[0]], axis=1)
    ss = np.stack([a[1], empty[1], b[1]], axis=1)
    v3, s3 = flashinfer.merge_states(vs, ss)
    assert_close(v3, ref_out, "float32")
    assert_close(s3, ref_lse, "float32", "lse")


def test_append_paged_kv_cache(rng):
    page, kv_lens_before, appends = 4, [3, 0, 9], [2, 5, 1]
    kv_lens_after = [a + b for a, b in zip(kv_lens_before, appends)]
    k_cache, v_cache, indptr, indices, last, _, _ = paged_cache(rng, kv_lens_after, page, KV_HEADS, DIM, "float32")
    append_indptr = np.concatenate([[0], np.cumsum(appends)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    append_k, append_k64 = rounded(rng.standard_normal((nnz, KV_HEADS, DIM)), "bfloat16")
    append_v, _ = rounded(rng.standard_normal((nnz, KV_HEADS, DIM)), "bfloat16")
    seq_lens = flashinfer.get_seq_lens(indptr, last, page)
    assert seq_lens.tolist() == kv_lens_after
    batch_indices, positions = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    assert batch_indices.tolist() == [0, 0, 1, 1, 1, 1, 1, 2]
    assert positions.tolist() == [3, 4, 0, 1, 2, 3, 4, 9]
    flashinfer.append_paged_kv_cache(append_k, append_v, batch_indices, positions, (k_cache, v_cache), indices,
                                     indptr, last)
    for r in range(nnz):
        b, p = batch_indices[r], positions[r]
        page_id = indices[indptr[b] + p // page]
        np.testing.assert_array_equal(k_cache[page_id, p % page], append_k64[r].astype(np.float32))


@pytest.mark.parametrize("interleave", [False, True])
def test_apply_rope(rng, interleave):
    indptr, offsets = np.array([0, 3, 8], np.int32), np.array([5, 100], np.int32)
    q = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((8, KV_HEADS, DIM)).astype(np.float32)
    pos = np.concatenate([np.arange(3) + 5, np.arange(5) + 100]).astype(np.float64)
    q_rope, k_rope = flashinfer.apply_rope(q, k, indptr, offsets, interleave=interleave, rope_theta=1e4,
                                           rotary_dim=32)
    assert_close(q_rope, rope(q, pos, 1e4, interleave=interleave, rotary_dim=32), "float32")
    assert_close(k_rope, rope(k, pos, 1e4, interleave=interleave, rotary_dim=32), "float32")
    q_ids, k_ids = flashinfer.apply_rope_pos_ids(q, k, pos.astype(np.int32), interleave=interleave, rope_scale=2.0)
    assert_close(q_ids, rope(q, pos, 1e4, scale=2.0, interleave=interleave), "float32")
    flashinfer.apply_rope_inplace(q, k, indptr, offsets, interleave=interleave, rotary_dim=32)
    assert_close(q, q_rope, "float32")


def test_apply_llama31_rope(rng):
    q = rng.standard_normal((6, HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((6, KV_HEADS, DIM)).astype(np.float32)
    pos = np.array([0, 1, 2, 5000, 9000, 20000], np.int32)
    q_rope, k_rope = flashinfer.apply_llama31_rope_pos_ids(q, k, pos)
    ref = rope(k, pos.astype(np.float64), 5e5, llama31=(8.0, 1.0, 4.0, 8192.0))
    assert_close(k_rope, ref, "float16")
