#!/usr/bin/env python3
"""FlashInfer on the shapes attnforge's own benchmark just ran, in the same run on the same GPU.

Reads the JSON that `attnforge bench --json` wrote (each record carries its shape) and times FlashInfer's
wrappers on the same shapes, the way a serving engine calls them: a paged KV cache (NHD, the record's page size,
pages shuffled), plan() once per input copy outside the timing, run() timed. Records are written in the format of
bench/peers.py: suite, case, system, device, median_us, gbps (KV bytes of the real tokens over the median time)
and, for prefill, tflops (attnforge's FLOP count over the median time, so the ratio is a ratio of times).

Systems:
  flashinfer          decode: BatchDecodeWithPagedKVCacheWrapper (CUDA-core decode kernel, FlashInfer's default);
                      prefill: BatchPrefillWith{Paged,Ragged}KVCacheWrapper with backend fa3 (what auto picks on sm90)
  flashinfer-tc       decode with use_tensor_cores=True (the fa2 prefill kernels)
  flashinfer-fa2      prefill with backend fa2
  flashinfer-graph    one run() captured in a CUDA graph per copy, single replays timed (records with graph_us)
  flashinfer-chain    records with chain_us: max(copies, 16) runs (rotating copies) in one graph, one replay, per call
                      (attnforge's chain_us method)
  flashinfer-graph32  the 1x2048 decode shape only: 32 runs (rotating copies) in one graph, one replay, per call
Decode records whose requests have more than one query row go through the paged prefill wrappers (noted).

Timing: CUDA events around each call, warm-up first, median of 40 calls, inputs rotated so that the set of
buffers exceeds the 60 MiB L2 cache three times over (bench/peers.py's method). Each measured configuration is
checked once against a float64 computation on a few of its requests; the max abs error is printed.

FlashInfer's kernels are JIT modules. scripts/peers-flashinfer installs the carried wheels and prebuilt sm_90a
modules and sets FLASHINFER_DISABLE_JIT=1, so a module that was not prebuilt fails with a message (that system
is skipped) instead of compiling for minutes on the GPU machine.
"""
import argparse
import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import L2_BYTES, bench  # noqa: E402  (the same timing as the other peers)

FLOAT_WS_BYTES = 256 * 2**20
CHECK_REQUESTS = 3
CHECK_TOL = 2e-2


def err(msg):
    print(f"peers-flashinfer: {msg}", file=sys.stderr, flush=True)


def describe(ex):
    s = f"{type(ex).__name__}: {str(ex).strip().splitlines()[0] if str(ex).strip() else ''}"
    return s[:300]


class Paged:
    """One copy of a paged KV cache with a shuffled page table (NHD)."""

    def __init__(self, kv_lens, page, hkv, d, dev, gen):
        npages = [(n + page - 1) // page for n in kv_lens]
        total = sum(npages)
        self.k = torch.randn(total, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        self.v = torch.randn(total, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        self.indices = torch.randperm(total, device=dev, generator=gen).to(torch.int32)
        indptr = [0]
        for n in npages:
            indptr.append(indptr[-1] + n)
        self.indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
        self.last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, npages)],
                                 dtype=torch.int32, device=dev)
        self.page = page
        self.kv_lens = kv_lens

    def dense(self, b):
        """K, V of request b, [kv_len, hkv, d]."""
        pages = self.indices[self.indptr[b]:self.indptr[b + 1]].long()
        n = self.kv_lens[b]
        k = self.k[pages].reshape(-1, *self.k.shape[2:])[:n]
        v = self.v[pages].reshape(-1, *self.v.shape[2:])[:n]
        return k, v


