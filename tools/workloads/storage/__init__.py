"""Workload "storage": bigper's storages side by side on Atari-shaped data.

main.py (the comparison, what ``tools/bench.py storage`` runs), data.py (frames,
steps and helpers; the atari workload uses them too), sweep.py (the memmap
capacity sweep), million.py (``--million``), cow.py (the copy-on-write row)."""
