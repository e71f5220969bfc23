"""Workload "tree": capacity 2**20, sample + IS weights + gather + update, beside cpprb,
Tianshou and TorchRL. main.py (what ``tools/bench.py tree`` runs: the timing and
the table), peers.py (one adapter per library), more.py (the extra rows: the
capacity sweep and the first call after import, in a fresh process)."""
