"""One rank of test_context_parallel_cuda.py's multi-GPU test, started as its own process (one process per GPU,
as serving engines run ranks): python3 context_parallel_worker.py RANK WORLD UNIQUE_ID_HEX SEED.

Every rank builds the same batch from SEED (numpy only, so the data agree across processes), runs the context-
parallel decode and prefill wrappers over its share of the pages (both partitions), eagerly and replayed from a
torch CUDA graph into NaN-poisoned outputs, and checks the merged result against the single-GPU wrapper on its
own GPU and the float64 reference. Prints 'rank R: N checks passed' and exits 0, or exits non-zero with the error.
Keeps NCCL_NVLS_ENABLE=0 (NVLink multicast stays off)."""
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import attnforge  # noqa: E402
from attnforge import distributed  # noqa: E402
from reference import assert_close, attention, paged_cache  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 10, 2, 128, 16  # a GQA group of 5
WRAPPERS = {"decode": (attnforge.BatchDecodeWithPagedKVCacheWrapper,
                       attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper),
            "prefill": (attnforge.BatchPrefillWithPagedKVCacheWrapper,
                        attnforge.ContextParallelBatchPrefillWithPagedKVCacheWrapper)}


def batch(seed, kind):
    rng = np.random.default_rng(seed)
    kv_lens = [1, 700, 0, 3001, 17, 48, 16]  # an empty request, one token, whole pages, a partial last page
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, "bfloat16")
    qo_lens = [1] * len(kv_lens) if kind == "decode" else [min(7, n) or 3 for n in kv_lens]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q64 = attnforge_round(rng.standard_normal((int(qo[-1]), HEADS, DIM)))
    ref = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k_seq[b], v_seq[b], soft_cap=30.0)[0]
                          for b in range(len(kv_lens))])
    as_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).cuda()  # noqa: E731
    return as_torch(q64), (as_torch(k_cache), as_torch(v_cache)), qo, (indptr, indices, last), ref


def attnforge_round(x):
    return torch.from_numpy(x).to(torch.bfloat16).double().numpy()


def plan(wrapper, kind, qo, table):
    common = dict(q_data_type=torch.bfloat16, logits_soft_cap=30.0)
    if kind == "decode":
        wrapper.plan(*table, HEADS, KV_HEADS, DIM, PAGE, **common)
    else:
        wrapper.plan(qo, *table, HEADS, KV_HEADS, DIM, PAGE, **common)


def main(rank, world, unique_id, seed):
    torch.cuda.set_device(rank)
    checks = 0
    with distributed.NcclCommunicator(world, rank, unique_id, device=rank) as comm:
        for kind in ("decode", "prefill"):
            q, kv, qo, table, ref = batch(seed, kind)
            single = WRAPPERS[kind][0](torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"))
            plan(single, kind, qo, table)
            expected, expected_lse = single.run(q, kv, return_lse=True)
            for partition in ("contiguous", "round_robin_pages"):
                what = f"rank {rank} of {world}, {kind}, {partition}"
                wrapper = WRAPPERS[kind][1](torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"),
                                            communicator=comm, partition=partition)
                assert (wrapper.world_size, wrapper.rank) == (world, rank), what
                plan(wrapper, kind, qo, table)
                out = torch.full_like(expected, float("nan"))
                lse = torch.full_like(expected_lse, float("nan"))
                wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
                torch.cuda.synchronize()
                for how in ("eager", "graph replay"):
                    if how == "graph replay":
                        graph_run(wrapper, q, kv, out, lse)
                    assert_close(out.float().cpu().numpy(), expected.float().cpu().numpy(), "bfloat16",
                                 f"{what} {how}: out against one GPU")
                    assert_close(lse.cpu().numpy(), expected_lse.cpu().numpy(), "float16",
                                 f"{what} {how}: lse against one GPU")
                    assert_close(out.float().cpu().numpy(), ref, "bfloat16", f"{what} {how}: out against float64")
                    checks += 3
    print(f"rank {rank}: {checks} checks passed", flush=True)


def graph_run(wrapper, q, kv, out, lse):
    """wrapper.run(q, kv) into out and lse, captured in a torch CUDA graph (NCCL's all-gather inside; warmed up on a
    side stream first, as torch asks) and replayed into NaN-poisoned outputs. Also used by
    test_context_parallel_cuda.py."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, kv, out=out, lse=lse, return_lse=True)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4]))
