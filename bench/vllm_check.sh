#!/usr/bin/env bash
# bench/vllm_check.py in vLLM 0.32.0's own CPU environment (bench/vllm_cpu_env.sh builds it once, ~3.5 GB, ~4
# minutes; VLLM_CPU_ENV names another place), with this checkout installed into it (no dependencies: the venv has
# torch, transformers and safetensors, all eagle3.model needs).
#   bash bench/vllm_check.sh EXPORT_DIR [EXPORT_DIR ...]      (exports made with --engine vllm)
#   bash bench/vllm_check.sh --tiny DIR     tiny runs + vLLM exports of every layout x option made in DIR first
#                                           (with this machine's python3, where eagle3 trains), then checked
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${VLLM_CPU_ENV:-$HOME/.cache/vllm-cpu}
exports=("$@")
if [[ ${1:-} == --tiny ]]; then
  mkdir -p "${2:?--tiny needs a directory}"
  python3 bench/vllm_check.py --make-tiny "$2" > "$2/made.txt"   # the training's log goes to stderr and made.txt
  mapfile -t exports < <(grep '^/' "$2/made.txt")
fi
[ -f "$ENV/.ok" ] || bash bench/vllm_cpu_env.sh "$ENV" >/dev/null  # built once
"$ENV/bin/pip" install -q --no-deps --no-build-isolation . >/dev/null 2>&1 || "$ENV/bin/pip" install -q --no-deps .
exec "$ENV/bin/python" bench/vllm_check.py "${exports[@]}"
