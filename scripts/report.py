#!/usr/bin/env python3
"""Combines attnforge's benchmark JSON and the peers' JSON (same run, same shapes) into a markdown table with
the achieved bandwidth, its share of the copy bandwidth measured in the same run, and the ratio to each peer."""
import datetime
import json
import sys


# A peer timed as one call in a CUDA graph, or as a call's share of a graph of many, is held against attnforge's
# figure of the same method (graph_us, chain_us); every other peer against the plain median.
def ours_for(system, r):
    if system.endswith("-graph"):
        return r.get("graph_us")
    if system.endswith("-chain"):
        return r.get("chain_us")
    if system.endswith("-graph32"):
        return None  # 32 calls in one graph: no attnforge figure of that count
    return r["median_us"]


def main():
    ours = json.load(open(sys.argv[1]))
    peers = []
    for path in sys.argv[2:]:  # one or more peers files (bench/peers.py, bench/peers_flashinfer.py)
        try:
            peers += json.load(open(path))
        except FileNotFoundError:
            pass
    header = [r for r in ours if r.get("system") == "ceiling"]
    # A title naming the device, the commit and the day, so a record copied under bench/results says where it came
    # from (the bench JSON carries the first two; the report is made in the same call as the run).
    first = ours[0] if ours else {}
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    lines = [f"# attnforge bench on {first.get('device', 'an unknown device')}, commit {first.get('commit', 'unknown')}, "
             f"{day} (UTC)", ""]
    for c in header:
        if "tflops" in c:
            lines.append(f"- ceiling {c['case']}: {c['tflops']:.0f} TFLOP/s")
        else:
            unit = "GB/s" if "gbps" in c else "GFLOP/s"
            lines.append(f"- ceiling {c['case']}: {c.get('gbps', c.get('gflops')):.0f} {unit}")
    by_case = {}
    for p in peers:
        by_case.setdefault(p["case"], {})[p["system"]] = p
    systems = sorted({p["system"] for p in peers})
    lines.append("")
    lines.append("| suite | case | device | median us | TB/s or TFLOP/s | % ceiling | " +
                 " | ".join(f"x vs {s}" for s in systems) + " |")
    lines.append("|" + "---|" * (6 + len(systems)))
    for r in ours:
        if r.get("system") != "attnforge":
            continue
        # decode: TB/s of K/V; prefill: TFLOP/s; the CPU suite: GB/s or GFLOP/s, shown in thousands
        rate = r["tflops"] if r.get("suite") == "prefill" and "tflops" in r else r.get("gbps", r.get("gflops", 0)) / 1e3
        ratios = []
        for s in systems:
            p = by_case.get(r["case"], {}).get(s)
            mine = ours_for(s, r) if p else None
            ratios.append(f"{p['median_us'] / mine:.2f}" if mine else "-")
        lines.append(f"| {r['suite']} | {r['case']} | {r['device']} | {r['median_us']:.1f} | {rate:.3f} | "
                     f"{r.get('pct_of_ceiling', 0):.0f}% | " + " | ".join(ratios) + " |")
    lines.append("")
    lines.append("Ratios are peer time / attnforge time on the same shapes in the same run (above 1: attnforge faster); "
                 "a peer's -graph and -chain figures against attnforge's graph_us and chain_us.")
    # fp8 K/V cases ("<case> fp8") against their bf16 case. Issue 3's target (1.7x faster or more) is set for the
    # two largest batches only; other fp8 cases (several query tokens a request: CTAs that are not bus-bound) get
    # their speed-up without a target.
    targeted = {"decode 64x8192 fp8", "decode 256x4096 fp8"}
    by_name = {r["case"]: r for r in ours if r.get("system") == "attnforge"}
    for name, r in by_name.items():
        base = by_name.get(name[:-len(" fp8")]) if name.endswith(" fp8") else None
        if base:
            speedup = base["median_us"] / r["median_us"]
            verdict = (f"target >= 1.7x: {'met' if speedup >= 1.7 else 'NOT met'}" if name in targeted
                       else "no target")
            lines.append(f"- {name}: {speedup:.2f}x faster than {base['case']} (bf16 K/V); {verdict}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
