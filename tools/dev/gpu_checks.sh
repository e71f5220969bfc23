#!/bin/bash
# The device checks (issues 31, 41: the tier, the feed) in one call, for a session lent a GPU (the device tool runs it there).
#
# Here, first (the device machine has no ALE): write real frames where the call can carry them,
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu
#   .venv/bin/python -c "import sys; sys.path.insert(0, 'tools'); import numpy as np; \
#     from workloads.atari.data import real_frames; np.savez_compressed('.gpu/frames.npz', frames=real_frames()[0])"
# then run `bash tools/dev/gpu_checks.sh` with carry [".gpu"] (about 4 minutes with the machine's start).
# It runs the CUDA tests (tier, deferred updates, the attack suite) and `tools/bench.py learner`;
# `python tools/dev/learner_table.py $OUT/bench.log` turns the bench's JSON into the docs' tables.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
timeout "${TEST_S:-170}" python3 -m pytest -p no:cacheprovider -q -rfE tests/device/test_device.py tests/device/test_torch.py \
    tests/device/test_hostile_device.py tests/device/test_feed.py tests/device/test_hostile_feed.py \
    tests/device/test_hostile_feed2.py tests/device/test_hostile_feed3.py -k "not sb3" 2>&1 | tee "$OUT/tests.log" | tail -20
echo "tests took $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
frames=()
[ -f .gpu/frames.npz ] && frames=(--frames .gpu/frames.npz)
timeout "${BENCH_S:-200}" python3 tools/bench.py learner "${frames[@]}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -34
echo "bench took $(( $(date +%s) - t0 )) s"
