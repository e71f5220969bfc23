"""Workload "torchrl": bigper's TorchRL drop-in beside TorchRL's prioritized buffer.

main.py (what ``tools/bench.py torchrl`` runs: the parent); side.py (one
buffer's side in a process of its own, started by path with the Python of
``--torchrl-python``)."""
