"""Context parallelism over a real NCCL communicator: of one rank, and of 2, 4 and 8 ranks, one process per GPU
(test_ranks_on_separate_gpus; skipped when fewer GPUs are visible): the context-parallel wrappers' run() (rank's
run, in-place all-gather, merge), eagerly
and replayed from a torch CUDA graph, against the single-GPU wrapper and the float64 reference; an ncclComm_t
passed as an int. Skipped without torch, a GPU, a CUDA build of attnforge or NCCL (libnccl.so.2 or
ATTNFORGE_NCCL_LIBRARY; scripts/device-check points it at PyTorch's and sets NCCL_NVLS_ENABLE=0)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnforge  # noqa: E402
from attnforge import distributed  # noqa: E402
from context_parallel_worker import graph_run  # noqa: E402
from reference import assert_close, attention, paged_cache  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (before NCCL reads its environment)
HEADS, KV_HEADS, DIM, PAGE = 8, 2, 128, 16


def _nccl_missing():
    if not (torch.cuda.is_available() and attnforge.cuda_available()):
        return "needs a GPU and attnforge built with CUDA"
    try:
        distributed.nccl_unique_id()
    except attnforge.Error as e:
        return f"NCCL not usable: {e}"
    return None


_MISSING = _nccl_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="module")
def communicator():
    with distributed.NcclCommunicator(1, 0, distributed.nccl_unique_id(), device=torch.cuda.current_device()) as c:
        yield c


def _case(rng, kind, kv_lens):
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM,
                                                                        "bfloat16")
    qo_lens = [1] * len(kv_lens) if kind == "decode" else [min(5, n) or 2 for n in kv_lens]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = torch.randn(int(qo[-1]), HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    q64 = q.double().cpu().numpy()
    as_torch = lambda a: torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()  # noqa: E731
    ref = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k_seq[b], v_seq[b], soft_cap=20.0)[0]
                          for b in range(len(kv_lens))])
    return q, (as_torch(k_cache), as_torch(v_cache)), qo, (indptr, indices, last), ref


def _plan(wrapper, kind, qo, table):
    if kind == "decode":
        wrapper.plan(*table, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16, logits_soft_cap=20.0)
    else:
        wrapper.plan(qo, *table, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16, logits_soft_cap=20.0)


def _workspace():
    return torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")


WRAPPERS = {"decode": (attnforge.BatchDecodeWithPagedKVCacheWrapper,
                       attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper),
            "prefill": (attnforge.BatchPrefillWithPagedKVCacheWrapper,
                        attnforge.ContextParallelBatchPrefillWithPagedKVCacheWrapper)}


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_one_rank_eager_and_cuda_graph(rng, communicator, kind):
    q, kv, qo, table, ref = _case(rng, kind, [700, 5, 0, 3000, 17])
    single = WRAPPERS[kind][0](_workspace())
    _plan(single, kind, qo, table)
    expected, expected_lse = single.run(q, kv, return_lse=True)
    wrapper = WRAPPERS[kind][1](_workspace(), communicator=communicator)
    assert (wrapper.world_size, wrapper.rank) == (1, 0)
    _plan(wrapper, kind, qo, table)
    out, lse = wrapper.run(q, kv, return_lse=True)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.device == q.device
    assert_close(out.float().cpu().numpy(), expected.float().cpu().numpy(), "bfloat16")
    assert_close(lse.cpu().numpy(), expected_lse.cpu().numpy(), "float16", "lse")
    assert_close(out.float().cpu().numpy(), ref, "bfloat16")

    # Captured in a torch CUDA graph (warmed up on a side stream first, as torch asks), replayed into poisoned
    # outputs.
    out_g = torch.empty_like(out)
    lse_g = torch.empty_like(lse)
    graph_run(wrapper, q, kv, out_g, lse_g)
    assert_close(out_g.float().cpu().numpy(), expected.float().cpu().numpy(), "bfloat16")
    assert_close(lse_g.cpu().numpy(), expected_lse.cpu().numpy(), "float16", "lse")


def test_raw_communicator_handle_and_checks(rng, communicator):
    q, kv, qo, table, ref = _case(rng, "decode", [40, 1, 333])
    wrapper = attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper(
        _workspace(), communicator=communicator.handle, partition="contiguous")
    assert (wrapper.world_size, wrapper.rank) == (1, 0)
    _plan(wrapper, "decode", qo, table)
    out = wrapper.run(q, kv)
    torch.cuda.synchronize()
    assert_close(out.float().cpu().numpy(), ref, "bfloat16")
    with pytest.raises(attnforge.InvalidArgumentError, match="world_size: 2; the communicator has world_size 1"):
        attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper(_workspace(), communicator=communicator,
                                                                    world_size=2)
    with pytest.raises(attnforge.UnsupportedError, match="^sinks: not supported"):
        wrapper.run(q, kv, sinks=torch.zeros(HEADS, device="cuda"))
    with pytest.raises(attnforge.InvalidArgumentError, match=r"rank: 1; expected in \[0, 1\)"):
        distributed.NcclCommunicator(1, 1, distributed.nccl_unique_id())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_on_separate_gpus(world):
    """world ranks, one process and one GPU each (context_parallel_worker.py), over an NcclCommunicator made from
    one unique id: decode and prefill, both partitions, eager and CUDA graph, against one GPU and float64."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs; {torch.cuda.device_count()} visible")
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    uid = distributed.nccl_unique_id().hex()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    workers = [subprocess.Popen([sys.executable, os.path.join(here, "context_parallel_worker.py"), str(r), str(world),
                                 uid, "1234"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for r in range(world)]
    outputs = []
    try:
        for w in workers:
            outputs.append(w.communicate(timeout=120)[0])
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for r, (w, text) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0, f"rank {r} of {world} exited with {w.returncode}:\n{text[-3000:]}"
        assert f"rank {r}: 24 checks passed" in text, text[-3000:]
