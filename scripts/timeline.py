#!/usr/bin/env python3
"""Turns the per-CTA timelines a trace build of the decode and merge kernels prints (device/timeline.cuh:
ATTNFORGE_TIMELINE; scripts/device-check trace) into a picture of one decode step: when the CTAs start, how long
their prologue and first tile take, how the tiles go, when they end, and when the merge's CTAs pass their wait and
end. Times are microseconds from the first decode CTA's start; phases are measured in clock cycles and converted
with the clock rate the CTAs' own global-timer spans imply.

usage: timeline.py CASE_NAME TRACE_OUTPUT"""
import statistics
import sys


def quantiles(xs, qs=(0.0, 0.1, 0.5, 0.9, 1.0)):
    xs = sorted(xs)
    return [xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] for q in qs]


def fmt(xs, scale=1e-3):
    if not xs:
        return "-"
    return " / ".join(f"{x * scale:.1f}" for x in quantiles(xs))


def read_steps(path):
    """[(decode rows, merge rows or None)] in launch order; a merge launch belongs to the decode launch after it."""
    steps, cur, pending_merge = [], None, None
    for line in open(path, errors="replace"):
        w = line.split()
        if not w:
            continue
        if w[0] == "timeline-launch":
            cur = []
            if w[1] == "merge":
                pending_merge = cur
            else:
                steps.append((cur, pending_merge))
                pending_merge = None
        elif w[0] == "timeline" and cur is not None and len(w) in (15, 19, 24, 29):  # 12, 16 (session 16), 21, or 26 (cb58ce3) fields
            cur.append([int(x) for x in w[3:]])
    return steps


def describe(decode, merge):
    t0 = min(r[0] for r in decode)
    span = max(r[1] for r in decode) - t0
    out = []
    busy = [r for r in decode if r[10] & 0xFFFFFFFF] or decode  # CTAs past the plan's last item do nothing
    ghz = statistics.median(sum(r[2:9]) / max(1, r[1] - r[0]) for r in busy) or 1.0
    tiles = [r[10] & 0xFFFFFFFF for r in decode]
    sms = {r[10] >> 32 for r in decode}
    starts = sorted({r[0] for r in decode})
    steps = [b - a for a, b in zip(starts, starts[1:])]
    out.append(f"{len(decode)} decode CTAs ({len(busy)} with tiles) on {len(sms)} SMs, tiles a CTA {fmt(tiles, 1)} (min/p10/p50/p90/max); "
               f"clock {ghz:.2f} GHz; global timer step {min(steps) if steps else 0} ns")
    out.append(f"  start        {fmt([r[0] - t0 for r in decode])} us")
    cy = 1e-3 / ghz  # cycles -> us
    out.append(f"  prologue     {fmt([r[2] for r in decode], cy)} us (item to the first copies issued)")
    if all(len(r) >= 16 for r in decode):  # the first item's steps, cumulative from the CTA's start
        for name, i in (("item rows", 11), ("row ranges", 12), ("tile 0 out", 13), ("staged", 14)):
            out.append(f"    {name:<10} {fmt([r[i] for r in decode], cy)} us from the start")
    out.append(f"  first tile   {fmt([r[3] for r in decode], cy)} us (issued to landed)")
    out.append(f"  landed at    {fmt([r[9] - t0 for r in decode if r[9]])} us")
    per_tile = [r[4] / max(1, (r[10] & 0xFFFFFFFF) - 1) for r in decode if (r[10] & 0xFFFFFFFF) > 1]
    if per_tile:
        out.append(f"  later tiles  {fmt(per_tile, cy)} us a tile")
    out.append(f"  finish       {fmt([sum(r[5:9]) for r in decode], cy)} us (loop end to the partial or final rows written)")
    for name, i in (("stash", 5), ("spread O", 6), ("write rows", 7), ("last sync", 8)):
        out.append(f"    {name:<10} {fmt([r[i] for r in decode], cy)} us")
    out.append(f"  end          {fmt([r[1] - t0 for r in decode])} us; decode span {span / 1e3:.1f} us")
    # How many CTAs are running, and how many still wait for their first tile, every 2 us.
    edges = range(0, span + 2000, 2000)
    running = [sum(1 for r in decode if r[0] - t0 <= e < r[1] - t0) for e in edges]
    waiting = [sum(1 for r in decode if r[0] - t0 <= e and (r[9] == 0 or e < r[9] - t0)) for e in edges]
    out.append("  running/first-tile-pending every 2 us: " +
               " ".join(f"{a}/{b}" for a, b in zip(running, waiting)))
    # The kernel merge's CTAs (21 fields: global times from their rows written, field 15, to each step of the merge).
    mergers = [r for r in decode if len(r) >= 21 and r[16]]
    if mergers:
        others = [r[1] for r in decode if not (len(r) >= 21 and r[16]) and r[10] & 0xFFFFFFFF]
        out.append(f"  kernel merge: {len(mergers)} merging CTAs; each step after the one before: counted "
                   f"{fmt([r[16] - r[15] for r in mergers])}, states landed {fmt([r[17] - r[16] for r in mergers])}, "
                   f"weights {fmt([r[18] - r[17] for r in mergers])}, sums {fmt([r[19] - r[18] for r in mergers])}, "
                   f"rows written {fmt([r[20] - r[19] for r in mergers])}, CTA end {fmt([r[1] - r[20] for r in mergers])} us")
        again = [r for r in mergers if len(r) >= 26 and r[21]]  # cb58ce3's trace build ran each merge twice
        if again:
            out.append(f"    the same merge run again: counted->landed {fmt([r[22] - r[21] for r in again])}, weights "
                       f"{fmt([r[23] - r[22] for r in again])}, sums {fmt([r[24] - r[23] for r in again])}, rows written "
                       f"{fmt([r[25] - r[24] for r in again])} us")
        if others:
            out.append(f"    counted after the last other CTA's end: {fmt([r[16] - max(others) for r in mergers])} us; "
                       f"rows written to count, the other CTAs: {fmt([r[1] - r[15] for r in decode if r[15] and not r[16]])} us to their end")
    if merge:
        out.append(f"  merge: {len(merge)} CTAs, start {fmt([r[0] - t0 for r in merge])} us, past the wait "
                   f"{fmt([r[2] - t0 for r in merge if r[2]])} us, end {fmt([r[1] - t0 for r in merge])} us; "
                   f"step span {(max(r[1] for r in merge) - t0) / 1e3:.1f} us")
        steps = [r for r in merge if r[2] and r[3] and r[4] and r[5]]  # the block shape's first row, trace builds
        if steps:
            out.append(f"    past the wait to: LSEs known {fmt([r[3] - r[2] for r in steps])} us, O summed "
                       f"{fmt([r[4] - r[2] for r in steps])} us, warps met {fmt([r[5] - r[2] for r in steps])} us, "
                       f"end {fmt([r[1] - r[2] for r in steps])} us")
    return span, out


