#!/usr/bin/env bash
# Device run of the training-step benchmark (bench/RESULTS.md): carry .whl (deepspeed etc., ../shared/device/wheels.sh)
# and .dev_peer (a copy of ../shared/bench/peer_specforge_step.py plus the specforge wheel in .whl).
#   bash bench/train_step.sh [extra bench/train_step.py flags]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
# the fast path's CUDA kernels against the float64 plain path first: a wrong kernel must not get timed
python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py 2>&1 | tail -3 | tee "$OUT/test_fast_path.txt" \
  || { echo "fast-path tests failed: nothing timed"; exit 1; }
python3 bench/train_step.py --out "$OUT" --peer .dev_peer/peer_specforge_step.py "$@" 2>&1 | tee "$OUT/train_step.log" | grep -v Warning
