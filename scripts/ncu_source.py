#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction: reads the CSV that
`ncu --import R --page source --csv --print-source sass` writes for a report collected with the SourceCounters
section (PC sampling), and prints the sampled total, the instructions with the most samples and, with --window,
the samples summed over runs of consecutive instructions (a loop, a phase) so that a phase spread over many
instructions shows up as one figure.

  scripts/ncu_source.py source.csv [--top 40] [--window 32]
"""
import argparse
import csv
import gzip
import sys


def open_text(path):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--window", type=int, default=0, help="also sum samples over runs of this many lines")
    args = ap.parse_args()
    rows = [r for r in csv.reader(open_text(args.csv)) if r]
    # ncu may print a kernel-name line before the header: the header is the first row naming the sample column.
    head_at = next((i for i, r in enumerate(rows) if any("Sampling" in c and "All" in c for c in r)), None)
    if head_at is None:
        sys.exit(f"no 'Warp Stall Sampling (All Samples)' column in {args.csv}; first rows: {rows[:3]}")
    head = rows[head_at]
    samples = next(i for i, c in enumerate(head) if "Sampling" in c and "All" in c)
    text = next((i for i, c in enumerate(head) if c in ("Source", "Source Code", "SASS")), 1)
    where = next((i for i, c in enumerate(head) if c in ("Address", "#", "Line", "Line Number")), 0)
    body = [r for r in rows[head_at + 1:] if len(r) == len(head)]
    counts = [number(r[samples]) for r in body]
    total = sum(counts)
    print(f"{len(body)} lines, {total:.0f} samples (column '{head[samples]}')")
    if total == 0:
        return
    order = sorted(range(len(body)), key=lambda i: -counts[i])
    print(f"\ntop {args.top} lines by samples:")
    for i in order[: args.top]:
        print(f"{counts[i] / total * 100:6.2f}%  {body[i][where]:>8}  {body[i][text].strip()[:110]}")
    if args.window > 0:
        runs = []
        for start in range(0, len(body), args.window):
            s = sum(counts[start:start + args.window])
            runs.append((s, start))
        print(f"\nruns of {args.window} lines with the most samples:")
        for s, start in sorted(runs, reverse=True)[: args.top // 2]:
            end = min(start + args.window, len(body)) - 1
            print(f"{s / total * 100:6.2f}%  lines {body[start][where]} .. {body[end][where]}: "
                  f"{body[start][text].strip()[:60]} .. {body[end][text].strip()[:40]}")


if __name__ == "__main__":
    main()
