#!/usr/bin/env bash
# Device run (bench/RESULTS.md, "Drafter architectures"): the MLA drafter's training step at the Kimi-K2.5 shape
# against TorchSpec's own MLA step, with our Llama-layout step and the EAGLE-3.1 options, all on one GPU in one call.
# Carry .whl (../shared/device/wheels.sh) and .dev_peer (peer_torchspec_mla_step.py from ../shared/bench and
# torchspec.tar: `git archive --format=tar -o torchspec.tar 6dda2bfc7b181158697245eee3f17d0e9c766750 torchspec
# configs/draft_models` of github.com/torchspec-project/TorchSpec).
#   bash bench/mla_step.sh peer|ours|long
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$OUT/gpu.txt"
case "${1:-ours}" in
peer)  # TorchSpec's MLA step (flex_attention, its gradient checkpointing, no optimizer step), then ours alike
  timeout 300 python3 .dev_peer/peer_torchspec_mla_step.py --torchspec-src .dev_peer/torchspec.tar \
      --seqs "${PEER_SEQS:-4096,8192,32768}" --backends flex_attention --ttt 7 --optim none --grad-ckpt 1 --iters 5 \
      2>&1 | tee "$OUT/peer_torchspec_mla.log" | grep -E '^\{' ;;
ours)  # CUDA correctness first (a wrong kernel must not get timed), then the MLA step (the memory-efficient kernel 'auto'
      # picks for values narrower than keys, and FA2 on padded values beside it), the options, the Llama layout
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_drafter_layouts.py tests/test_fast_path.py -k cuda \
      > "$OUT/cuda_tests.txt" 2>&1
  tail -3 "$OUT/cuda_tests.txt"  # the whole log comes back in $OUT (a failure's numbers with it)
  [ -n "${ATTN:-}" ] && timeout 120 python3 bench/mla_attention.py --out "$OUT" 2>&1 | grep -E '^\{'
  timeout 300 python3 bench/train_step.py --out "$OUT" --layout mla --variants fast,fast_fa2 \
      --tokens "${TOKENS:-4096,32768}" --fa2-tokens "${FA2_TOKENS:-32768}" --iters "${ITERS:-5}" 2>&1 | grep -E '^\{"impl'
  for spec in ${SPECS:-mla:fc_norm,norm_output llama: llama:fc_norm,norm_output}; do
    timeout 240 python3 bench/train_step.py --out "$OUT" --layout "${spec%%:*}" --options "${spec#*:}" \
        --variants fast --tokens "${TOKENS:-4096,32768}" --iters "${ITERS:-5}" 2>&1 | grep -E '^\{"impl' ;
  done ;;
long)  # 131,072 tokens of one sample in pieces on one GPU
  timeout 500 torchrun --nproc-per-node 1 bench/train_step_sp.py --out "$OUT" --layout mla \
      --options fc_norm,norm_output --tokens "${LONG:-131072}" --pieces "${PIECES:-8}" --iters 2 \
      --checkpointing "${CKPT:-none}" 2>&1 | tail -4 ;;
esac
