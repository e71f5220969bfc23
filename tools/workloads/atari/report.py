"""Workload "atari", the output: the table and the notes under it."""

from __future__ import annotations

from benchkit import fmt, print_table
from workloads.atari.data import MILLION, TARGET_ADD, TARGET_BYTES, TARGET_ROUND
from workloads.atari.peers import VERSION_OF


def _bytes_cell(r: dict) -> str:
    b = r.get("bytes", {})
    if "bytes_per_transition" not in b:
        return "-"
    if "disk_per_transition" in b:
        return (f"{b['bytes_per_transition']:,.0f} (disk {b['disk_per_transition']:,.0f} + RAM "
                f"{b['ram_per_transition']:,.0f}; arrays {b['ram_arrays_per_transition']:,.0f})")
    return f"{b['bytes_per_transition']:,.0f} (RAM)"


def _check_cell(r: dict) -> str:
    c = r.get("check", {})
    if not c:
        return "-"
    if c.get("note"):
        return "-"
    if c["ok"]:
        return "ok"
    return f"{c['bad_obs'] + c['bad_next']}/{c['rows']} differ"


def _ratio_cell(d: dict, key: str) -> str:
    return f"{fmt(d.get(key + '_wall'), '.2f')} / {fmt(d.get(key + '_cpu'), '.2f')}"


