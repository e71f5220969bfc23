"""Workload "sequences": prioritized sequence replay (R2D2's items) beside flashbax
and TorchRL. main.py is what ``tools/bench.py sequences`` runs; the torchrl
workload runs its bigper and TorchRL sides too."""
