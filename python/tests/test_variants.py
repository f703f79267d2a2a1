"""Custom attention variants from Python (attnforge.CustomVariant, compiled at run time by the host compiler and
cached): sigmoid attention with softmax off and a per-head logit bias read from an extra array, on the CPU,
against numpy float64 references of the same definitions."""
import numpy as np
import pytest

import attnforge
from reference import paged_cache, rounded

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 32, 4
KV_LENS = [9, 1, 0, 14]

SIGMOID = attnforge.CustomVariant("PySigmoid", """
struct PySigmoid : attnforge::VariantBase {
  static constexpr bool kSoftmax = false;
  static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex&, float s) {
    return 1.f / (1.f + expf(-(s + a.scalars[0])));
  }
};
""")

HEAD_BIAS = attnforge.CustomVariant("PyHeadBias", """
struct PyHeadBias : attnforge::VariantBase {
  static float logits_transform(const attnforge::VariantArgs& a, const attnforge::LogitIndex& i, float s) {
    return s + static_cast<const float*>(a.tensors[0])[i.qo_head];
  }
};
""")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path / "cache"))


def _setup(rng, workspace):
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, KV_LENS, PAGE, KV_HEADS, DIM, "float32",
                                                                        "NHD")
    q, q64 = rounded(rng.standard_normal((len(KV_LENS), HEADS, DIM)), "float32")
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", disable_split_kv=True)
    return wrapper, q, q64, (k_cache, v_cache), k_seq, v_seq


def _logits(q64, k_seq, b):
    group = HEADS // KV_HEADS
    k = np.repeat(k_seq[b], group, axis=1)  # [kv_len, HEADS, DIM]
    return np.einsum("hd,thd->ht", q64[b], k) / np.sqrt(DIM)


def test_sigmoid_attention_with_softmax_off(rng, workspace):
    wrapper, q, q64, kv, k_seq, v_seq = _setup(rng, workspace)
    out, lse = wrapper.run(q, kv, variant=SIGMOID, variant_scalars=[-1.5], return_lse=True)
    group = HEADS // KV_HEADS
    for b in range(len(KV_LENS)):
        p = 1.0 / (1.0 + np.exp(-(_logits(q64, k_seq, b) - 1.5)))
        ref = np.einsum("ht,thd->hd", p, np.repeat(v_seq[b], group, axis=1))
        np.testing.assert_allclose(out[b], ref, rtol=1e-4, atol=1e-5)
    assert np.isnan(lse).all(), "no LSE without softmax"


def test_per_head_bias_from_an_extra_array(rng, workspace):
    wrapper, q, q64, kv, k_seq, v_seq = _setup(rng, workspace)
    bias = np.array([0.5, -1.0, 2.0, 0.0, 3.0, -0.25], np.float32)
    out = wrapper.run(q, kv, variant=HEAD_BIAS, variant_tensors=[bias])
    group = HEADS // KV_HEADS
    for b in range(len(KV_LENS)):
        if KV_LENS[b] == 0:
            assert np.all(out[b] == 0)
            continue
        s = _logits(q64, k_seq, b) + bias[:, None]
        w = np.exp(s - s.max(axis=1, keepdims=True))
        ref = np.einsum("ht,thd->hd", w / w.sum(axis=1, keepdims=True), np.repeat(v_seq[b], group, axis=1))
        np.testing.assert_allclose(out[b], ref, rtol=1e-4, atol=1e-5)


def test_variant_errors_carry_the_cpp_messages(rng, workspace):
    wrapper, q, _, kv, _, _ = _setup(rng, workspace)
    broken = attnforge.CustomVariant("Broken", "struct Broken : attnforge::VariantBase { int x = ; };")
    with pytest.raises(attnforge.Error, match="Broken"):
        wrapper.run(q, kv, variant=broken)
    with pytest.raises(attnforge.InvalidArgumentError, match="scalars"):
        wrapper.run(q, kv, variant=SIGMOID, variant_scalars=[0.0] * 9)
