"""Workload "atari": Atari-shaped replay, bigper against cpprb, Tianshou and TorchRL.

main.py (what ``tools/bench.py atari`` runs: the comparison), child.py (one
library in a process of its own, started by path), loop.py (the
learner-shaped rows, started by path), data.py (the constants, the recorded
Pong frames and the stream; the learner and torchrl workloads use them too),
peers.py (one adapter per library), report.py (the table); ``--compression``:
scale.py (at scale; its ``--child`` started by path), games.py (game by game),
adds.py (compressed adds against raw)."""
