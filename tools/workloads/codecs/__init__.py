"""Workload "codecs": which codec for compressed frames, on real ALE frames.

main.py (what ``tools/bench.py codecs`` runs); frames.py (the real ALE frames of
six games, cached under /tmp; the atari workload's compressed runs and
tools/dev/ use them too; ``python tools/workloads/codecs/frames.py --fixture``
writes tests/data/atari_frames.npz)."""
