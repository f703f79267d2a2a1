#!/usr/bin/env python3
"""Issue 7's benchmark through the Python API, one process per GPU (as serving engines run ranks): decode of one
request of --kv-len tokens (default 1M; 32 query heads over 8 KV heads, head_dim 128, bf16, pages of 16 on a
shuffled page table) on 1 GPU with BatchDecodeWithPagedKVCacheWrapper and split over 2, 4 and 8 GPUs (up to
--gpus, default every visible one) with ContextParallelBatchDecodeWithPagedKVCacheWrapper over an NcclCommunicator.

Every rank builds the whole cache from the same seed on its GPU (torch's generator gives the same values on every
GPU) and plans only its share. Each step (the rank's run, the all-gather of the states, the merge) is captured in
a torch CUDA graph; a sample is --reps replays back to back between CUDA events (the all-gather in every step keeps
the ranks in lockstep), and the figure is rank 0's median over --samples samples. Before timing, every rank checks
its merged result against the single-GPU wrapper on its own GPU. Prints a table; --json writes the records.
NCCL_NVLS_ENABLE=0 is kept (NVLink multicast stays off).

usage: python3 bench/context_parallel.py [--gpus N] [--kv-len N] [--json FILE]
  (with a build tree instead of an installed package: PYTHONPATH=build/release/python)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"

QO_HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def rank_main(a):
    import numpy as np
    import torch

    import attnforge
    from attnforge import distributed

    torch.cuda.set_device(a.rank)
    pages = (a.kv_len + PAGE - 1) // PAGE
    gen = torch.Generator(device="cuda").manual_seed(7)
    k = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, QO_HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    indices = np.random.default_rng(7).permutation(pages).astype(np.int32)
    table = (np.array([0, pages], np.int32), indices, np.array([a.kv_len - (pages - 1) * PAGE], np.int32))
    workspace = lambda: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
    single = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace())
    single.plan(*table, QO_HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    expected = single.run(q, (k, v))
    comm = None
    if a.world == 1:
        wrapper, sent = single, 0
    else:
        comm = distributed.NcclCommunicator(a.world, a.rank, bytes.fromhex(a.uid), device=a.rank)
        wrapper = attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper(workspace(), communicator=comm,
                                                                              partition=a.partition)
        wrapper.plan(*table, QO_HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
        sent = wrapper.state_layout.rank_bytes
    out = torch.full_like(expected, float("nan"))
    wrapper.run(q, (k, v), out=out)
    torch.cuda.synchronize()
    err = (out.float() - expected.float()).abs().max().item()
    if not err <= 2e-2 * (1 + expected.float().abs().max().item()):
        raise SystemExit(f"rank {a.rank} of {a.world}: merged result differs from one GPU's by {err}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k, v), out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, (k, v), out=out)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    us = []
    for i in range(a.samples + 3):
        e0.record()
        for _ in range(a.reps):
            graph.replay()
        e1.record()
        e1.synchronize()
        if i >= 3:
            us.append(e0.elapsed_time(e1) * 1e3 / a.reps)
    share_tokens = int(wrapper.rank_page_table[3].sum()) if a.world > 1 else a.kv_len
    rec = {"rank": a.rank, "world_size": a.world, "partition": a.partition if a.world > 1 else "whole",
           "median_us": statistics.median(us), "kv_bytes": share_tokens * KV_HEADS * 2 * DIM * 2,
           "allgather_bytes_sent_per_rank": sent, "allgather_bytes_received_per_rank": sent * (a.world - 1),
           "max_abs_diff_vs_one_gpu": err}
    print("RESULT " + json.dumps(rec), flush=True)
    del graph
    torch.cuda.synchronize()
    if comm is not None:
        comm.destroy()


def copy_ceiling_gbps(torch):
    """Device-to-device copy of 2 GiB on cuda:0 (bytes read plus bytes written over the median of 10 copies after
    3 warm-ups): the bandwidth ceiling each rank's read is held against, measured in the same run."""
    n = 1 << 31
    src = torch.ones(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for i in range(13):
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        if i >= 3:
            ms.append(e0.elapsed_time(e1))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (statistics.median(ms) * 1e6)


def run_world(a, world, partition):
    from attnforge import distributed
    uid = distributed.nccl_unique_id().hex() if world > 1 else "00"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--world", str(world),
                               "--uid", uid, "--partition", partition, "--kv-len", str(a.kv_len), "--samples",
                               str(a.samples), "--reps", str(a.reps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    texts = []
    try:
        for p in procs:
            texts.append(p.communicate(timeout=a.timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    recs = []
    for r, (p, text) in enumerate(zip(procs, texts)):
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"world {world} rank {r} failed ({p.returncode}):\n{text[-3000:]}")
        recs.append(json.loads(lines[-1][7:]))
    return recs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="the most GPUs to split over (default: every visible one)")
    p.add_argument("--kv-len", type=int, default=1 << 20)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=int, default=240, help="seconds a world size may take")
    p.add_argument("--json", default=None)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--uid", default="", help=argparse.SUPPRESS)
    p.add_argument("--partition", default="contiguous", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank >= 0:
        return rank_main(a)
    import torch
    import attnforge
    visible = torch.cuda.device_count()
    gpus = a.gpus or min(visible, 8)
    if not 1 <= gpus <= visible:
        raise SystemExit(f"--gpus {a.gpus}: {visible} GPU(s) visible")
    worlds = [w for w in (1, 2, 4, 8) if w <= gpus] + ([gpus] if gpus not in (1, 2, 4, 8) else [])
    ceiling = copy_ceiling_gbps(torch)
    rows = []
    for world in worlds:
        for partition in (["contiguous"] if world == 1 else ["contiguous", "round_robin_pages"]):
            recs = run_world(a, world, partition)
            rows.append(dict(recs[0], kv_bytes=max(r["kv_bytes"] for r in recs),
                             rank_medians_us=[r["median_us"] for r in recs]))
            print(f"  {world} GPU(s) {partition}: {recs[0]['median_us']:.1f} us", file=sys.stderr, flush=True)
    one = rows[0]["median_us"]
    name = torch.cuda.get_device_name(0)
    print(f"attnforge context-parallel decode, Python API, one process per GPU: {attnforge.build_info()}")
    print(f"devices: {gpus} x {name}; decode 1x{a.kv_len} (32 query heads over 8 KV heads, head_dim 128, bf16, "
          f"pages of {PAGE})")
    print(f"ceiling device-to-device copy (cuda:0): {ceiling / 1e3:.2f} TB/s (read + write)")
    print(f"{'GPUs':>5} {'partition':<19} {'median_us':>10} {'speedup':>8} {'TB/s per GPU':>13} {'% of copy':>10} "
          f"{'sent/rank':>10} {'recv/rank':>10}")
    for r in rows:
        gbps = r["kv_bytes"] / r["median_us"] / 1e3
        r.update(speedup_vs_1=one / r["median_us"], device=name, gbps_per_gpu=gbps, ceiling=ceiling,
                 pct_of_ceiling=gbps / ceiling * 100, suite="long", system="attnforge",
                 case=f"decode 1x{a.kv_len} on {r['world_size']} GPU(s), python")
        print(f"{r['world_size']:>5} {r['partition']:<19} {r['median_us']:>10.1f} {r['speedup_vs_1']:>7.2f}x "
              f"{gbps / 1e3:>13.3f} {r['pct_of_ceiling']:>9.1f}% {r['allgather_bytes_sent_per_rank']:>8} B "
              f"{r['allgather_bytes_received_per_rank']:>8} B")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
