"""torch tensors in and out (CPU and CUDA), the current stream, CUDA-graph capture and torch.compile.
Skipped without torch; the CUDA tests need a GPU and a build of attnforge with CUDA (scripts/device-check)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnforge as flashinfer  # noqa: E402
from reference import assert_close, attention, paged_cache  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 128, 16
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer.cuda_available()),
                          reason="needs a GPU and attnforge built with CUDA")


def _case(rng, kv_lens, device, dtype=torch.bfloat16):
    name = str(dtype).split(".")[1]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, name)
    q64 = rng.standard_normal((len(kv_lens), HEADS, DIM))
    q = torch.tensor(q64, dtype=dtype, device=device)
    q64 = q.float().cpu().double().numpy()
    as_torch = lambda a: torch.from_numpy(a.astype(np.float32)).to(dtype).to(device)  # noqa: E731
    ref = np.concatenate([attention(q64[b:b + 1], k_seq[b], v_seq[b])[0] for b in range(len(kv_lens))])
    meta = [torch.from_numpy(x) for x in (indptr, indices, last)]  # host metadata: plan() never synchronizes
    return q, (as_torch(k_cache), as_torch(v_cache)), meta, ref


def _wrapper(device, **kwargs):
    workspace = torch.zeros(32 << 20, dtype=torch.uint8, device=device)
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)


def _to_numpy(t):
    return t.float().cpu().numpy()


def test_torch_cpu_tensors(rng):
    q, kv, meta, ref = _case(rng, [1, 17, 0, 40], "cpu")
    wrapper = _wrapper("cpu")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, kv, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(_to_numpy(out), ref, "bfloat16")


def test_torch_compile_fullgraph_cpu(rng):
    q, kv, meta, ref = _case(rng, [5, 33], "cpu")
    wrapper = _wrapper("cpu")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    compiled = torch.compile(lambda x: wrapper.run(x, kv) * 2, fullgraph=True, backend="aot_eager")
    assert_close(_to_numpy(compiled(q)) / 2, ref, "bfloat16")


@cuda
def test_cuda_decode_against_reference(rng):
    q, kv, meta, ref = _case(rng, [1, 17, 0, 300, 45], "cuda")
    wrapper = _wrapper("cuda")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, kv, return_lse=True)
    torch.cuda.synchronize()
    assert out.device.type == "cuda"
    assert_close(_to_numpy(out), ref, "bfloat16")
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()  # the empty request


@cuda
def test_cuda_runs_on_the_current_stream(rng):
    q, kv, meta, ref = _case(rng, [700, 3], "cuda")
    wrapper = _wrapper("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
        out = wrapper.run(q, kv)
    side.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")


@cuda
def test_cuda_graph_replays_a_replan(rng):
    q, kv, meta, ref = _case(rng, [40, 9, 300, 1], "cuda")
    wrapper = _wrapper("cuda", use_cuda_graph=True)
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        wrapper.run(q, kv, out=out)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, kv, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")
    # Same batch size, other lengths and page table (a pool of the same size, the graph holds its address):
    # plan() again, replay the same graph.
    q2, kv2, meta2, ref2 = _case(rng, [300, 40, 1, 9], "cuda")
    q.copy_(q2)
    kv[0].copy_(kv2[0])
    kv[1].copy_(kv2[1])
    wrapper.plan(*meta2, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref2, "bfloat16")
    _, _, meta3, _ = _case(rng, [5, 6], "cuda")
    with pytest.raises(flashinfer.InvalidArgumentError, match="CUDA-graph mode"):
        wrapper.plan(*meta3, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)


@cuda
def test_cuda_compile_fullgraph(rng):
    q, kv, meta, ref = _case(rng, [77, 5], "cuda")
    wrapper = _wrapper("cuda")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    compiled = torch.compile(lambda x: wrapper.run(x, kv, return_lse=True), fullgraph=True, backend="aot_eager")
    out, lse = compiled(q)
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")


@cuda
def test_cuda_errors(rng):
    q, kv, meta, ref = _case(rng, [4, 4], "cuda")
    small = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(256, dtype=torch.uint8, device="cuda"))
    with pytest.raises(flashinfer.WorkspaceError, match=r"float_workspace_buffer: \d+ usable bytes.*needs \d+"):
        small.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
    with pytest.raises(flashinfer.UnsupportedError, match="head_dim 96/96"):
        prefill.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), HEADS,
                     KV_HEADS, 96, q_data_type=torch.bfloat16)
