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


def test_variants_on_cuda_match_the_cpu_run(rng):
    """The same variants in the CUDA decode and prefill kernels (NVRTC), bf16 on a side torch stream, against the
    CPU run of the same definitions on the same (bf16-held) values; the tolerance covers the P weights the tensor
    cores read in bf16."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    heads, kv_heads, dim, page = 8, 2, 128, 16
    kv_lens, qo_lens = [40, 1, 300], [3, 1, 17]
    k_cache, v_cache, indptr, indices, last, _, _ = paged_cache(rng, kv_lens, page, kv_heads, dim, "float32", "NHD")
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qo_indptr[-1]), heads, dim)).astype(np.float32)
    bias = np.linspace(-0.5, 0.5, heads).astype(np.float32)
    as_bf16 = [torch.from_numpy(x).to(torch.bfloat16) for x in (q, k_cache, v_cache)]
    q_cpu, k_cpu, v_cpu = [x.float().numpy() for x in as_bf16]
    q_gpu, k_gpu, v_gpu = [x.cuda() for x in as_bf16]
    side = torch.cuda.Stream()
    for kind in ("decode", "prefill"):
        rows = len(kv_lens) if kind == "decode" else int(qo_indptr[-1])
        outs = {}
        for device in ("cpu", "cuda"):
            on_gpu = device == "cuda"
            ws = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda") if on_gpu else np.zeros(64 << 20, np.uint8)
            dtype = "bfloat16" if on_gpu else "float32"
            if kind == "decode":
                w = attnforge.BatchDecodeWithPagedKVCacheWrapper(ws)
                w.plan(indptr, indices, last, heads, kv_heads, dim, page, q_data_type=dtype, o_data_type="float32",
                       disable_split_kv=True)
            else:
                w = attnforge.BatchPrefillWithPagedKVCacheWrapper(ws)
                w.plan(qo_indptr, indptr, indices, last, heads, kv_heads, dim, page, q_data_type=dtype,
                       o_data_type="float32", disable_split_kv=True)
            qq = (q_gpu if on_gpu else q_cpu)[:rows]
            kv = (k_gpu, v_gpu) if on_gpu else (k_cpu, v_cpu)
            b = torch.from_numpy(bias).cuda() if on_gpu else bias
            if on_gpu:
                with torch.cuda.stream(side):
                    res = [w.run(qq, kv, variant=SIGMOID, variant_scalars=[-1.5]),
                           w.run(qq, kv, variant=HEAD_BIAS, variant_tensors=[b])]
                side.synchronize()
                res = [r.cpu().numpy() for r in res]
            else:
                res = [w.run(qq, kv, variant=SIGMOID, variant_scalars=[-1.5]),
                       w.run(qq, kv, variant=HEAD_BIAS, variant_tensors=[b])]
            outs[device] = res
        for name, got, want in zip(("sigmoid", "head bias"), outs["cuda"], outs["cpu"]):
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(want).max())),
                                       err_msg=f"{kind} {name}")
