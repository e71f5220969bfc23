#!/bin/sh
# A venv where TorchRL 0.14.1's compiled extension (its sum trees: PrioritizedSampler,
# PrioritizedSliceSampler, TensorDictPrioritizedReplayBuffer) loads, for the TorchRL side of
# `python tools/bench.py torchrl` and `sequences`. The project's torch (2.13.0) cannot load it
# ("SumSegmentTreeFp32 is not available"): TorchRL 0.14.1's release builds are made against
# torch 2.14.1 (its release notes), so this venv gets that torch.
#
#   sh tools/dev/trl_venv.sh [DIR]            # default /tmp/trl-venv
#   TORCH_INDEX=URL sh tools/dev/trl_venv.sh  # torch from another index (a CPU-only wheel index, say)
#
# From plain PyPI, torch 2.14.1 on Linux x86_64 is its CUDA 13 build (with the nvidia-* wheels,
# about 5 GB installed); it runs on a machine without a GPU. PyPI has no CPU-only build of it:
# set TORCH_INDEX to PyTorch's CPU wheel index for one (about 1 GB less to fetch and install).
set -eu
DIR=${1:-/tmp/trl-venv}
PY=${PYTHON:-python3}
"$PY" -m venv "$DIR"
if [ -n "${TORCH_INDEX:-}" ]; then
    "$DIR/bin/python" -m pip install --quiet "torch==2.14.1" --index-url "$TORCH_INDEX"
fi
"$DIR/bin/python" -m pip install --quiet "torch==2.14.1" "torchrl==0.14.1" "tensordict==0.14.3" numpy
"$DIR/bin/python" -c "
import torch, torchrl, torchrl._torchrl
from torchrl.data import PrioritizedSampler
PrioritizedSampler(8, 0.6, 0.4)
print('$DIR: torch', torch.__version__, 'torchrl', torchrl.__version__, '- its extension loads')"