def spread(decode, num_kv_heads=8):
    """What the late CTAs have in common: their ends against their start, launch slot, SM load, KV head and piece."""
    t0 = min(r[0] for r in decode)
    busy = [(slot, r) for slot, r in enumerate(decode) if r[10] & 0xFFFFFFFF]
    if len(busy) < 8:
        return []
    per_sm = {}
    for _, r in busy:
        per_sm[r[10] >> 32] = per_sm.get(r[10] >> 32, 0) + 1

    def corr(xs, ys):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sx = sum((x - mx) ** 2 for x in xs) ** 0.5
        sy = sum((y - my) ** 2 for y in ys) ** 0.5
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy) if sx and sy else 0.0

    ends = [r[1] - t0 for _, r in busy]
    out = [f"  spread: end against start r={corr([r[0] - t0 for _, r in busy], ends):+.2f}, against launch slot "
           f"r={corr([s for s, _ in busy], ends):+.2f}, against tile 0 landed "
           f"r={corr([(r[9] or r[0]) - t0 for _, r in busy], ends):+.2f}, against SM id "
           f"r={corr([r[10] >> 32 for _, r in busy], ends):+.2f}"]
    for n in sorted(set(per_sm.values())):
        e = [r[1] - t0 for _, r in busy if per_sm[r[10] >> 32] == n]
        out.append(f"    CTAs on SMs holding {n}: {len(e)}, end {fmt(e)} us")
    heads = {}
    for s, r in busy:
        heads.setdefault(s % num_kv_heads, []).append(r[1] - t0)
    out.append("    end p50 by KV head (slot % heads): " + " ".join(f"{statistics.median(v) / 1e3:.1f}" for _, v in sorted(heads.items())))
    pieces = {}
    for s, r in busy:
        pieces.setdefault((s // num_kv_heads) * 4 // max(1, (len(decode) + num_kv_heads - 1) // num_kv_heads), []).append(r[1] - t0)
    out.append("    end p50 by item quarter (slot / heads): " + " ".join(f"{statistics.median(v) / 1e3:.1f}" for _, v in sorted(pieces.items())))
    late = sorted(busy, key=lambda x: x[1][1])[-8:]
    out.append("    the 8 last: " + ", ".join(f"slot {s} sm {r[10] >> 32} start {(r[0] - t0) / 1e3:.1f} tile0 "
                                          f"{((r[9] or r[0]) - t0) / 1e3:.1f} end {(r[1] - t0) / 1e3:.1f}" for s, r in late))
    return out


def main() -> int:
    name, path = sys.argv[1], sys.argv[2]
    steps = [(d, m) for d, m in read_steps(path) if d]
    if not steps:
        print(f"timeline {name}: no timeline lines (a trace build with ATTNFORGE_TIMELINE=1?)")
        return 1
    described = sorted((describe(d, m) for d, m in steps[1:] or steps), key=lambda x: x[0])
    spans = [s for s, _ in described]
    print(f"timeline {name}: {len(steps)} launches, decode span min/median/max "
          f"{spans[0] / 1e3:.1f} / {spans[len(spans) // 2] / 1e3:.1f} / {spans[-1] / 1e3:.1f} us; the median launch:")
    for line in described[len(described) // 2][1]:
        print("  " + line)
    median_decode = sorted((d for d, _ in steps[1:] or steps), key=lambda d: max(r[1] for r in d) - min(r[0] for r in d))
    for line in spread(median_decode[len(median_decode) // 2]):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
