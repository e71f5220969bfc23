"""Workload "ray": the sharded buffer on a local Ray cluster, beside one local buffer
(main.py, what ``tools/bench.py ray`` runs). The package lives under workloads/,
so ``import ray`` with tools/ on sys.path is still Ray."""
