"""Workload "snapshot": memmap snapshots of an Atari-shaped buffer, each beside its
baseline (main.py, what ``tools/bench.py snapshot`` runs)."""