def reference(q, k, v, rows, qo, causal):
    """q [len(rows), hq, d]: rows `rows` of a request with qo query rows; k/v [kv, hkv, d]; float64; causal
    aligned bottom-right (query row i sees keys 0 .. kv - qo + i, as attnforge and FlashInfer)."""
    hq, d = q.shape[1], q.shape[2]
    kv, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    q = q.double()
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    if causal and qo > 1:
        qi = torch.tensor(rows, device=q.device)[:, None] + (kv - qo)
        ki = torch.arange(kv, device=q.device)[None, :]
        s = s.masked_fill(ki > qi, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def check(out, q, qo_indptr, kv_of, causal, batch):
    """Max abs error of out against float64 on up to CHECK_REQUESTS requests (first, middle, last), at most 16
    query rows of each (the first 8 and the last 8)."""
    worst = 0.0
    for b in sorted({0, batch // 2, batch - 1})[:CHECK_REQUESTS]:
        lo, hi = qo_indptr[b], qo_indptr[b + 1]
        k, v = kv_of(b)
        qo = hi - lo
        if qo == 0 or k.shape[0] == 0:
            continue
        rows = sorted(set(range(min(qo, 8))) | set(range(max(0, qo - 8), qo)))
        idx = torch.tensor([lo + i for i in rows], device=q.device)
        ref = reference(q[idx], k, v, rows, qo, causal)
        worst = max(worst, (out[idx].double() - ref).abs().max().item())
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON written by attnforge bench --json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated substrings: measure only cases containing one")
    ap.add_argument("--no-prefill", action="store_true", help="decode records only")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests of this script's logic only
    args = ap.parse_args()
    records = json.load(open(args.cases))
    out = []
    json.dump(out, open(args.out, "w"), indent=1)
    try:
        import flashinfer
        from flashinfer.jit import env as fi_env
    except Exception as ex:  # noqa: BLE001
        err(f"import flashinfer failed: {describe(ex)}")
        traceback.print_exc()
        sys.exit(1)
    dev = torch.device(args.device)
    print(f"flashinfer {flashinfer.__version__} on {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"prebuilt modules in {fi_env.FLASHINFER_AOT_DIR}; FLASHINFER_DISABLE_JIT="
          f"{os.environ.get('FLASHINFER_DISABLE_JIT', '')}", flush=True)
    fws = torch.empty(FLOAT_WS_BYTES, dtype=torch.uint8, device=dev)  # shared: runs are serialized on one stream
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    only = [s for s in args.only.split(",") if s]

    seen = set()
    for r in records:
        shape = r.get("shape")
        if r.get("system") != "attnforge" or r.get("suite") not in ("decode", "prefill") or not shape or r["case"] in seen:
            continue
        if only and not any(s in r["case"] for s in only):
            continue
        seen.add(r["case"])
        try:
            measure(r, shape, dev, gen, fws, out, args, flashinfer)
        except Exception as ex:  # noqa: BLE001
            err(f"{r['case']}: failed: {describe(ex)}")
            traceback.print_exc()
        json.dump(out, open(args.out, "w"), indent=1)  # after every shape, so a cut-short run keeps what it measured
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as ex:  # noqa: BLE001  (a sticky CUDA error: nothing after it can be trusted)
            err(f"CUDA is unusable after {r['case']}: {describe(ex)}; stopping with {len(out)} records")
            sys.exit(1)
    json.dump(out, open(args.out, "w"), indent=1)
    print(f"peers-flashinfer: {len(out)} records written to {args.out}", flush=True)


def measure(r, shape, dev, gen, fws, out, args, flashinfer):
    suite, case = r["suite"], r["case"]
    kv_lens = [int(x) for x in shape["kv_lens"]]
    batch, hq, hkv, d = len(kv_lens), shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"]
    qo_lens = [int(x) for x in (shape.get("qo_lens") or [shape.get("qo_len", 1)] * batch)]
    causal = bool(shape.get("causal", False))
    page = int(shape.get("page_size") or 16)
    flops = r.get("flops", 0.0)
    detail = r.get("detail", "")
    ragged = " ragged " in f" {detail} " or "ragged" in case
    if shape.get("kv_dtype") != "bfloat16":
        err(f"{case}: K/V {shape.get('kv_dtype')} has no peer here (bf16 only); skipped")
        return
    if suite == "prefill" and args.no_prefill:
        return
    decode_like = suite == "decode" and max(qo_lens) == 1
    if not decode_like and args.no_prefill:
        err(f"{case}: qo_len {max(qo_lens)} > 1 needs the prefill wrappers (--no-prefill); skipped")
        return
    kv_bytes = 2 * sum(kv_lens) * hkv * d * 2
    q_bytes = sum(qo_lens) * hq * d * 2 * 2  # q and out
    copies = max(1, min(16, int(3 * L2_BYTES // max(1, kv_bytes + q_bytes)) + 1))
    qo_indptr_h = [0]
    for n in qo_lens:
        qo_indptr_h.append(qo_indptr_h[-1] + n)
    total_q = qo_indptr_h[-1]
    qo_indptr = torch.tensor(qo_indptr_h, dtype=torch.int32, device=dev)

    # inputs: copies of q, out and the KV (paged, or ragged for ragged records)
    qs = [torch.randn(total_q, hq, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    os_ = [torch.empty(total_q, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    if ragged:
        kv_indptr_h = [0]
        for n in kv_lens:
            kv_indptr_h.append(kv_indptr_h[-1] + n)
        kv_indptr = torch.tensor(kv_indptr_h, dtype=torch.int32, device=dev)
        ks = [torch.randn(kv_indptr_h[-1], hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
              for _ in range(copies)]
        vs = [torch.randn(kv_indptr_h[-1], hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
              for _ in range(copies)]

        def kv_of(i):
            return lambda b: (ks[i][kv_indptr_h[b]:kv_indptr_h[b + 1]], vs[i][kv_indptr_h[b]:kv_indptr_h[b + 1]])
    else:
        caches = [Paged(kv_lens, page, hkv, d, dev, gen) for _ in range(copies)]

        def kv_of(i):
            return caches[i].dense

    def add(system, us, note="", worst=None):
        rec = dict(suite=suite, case=case, system=system, device=r.get("device", "cuda:0"),
                   median_us=us, gbps=kv_bytes / (us * 1e3), iters=40)
        if flops:
            rec["tflops"] = flops / (us * 1e6)
        if worst is not None:
            rec["max_abs_err"] = worst
        if note:
            rec["note"] = note
        out.append(rec)
        rate = f"{flops / (us * 1e6):7.1f} TFLOP/s" if suite == "prefill" else f"{kv_bytes / (us * 1e3) / 1e3:6.2f} TB/s"
        e = f"  err {worst:.1e}" if worst is not None else ""
        print(f"{case:34s} {system:18s} {us:10.1f} us {rate}{e}", flush=True)

    def checked(system, fn):
        """Run copy 0 once and compare with float64; returns the error (and warns when it is large)."""
        fn(0)
        torch.cuda.synchronize()
        worst = check(os_[0], qs[0], qo_indptr_h, kv_of(0), causal, batch)
        if not worst < CHECK_TOL:
            err(f"{case}: {system}: CHECK FAILED: max abs error {worst:.3g} against float64 (tolerance {CHECK_TOL})")
        return worst

    def make_decode(use_tc, graph=False):
        ws = []
        for i in range(copies):
            c = caches[i]
            if graph:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    fws, "NHD", use_cuda_graph=True, use_tensor_cores=use_tc,
                    paged_kv_indptr_buffer=torch.empty_like(c.indptr),
                    paged_kv_indices_buffer=torch.empty_like(c.indices),
                    paged_kv_last_page_len_buffer=torch.empty_like(c.last))
            else:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fws, "NHD", use_tensor_cores=use_tc)
            w.plan(c.indptr, c.indices, c.last, hq, hkv, d, page, pos_encoding_mode="NONE",
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ws.append(w)
        return lambda i: ws[i].run(qs[i], (caches[i].k, caches[i].v), out=os_[i])

    def make_prefill(backend):
        ws = []
        for i in range(copies):
            if ragged:
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(fws, "NHD", backend=backend)
                w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            else:
                c = caches[i]
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(fws, "NHD", backend=backend)
                w.plan(qo_indptr, c.indptr, c.indices, c.last, hq, hkv, d, page, causal=causal,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ws.append(w)
        if ragged:
            return lambda i: ws[i].run(qs[i], ks[i], vs[i], out=os_[i])
        return lambda i: ws[i].run(qs[i], (caches[i].k, caches[i].v), out=os_[i])

    def attempt(system, build, note=""):
        try:
            fn = build()
            worst = checked(system, fn)
            us = bench(fn, copies)
            add(system, us, note, worst)
            return fn
        except Exception as ex:  # noqa: BLE001
            err(f"{case}: {system} failed: {describe(ex)}")
            return None

    if decode_like:
        attempt("flashinfer", lambda: make_decode(False))
        attempt("flashinfer-tc", lambda: make_decode(True), "use_tensor_cores=True")
        if r.get("graph_us") is not None:
            try:
                fn = make_decode(False, graph=True)
                worst = checked("flashinfer-graph", fn)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):  # warm-up outside capture, as CUDA graph capture wants
                    for i in range(copies):
                        fn(i)
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                graphs = []
                for i in range(copies):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn(i)
                    graphs.append(g)
                us = bench(lambda i: graphs[i].replay(), copies)
                add("flashinfer-graph", us, "one run() per CUDA graph, single replays", worst)
                graphs = None
                chains = []
                if r.get("chain_us") is not None:  # attnforge's chain_us: max(copies, 16) calls in one graph
                    chains.append(("flashinfer-chain", max(copies, 16)))
                if batch == 1 and kv_lens[0] == 2048:
                    chains.append(("flashinfer-graph32", 32))
                for system, n in chains:
                    gc = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gc):
                        for j in range(n):
                            fn(j % copies)
                    us_n = bench(lambda i: gc.replay(), 1)
                    add(system, us_n / n, f"{n} run() calls (rotating {copies} copies) in one CUDA graph, one replay, "
                        "per call", worst)
                    del gc
            except Exception as ex:  # noqa: BLE001
                err(f"{case}: flashinfer-graph failed: {describe(ex)}")
    else:
        note = "" if suite == "prefill" else "qo_len > 1: BatchPrefillWithPagedKVCacheWrapper"
        what = ("ragged" if ragged else "paged") + " prefill wrapper"
        attempt("flashinfer", lambda: make_prefill("fa3"), (note + "; " if note else "") + f"{what}, backend fa3")
        attempt("flashinfer-fa2", lambda: make_prefill("fa2"), (note + "; " if note else "") + f"{what}, backend fa2")


if __name__ == "__main__":
    main()
