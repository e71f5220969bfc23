"""Workload "offline": HDF5 datasets opened in place, and DQN Replay runs converted.

main.py (what ``tools/bench.py offline`` runs); dqn.py (``--dqn-replay``: a run
written from real ALE play, then ``bigper convert``); dqn_scale.py (``--scale``:
kill -9 and resume of the convert and of ``reprioritize``); dqn_child.py (its
child interpreters and their peak RSS)."""
