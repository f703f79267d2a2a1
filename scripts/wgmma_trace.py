#!/usr/bin/env python3
"""Sums the clock counters a trace build of the Hopper prefill kernel prints (prefill_wgmma.cuh:
ATTNFORGE_WGMMA_TRACE; scripts/device-check trace) over every traced CTA and launch, for one bench case, and prints
each side's phases as shares of its cycles and as cycles per item and per K/V tile.

usage: wgmma_trace.py CASE_NAME TRACE_OUTPUT"""
import collections
import sys


def main() -> int:
    name, path = sys.argv[1], sys.argv[2]
    sums = collections.defaultdict(collections.Counter)
    # The computing side's busy cycles of each CTA, launch by launch (a launch's lines run from CTA 0 up): how even
    # the persistent CTAs' loads came out (mean over max: 1 = every CTA busy until the last one finishes).
    launches, last_cta = [], None
    for line in open(path, errors="replace"):
        if not line.startswith("wgmma-trace "):
            continue
        words = line.split()
        role, fields = words[1], words[2:]
        counts = {fields[i]: int(fields[i + 1]) for i in range(0, len(fields) - 1, 2)}
        if role == "copier":
            if last_cta is None or counts["cta"] <= last_cta:
                launches.append({})
            last_cta = counts["cta"]
        elif launches:
            launches[-1][counts["cta"]] = max(launches[-1].get(counts["cta"], 0), counts["total"])
        counts.pop("cta", None)
        sums[role].update(counts)
        sums[role]["ctas"] += 1
    if not sums:
        print(f"trace {name}: no trace lines (was the kernel the pipelined form?)")
        return 1
    for role in sorted(sums):
        c = sums[role]
        total, items, tiles = c["total"], max(c["items"], 1), max(c["tiles"], 1)
        # q_*: times of the copier relative to the start of the computing side's wait for Q (not phases).
        skip = ("ctas", "items", "tiles", "masked_tiles", "total")
        phases = [k for k in c if k not in skip and not k.startswith("q_")]
        parts = ", ".join(f"{k} {100.0 * c[k] / total:.1f}%" for k in phases)
        per_item = ", ".join(f"{k} {c[k] / items:.0f}" for k in phases)
        print(f"trace {name} {role}: {c['ctas']} CTA-launches, {c['items']} items, {c['tiles']} tiles "
              f"({c['tiles'] / items:.1f} an item, masked {c['masked_tiles']}), {total / items:.0f} cycles an item, "
              f"{total / tiles:.0f} a tile")
        print(f"    share: {parts}, other {100.0 * (total - sum(c[k] for k in phases)) / total:.1f}%")
        print(f"    cycles an item: {per_item}")
        if "q_top" in c:
            rel = ", ".join(f"{k[2:]} {c[k] / items:+.0f}" for k in ("q_empty", "q_top", "q_issue", "q_ready"))
            alone = f"the wait on Q alone {c['q_wait'] / items:.0f} cycles an item; " if "q_wait" in c else ""
            print(f"    {alone}the copier, cycles from the start of the wait for Q (an item's average): {rel}; "
                  f"bounds late in {100.0 * c['q_late'] / items:.1f}% of items")
    balance = [sum(b.values()) / len(b) / max(b.values()) for b in launches if b and max(b.values()) > 0]
    if balance:
        print(f"trace {name} balance (computing side, mean over max CTA cycles): {len(balance)} launches, "
              f"{min(balance):.3f}-{max(balance):.3f}, mean {sum(balance) / len(balance):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
