#!/usr/bin/env bash
# Device runs of issue 15's H200 measurements (bench/RESULTS.md). Carry .whl (../shared/device/wheels.sh with
# EXTRA_WHEELS="transformers==5.24.0 gguf compressed-tensors==0.20.1 loguru").
#   bash bench/kimi_device.sh kernels   # tests/test_fast_path.py: the CUDA attention kernels vs float64
#   bash bench/kimi_device.sh layer     # bench/kimi_layer.py: a real-size Kimi-K2.5 MoE layer, INT4 as shipped
#   bash bench/kimi_device.sh reader    # the reader on a bf16 and an fp8 dump at the Kimi shape, 14 workers
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
for what in "$@"; do
  case $what in
    kernels) python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py 2>&1 | tail -5 | tee "$OUT/test_fast_path_h200.txt" ;;
    layer) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt"
           python3 bench/kimi_layer.py --out "$OUT" --work /tmp/kimi ${LAYER_ARGS:-} 2>&1 | tee "$OUT/kimi_layer.log" \
             | grep -v Warning | cut -c1-600 ;;
    reader) python3 bench/read_dump.py --synthetic /tmp/synth --hidden 7168 --tokens 100000 --workers 14 --steps 2 \
              --repeats 1 > /dev/null && \
            python3 bench/fp8_storage.py --dump /tmp/synth --out /tmp/synth8 --workers 14 --token-budget 16384 \
              --repeats 3 > "$OUT/fp8_storage_h200_w14.json" 2> "$OUT/fp8_storage_h200.log"
            python3 bench/fp8_storage.py --dump /tmp/synth --out /tmp/synth8 --workers 14 --token-budget 16384 \
              --repeats 3 --device cuda > "$OUT/fp8_storage_h200_w14_cuda.json" 2>> "$OUT/fp8_storage_h200.log"
            python3 bench/fp8_storage.py --dump /tmp/synth --out /tmp/synth8 --workers 14 --token-budget 16384 \
              --repeats 3 --device cuda --no-pin > "$OUT/fp8_storage_h200_w14_cuda_nopin.json" 2>> "$OUT/fp8_storage_h200.log"
            tail -3 "$OUT/fp8_storage_h200.log"; grep median_tokens_s "$OUT"/fp8_storage_h200_w14*.json ;;
    *) echo "unknown: $what"; exit 2 ;;
  esac
done
