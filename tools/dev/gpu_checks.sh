#!/bin/bash
# The device checks (issues 31, 41: the tier, the feed) in one call, for a session lent a GPU (the device tool runs it there).
#
# Here, first, once (the device machine has no ALE, no SB3/TorchRL, and nothing can be downloaded there):
#   echo /.devcarry/ >> .git/info/exclude; mkdir -p .devcarry/whl .devcarry/lib
#   .venv/bin/python -c "import sys; sys.path.insert(0, 'tools'); import numpy as np; \
#     from workloads.atari.data import real_frames; np.savez_compressed('.devcarry/frames.npz', frames=real_frames()[0])"
#   for p in stable-baselines3==2.9.2 gymnasium==1.2.2 farama-notifications==0.0.4 torchrl==0.14.1 tensordict==0.14.3 \
#            pyvers hoptorch importlib_metadata orjson; do
#     python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform any -d .devcarry/whl $p; done
#   cp -L /lib/x86_64-linux-gnu/libzstd.so.1 .devcarry/lib/   # (used only where that machine has no libzstd)
# then run `bash tools/dev/gpu_checks.sh` with carry [".devcarry"] (about 4 minutes with the machine's start).
# It runs the CUDA tests (tier, feed, deferred updates, their attack suites, JAX, the SB3 drop-in on CUDA),
# `tools/bench.py learner` (the CNN and the proxy learner) and the SB3 drop-in's train steps;
# `python tools/dev/learner_table.py $OUT/bench.log` turns the bench's JSON into the docs' tables.
# Seen 2026-11-28: TorchRL 0.14.1's compiled sum trees do not load beside that machine's torch 2.11 either.
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/nb
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # (a GPU JAX takes 75% of the GPU per process: the other workers' OOM)
cd "$(dirname "$0")/../.."
if ls .devcarry/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
ldconfig -p | grep -q libzstd || export LD_LIBRARY_PATH=$PWD/.devcarry/lib
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
timeout "${TEST_S:-200}" python3 -m pytest -p no:cacheprovider -q -n 12 -rfE \
    tests/device/test_device.py tests/device/test_torch.py tests/device/test_feed.py \
    tests/device/test_hostile_device.py tests/device/test_hostile_device_late.py tests/device/test_hostile_feed.py \
    tests/device/test_hostile_feed2.py tests/device/test_hostile_feed3.py tests/device/test_hostile_compressed_feed.py \
    tests/device/test_hostile_compressed_feed2.py tests/device/test_jax.py tests/device/test_hostile_jax.py \
    tests/device/test_hostile_jax2.py tests/device/test_hostile_pool_decode.py tests/device/test_hostile_streams.py \
    tests/device/test_hostile_nstep_feed.py tests/integrations/test_sb3.py::test_cuda_samples_and_tensor_priorities \
    tests/integrations/test_sb3_prefetch.py::test_training_with_a_cuda_tier > "$OUT/tests.log" 2>&1
echo "tests rc=$? took $(( $(date +%s) - t0 )) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | cut -c1-200 | tail -25
t0=$(date +%s)
frames=()
[ -f .devcarry/frames.npz ] && frames=(--frames .devcarry/frames.npz)
timeout "${BENCH_S:-200}" python3 tools/bench.py learner "${frames[@]}" --transitions 20000 --iters 80 --rounds 3 \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$? took $(( $(date +%s) - t0 )) s"
grep -v '^{' "$OUT/bench.log" | sed -n '/^feed /,$p'
timeout 70 python3 tools/bench.py sb3 --part train --device cuda --repeats 9 > "$OUT/sb3.log" 2>&1
grep -v '^{' "$OUT/sb3.log" | tail -7
