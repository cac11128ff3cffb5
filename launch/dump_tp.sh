#!/usr/bin/env bash
# Tensor-parallel dump on one node: world = dp x tp over all local GPUs.
# Usage: launch/dump_tp.sh NGPUS TP TARGET_DIR DATA_FILE OUT_DIR [extra eagle3 dump flags]
# Example (Kimi-K2.5 on 8 GPUs): launch/dump_tp.sh 8 8 /models/Kimi-K2.5 chats.jsonl dumps/kimi --preset kimi-k2.5
set -euo pipefail
n=$1 tp=$2 target=$3 data=$4 out=$5
shift 5
exec torchrun --standalone --nproc-per-node "$n" -m eagle3.dump --target "$target" --data "$data" --out "$out" \
    --tp "$tp" "$@"