def print_report(rep: dict) -> None:
    res, rat = rep["results"], rep["ratios"]
    any_ok = next((r for r in res.values() if r.get("status") == "ok"), {})
    print()
    print(f"atari: {rep['size']:,} transitions, obs/next_obs (4, 84, 84) uint8 from {any_ok.get('frames', '?')}; "
          f"episodes 900-1100 steps; alpha {rep['alpha']}, beta {rep['beta']}")
    print(f"one process per library; add = one step per call (fill, then {min(20_000, rep['size'] // 5):,} more "
          f"into the full ring: median of blocks); round = sample({rep['batch']}) with obs and next_obs stacks "
          f"+ IS weights + update of the {rep['batch']} priorities (median of blocks); "
          f"{rep['repeat']} run(s) per library, medians; wall / CPU: wall-clock and this process's CPU time "
          f"(the machine may be shared); malloc: {rep['malloc']} "
          f"{' '.join(f'{k}={v}' for k, v in rep['malloc_env'].items())}")
    headers = ["library", "version", "fill/s", "add/s wall", "add/s cpu", "add ratio w/c", "round us wall",
               "round us cpu", "round ratio w/c", "bytes/transition", "check"]
    rows = []
    vers = rep["versions"]
    for name, r in res.items():
        if r.get("status") != "ok":
            rows.append([name, r.get("status", "?")] + [""] * (len(headers) - 2))
            continue
        rr = rat.get(name, {})
        v = "checkout" if name.startswith("bigper") else (vers.get(VERSION_OF.get(name, ""), "") or "")
        rows.append([name, v, fmt(r["fill_per_s"], ",.0f"), fmt(r["add_per_s"], ",.0f"),
                     fmt(r["add_per_s_cpu"], ",.0f"), _ratio_cell(rr, "add") if rr else "",
                     fmt(r["round_us"], ".1f"), fmt(r["round_us_cpu"], ".1f"),
                     _ratio_cell(rr, "round") if rr else "",
                     _bytes_cell(r) if rep["malloc"] == "default" else "n/a (tuned malloc)", _check_cell(r)])
    print_table(headers, rows)
    if rep["malloc"] != "default":
        print("bytes/transition: not measured with tuned malloc (freed memory stays in the heap and is reused, "
              "so RSS growth undercounts); see a default run")
    print(f"ratios (wall / cpu): round = fastest peer's round / this (fastest: "
          f"{rat.get('fastest_round_peer_wall')} / {rat.get('fastest_round_peer_cpu')}; target >= {TARGET_ROUND}); "
          f"add = this add/s / fastest peer's ({rat.get('fastest_add_peer_wall')} / "
          f"{rat.get('fastest_add_peer_cpu')}; target >= {TARGET_ADD})")
    for name, r in res.items():
        if r.get("status") != "ok":
            print(f"  {name}: {r.get('status')}: {r.get('error')}")
            continue
        for n in r.get("notes", []):
            print(f"  {name}: {n}")
        c = r.get("check", {})
        if c.get("rows"):
            extra = (f"; next_obs of terminal steps differing: {c['bad_next_terminal']}"
                     if c.get("bad_next_terminal") else "")
            print(f"  {name}: check of {c['rows']} sampled rows: "
                  f"{'ok' if c['ok'] else '; '.join(c['problems'])}{extra}")
        if "round_breakdown_us" in r:
            b = r["round_breakdown_us"]
            print(f"  {name}: round = sample {b['sample']:.1f} us (gather of one batch's indices, repeated: "
                  f"{b['gather_only']:.1f}) + update {b['update']:.1f} us (cpu)")
        if r.get("runs", 1) > 1:
            print(f"  {name}: runs: round us wall {', '.join(f'{x:.1f}' for x in r['round_us_runs'])}; "
                  f"cpu {', '.join(f'{x:.1f}' for x in r['round_us_cpu_runs'])}; add/s wall "
                  f"{', '.join(f'{x:,.0f}' for x in r['add_per_s_runs'])}; cpu "
                  f"{', '.join(f'{x:,.0f}' for x in r['add_per_s_cpu_runs'])}")
    b = rep.get("bytes_1m", {})
    if b.get("status") == "ok" and "bytes_per_transition" in b:
        files = ", ".join(f"{k} {v / MILLION:,.1f}" for k, v in sorted(b["files"].items(), key=lambda kv: -kv[1])
                          if v)
        verdict = "ok" if b["bytes_per_transition"] <= TARGET_BYTES else "MISSED"
        print(f"bytes per transition at 1M capacity (bigper memmap, n_step=1, created, not filled): "
              f"{b['bytes_per_transition']:,.0f} = files {b['disk_per_transition']:,.0f} (preallocated blocks) + "
              f"RAM {b['ram_per_transition']:,.0f} (its in-RAM arrays' bytes); target <= {TARGET_BYTES:,}: "
              f"{verdict}")
        print(f"  files per transition: {files}")
    else:
        print(f"bytes per transition at 1M capacity: {b.get('status')}: {b.get('why') or b.get('error')}")
    m = rep.get("million")
    if m:
        if m.get("status") != "ok":
            print(f"1M run: {m.get('status')}: {m.get('why') or m.get('error')}")
        else:
            mb, mr = m["bytes"], m.get("ratios", {})
            worst = mb["disk_per_transition"] + max(mb["ram_per_transition"], mb["ram_arrays_per_transition"])
            verdict = "ok" if worst <= TARGET_BYTES else "MISSED"
            print(f"1M run (bigper memmap, capacity 1,000,000, {m['added']:,} steps added one add() each): "
                  f"create {m['create_s']:.1f} s; fill {m['fill_s']:.1f} s = {m['fill_per_s']:,.0f} steps/s "
                  f"(cpu {m['fill_per_s_cpu']:,.0f}/s)")
            print(f"  add into the full ring {m['add_per_s']:,.0f}/s wall, {m['add_per_s_cpu']:,.0f}/s cpu "
                  f"(ratio w/c {_ratio_cell(mr, 'add')}); round {m['round_us']:.1f} us wall, "
                  f"{m['round_us_cpu']:.1f} us cpu (ratio w/c {_ratio_cell(mr, 'round')}; {mr.get('note')})")
            print(f"  bytes/transition {worst:,.0f} (disk {mb['disk_per_transition']:,.0f} + RAM: RssAnon growth "
                  f"{mb['ram_per_transition']:,.0f}, in-RAM arrays {mb['ram_arrays_per_transition']:,.0f}; the "
                  f"larger counted); target <= {TARGET_BYTES:,}: {verdict}; check {_check_cell(m)}")
            if "round_breakdown_us" in m:
                bd = m["round_breakdown_us"]
                print(f"  round = sample {bd['sample']:.1f} us (gather of one batch's indices, repeated: "
                      f"{bd['gather_only']:.1f}) + update {bd['update']:.1f} us (cpu)")
