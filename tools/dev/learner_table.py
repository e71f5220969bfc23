"""Markdown tables of a `tools/bench.py learner` JSON line (for README.md and docs/benchmarks.md).

Usage: python tools/dev/learner_table.py BENCH_LOG   (the log whose last line is the JSON)
"""

import json
import sys

LABELS = {
    "ceiling": "the same batch again, on the device (the ceiling)",
    "numpy SB3": "numpy stacks in SB3's layout, uniform, `.to(device)`",
    "sample": "`sample` -> `to_torch` -> `update_priorities`",
    "sampler": "`sampler(B, prefetch=2, device=...)`",
    "tier": "the same with the device tier (`device=` on the buffer)",
    "tier sample": "`sample` with the device tier (no thread)",
    "zstd": "`sampler` over `compression=\"zstd\"` frames",
    "zstd tier": "the same with the device tier",
}


def main(path: str) -> None:
    line = [x for x in open(path).read().splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    feeds, alone, gil = r["feeds"], r["alone"], r.get("gil", {})
    sizes = list(feeds)
    head = "| feed | " + " | ".join(f"B={b}: µs an update | share | buffer alone µs" for b in sizes) + " |"
    print(head)
    print("|---|" + "---|---|---|" * len(sizes))
    for name in feeds[sizes[0]]:
        cells = []
        for b in sizes:
            us = feeds[b].get(name)
            ceil = feeds[b]["ceiling"]
            cells += [f"{us:,.0f}" if us else "-", f"{100 * ceil / us:.0f}%" if us else "-",
                      f"{alone[b][name]:,.0f}" if name in alone[b] else ""]
        print(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    floor = []
    for b in sizes:
        floor += ["", "", f"{alone[b]['floor']:,.0f}"]
    print("| the floor: frames once in device memory, indices up, one gather, priorities back | "
          + " | ".join(floor) + " |")
    if gil:
        print()
        print("share of a draw that holds the GIL: " + "; ".join(
            f"B={b}: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in gil[b].items()) for b in sizes))
    seq = r.get("sequences", {})
    if seq:
        print()
        print("| sequences 32 x (40 + 80) with stacks, to the device | ms a batch |")
        print("|---|---|")
        for k, v in seq.items():
            print(f"| {k} | {v / 1000:.2f} |" if isinstance(v, float) else f"| {k} | {v} |")


if __name__ == "__main__":
    main(sys.argv[1])
