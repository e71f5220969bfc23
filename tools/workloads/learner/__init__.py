"""Workload "learner": how fast bigper feeds a learner, as a share of its ceiling.

main.py (what ``tools/bench.py learner`` runs: a Nature-CNN DQN learner fed by
each feed); proxy.py (the launch-bound proxy learner, the count of Python calls
a batch; the torchrl workload uses it too)."""
