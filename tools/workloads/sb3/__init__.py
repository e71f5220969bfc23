"""Workload "sb3": the Stable-Baselines3 drop-in beside SB3's own ReplayBuffer
(main.py, what ``tools/bench.py sb3`` runs)."""
