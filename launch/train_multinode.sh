#!/usr/bin/env bash
# Multi-node drafter training through the deepspeed launcher (it ssh-es into each host of the hostfile).
# Usage: launch/train_multinode.sh HOSTFILE DUMP_DIR TARGET_DIR RUN_DIR [extra eagle3 train flags]
# Example (2 x 8 H200, Kimi-K2.5): launch/train_multinode.sh launch/hostfile.example /data/dumps/kimi \
#          /models/Kimi-K2.5 runs/kimi --config kimi-k2.5
set -euo pipefail
hostfile=$1 dump=$2 target=$3 run=$4
shift 4
exec deepspeed --hostfile "$hostfile" --master_port "${MASTER_PORT:-29500}" --module eagle3.train \
    --dump "$dump" --target "$target" --out "$run" "$@"
