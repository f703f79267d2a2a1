#!/usr/bin/env python3
"""Peers on the shapes attnforge's own benchmark just ran, in the same run on the same GPU.

Reads the JSON that `attnforge bench --json` wrote (each record carries its shape), times PyTorch SDPA (flash,
efficient and cuDNN backends, on dense Q/KV padded to the longest request, which is what SDPA users do) and
FlexAttention under torch.compile on the same shapes, and writes records in the same format: suite, case,
system, device, median_us, gbps (KV bytes of the real tokens over the median time) and, for prefill, tflops
(attnforge's count of the attended pairs' FLOPs over the median time, so the ratio is a ratio of times).
Timing: CUDA events around each call, warm-up first, median of many calls, inputs rotated so that the set of
buffers exceeds the L2 cache several times over.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

L2_BYTES = 60 * 2**20


def bench(fn, copies, warmup=5, rep=40):
    for i in range(warmup):
        fn(i % copies)
    torch.cuda.synchronize()
    times = []
    for i in range(rep):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] * 1e3  # median, microseconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON written by attnforge bench --json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    records = json.load(open(args.cases))
    dev = torch.device("cuda")
    backends = {
        "sdpa-flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    }
    try:
        import torch._dynamo as dynamo  # an alias: a plain `import torch._dynamo` here would make torch local
        dynamo.config.recompile_limit = 1000
        dynamo.config.cache_size_limit = 1000
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as ex:  # noqa: BLE001
        flex = None
        print("peers: FlexAttention unavailable:", ex, file=sys.stderr)
    try:
        from torch.nn.attention.bias import causal_lower_right
    except Exception:  # noqa: BLE001
        causal_lower_right = None

    out = []
    seen = set()
    for r in records:
        shape = r.get("shape")
        if r.get("system") != "attnforge" or r.get("suite") not in ("decode", "prefill") or not shape or r["case"] in seen:
            continue
        seen.add(r["case"])
        suite = r["suite"]
        kv_lens = shape["kv_lens"]
        batch, hq, hkv, d = len(kv_lens), shape["num_qo_heads"], shape["num_kv_heads"], shape["head_dim"]
        qo_lens = shape.get("qo_lens") or [shape.get("qo_len", 1)] * batch
        qo = max(qo_lens)
        flops = r.get("flops", 0.0)
        causal = shape.get("causal", False)
        if shape.get("kv_dtype") != "bfloat16":  # fp8 K/V: the peers here take bf16 K/V only
            print(f"peers: {r['case']}: K/V {shape.get('kv_dtype')} has no peer here (bf16 only); skipped", file=sys.stderr)
            continue
        lmax = max(kv_lens)
        kv_bytes = 2 * sum(kv_lens) * hkv * d * 2
        copies = max(1, min(16, int(3 * L2_BYTES // max(1, 2 * batch * hkv * lmax * d * 2)) + 1))
        qs = [torch.randn(batch, hq, qo, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        ks = [torch.randn(batch, hkv, lmax, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        vs = [torch.randn(batch, hkv, lmax, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        mask, is_causal = None, False
        if causal and qo > 1:
            if qo == lmax:
                is_causal = True  # square: SDPA's own causal path, which every backend takes
            elif causal_lower_right is not None:
                mask = causal_lower_right(qo, lmax)

        def add(system, us, note=""):
            rec = dict(suite=suite, case=r["case"], system=system, device=r.get("device", "cuda:0"),
                       median_us=us, gbps=kv_bytes / (us * 1e3), iters=40)
            if flops:
                rec["tflops"] = flops / (us * 1e6)
            if note:
                rec["note"] = note
            out.append(rec)
            rate = f"{flops / (us * 1e6):7.1f} TFLOP/s" if suite == "prefill" else f"{kv_bytes / (us * 1e3) / 1e3:6.2f} TB/s"
            print(f"{r['case']:34s} {system:16s} {us:10.1f} us {rate}", flush=True)

        note = "dense KV padded to the longest request" if min(kv_lens) != lmax or min(qo_lens) != qo else ""
        if causal and qo > 1 and mask is None and not is_causal:
            note = (note + "; " if note else "") + "no causal mask (causal_lower_right unavailable)"
        for name, be in backends.items():
            try:
                with torch.nn.attention.sdpa_kernel(be):
                    fn = lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], attn_mask=mask,
                                                                  is_causal=is_causal, enable_gqa=True)
                    add(name, bench(fn, copies), note)
            except Exception as ex:  # noqa: BLE001
                print(f"peers: {name} on {r['case']} failed: {type(ex).__name__}: {str(ex)[:160]}", file=sys.stderr)
        if flex is not None:
            try:
                block_mask = None
                if causal and qo > 1:
                    offset = lmax - qo  # bottom-right aligned, as attnforge and causal_lower_right

                    def causal_mod(b, h, q_idx, kv_idx):
                        return kv_idx <= q_idx + offset

                    block_mask = create_block_mask(causal_mod, None, None, qo, lmax, device=dev)
                add("flex(compiled)",
                    bench(lambda i: flex(qs[i], ks[i], vs[i], block_mask=block_mask, enable_gqa=True), copies), note)
            except Exception as ex:  # noqa: BLE001
                print(f"peers: flex on {r['case']} failed: {type(ex).__name__}: {str(ex)[:160]}", file=sys.stderr)
        qs = ks = vs = None  # free the copies before the next shape
        torch.cuda.empty_cache()
        json.dump(out, open(args.out, "w"), indent=1)  # after every shape, so a cut-short run keeps what it measured
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
