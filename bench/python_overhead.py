#!/usr/bin/env python3
"""Python overhead of BatchDecodeWithPagedKVCacheWrapper.run() per call, above the same C++ call.

A tiny decode (one request, a few KV tokens) is run in bursts of --burst calls three ways, timed on the host:
  python, out given   wrapper.run(q, (k, v), out=out): conversion of the arrays, options, the C++ call
  python, allocating  wrapper.run(q, (k, v)): the same plus allocating the output in the caller's framework
  C++ loop            the same attnforge::run called --burst times from C++ with the arrays converted once
The overhead is the difference of the medians (target: 5 us or less). On CUDA, work is only queued during a burst
(bursts stay below the launch queue's depth) and the device is synchronized between bursts, outside the timing.

usage: python3 bench/python_overhead.py [--device cpu|cuda] [--framework numpy|torch] [--json FILE] [--breakdown]
  (with a build tree instead of an installed package: PYTHONPATH=build/release/python)
"""
import argparse
import json
import statistics
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--framework", default=None, choices=["numpy", "torch"], help="default: numpy on cpu, torch on cuda")
    p.add_argument("--kv-len", type=int, default=16)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("QO", "KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the pieces of run(): the extension call with the stream given, the stream lookup, "
                        "the tracing test, the output's allocation (and torch's own allocation calls alone)")
    a = p.parse_args()
    framework = a.framework or ("torch" if a.device == "cuda" else "numpy")

    import attnforge

    page, qo_heads, kv_heads, dim = 16, a.heads[0], a.heads[1], a.head_dim
    pages = (a.kv_len + page - 1) // page
    indptr = np.array([0, pages], np.int32)
    indices = np.arange(pages, dtype=np.int32)
    last = np.array([a.kv_len - (pages - 1) * page], np.int32)
    rng = np.random.default_rng(0)
    if framework == "numpy":
        import ml_dtypes
        dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[a.dtype]
        make = lambda *shape: rng.standard_normal(shape).astype(dt)  # noqa: E731
        workspace = np.zeros(64 << 20, np.uint8)
        sync = lambda: None  # noqa: E731
    else:
        import torch
        dev = torch.device(a.device)
        make = lambda *shape: torch.randn(*shape, dtype=getattr(torch, a.dtype), device=dev)  # noqa: E731
        workspace = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    k, v = make(pages, page, kv_heads, dim), make(pages, page, kv_heads, dim)
    q = make(1, qo_heads, dim)

    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, qo_heads, kv_heads, dim, page, q_data_type=a.dtype)
    out = wrapper.run(q, (k, v))
    stream = 0
    if framework == "torch" and a.device == "cuda":
        import torch
        stream = torch.cuda.current_stream().cuda_stream

    def burst_python_out():
        t0 = time.perf_counter()
        for _ in range(a.burst):
            wrapper.run(q, (k, v), out=out)
        return time.perf_counter() - t0

    def burst_python_alloc():
        t0 = time.perf_counter()
        for _ in range(a.burst):
            wrapper.run(q, (k, v))
        return time.perf_counter() - t0

    def burst_cpp():
        return wrapper._impl.time_cpp_run(q, k, v, out, None, stream, a.burst)

    def timed(call):  # a burst of one piece of run()
        def burst():
            t0 = time.perf_counter()
            for _ in range(a.burst):
                call()
            return time.perf_counter() - t0
        return burst

    from attnforge import _arrays, _torch
    pieces = (("python, out given", burst_python_out), ("python, allocating", burst_python_alloc),
              ("C++ loop", burst_cpp))
    if a.breakdown:
        impl, index = wrapper._impl, wrapper._device_index
        pieces += (("extension run(), stream given", timed(lambda: impl.run(q, k, v, out, None, stream, None, None,
                                                                            None, None, None, None, None))),)
        if a.device == "cuda":  # run() looks the stream up on CUDA only
            pieces += (("stream lookup", timed(lambda: _arrays.current_stream(q, index))),)
        pieces += (("tracing test", timed(lambda: _torch.tracing())), ("empty Python call", timed(lambda: None)))
        # What run() spends allocating its output: attnforge's allocator, and the framework's own call alone.
        shape = tuple(out.shape)
        pieces += (("output allocation (attnforge)", timed(lambda: _arrays.empty(q, shape))),)
        if framework == "torch":
            import torch
            pieces += (("torch.empty alone", timed(lambda: torch.empty(shape, dtype=q.dtype, device=q.device))),
                       ("q.new_empty alone", timed(lambda: q.new_empty(shape))))
    figures = {}
    for name, burst in pieces:
        for _ in range(3):  # warm-up
            burst()
            sync()
        times = []
        for _ in range(a.repeats):
            times.append(burst() / a.burst * 1e6)
            sync()
        figures[name] = statistics.median(times)

    overhead = figures["python, out given"] - figures["C++ loop"]
    overhead_alloc = figures["python, allocating"] - figures["C++ loop"]
    reader = attnforge._C.torch_reader_status() if framework == "torch" else None
    print(f"attnforge {attnforge.__version__}: decode 1 x {a.kv_len} tokens, {qo_heads}/{kv_heads} heads, "
          f"d {dim}, {a.dtype}, {framework} on {a.device}; median of {a.repeats} bursts of {a.burst} calls")
    if reader:
        print(f"  torch tensors read through: {reader}")
    for name, us in figures.items():
        print(f"  {name:30s} {us:8.2f} us per call")
    print(f"  overhead of run() above the C++ call: {overhead:.2f} us with out= given, {overhead_alloc:.2f} us "
          f"allocating the output (target: 5 us or less)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "framework": framework, "kv_len": a.kv_len, "heads": a.heads,
                       "head_dim": dim, "dtype": a.dtype, "per_call_us": figures, "overhead_us": overhead,
                       "overhead_allocating_us": overhead_alloc, "torch_reader": reader,
                       "build": attnforge.build_info()}, f, indent=1)


if __name__ == "__main__":
    main()
