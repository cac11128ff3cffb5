#!/usr/bin/env bash
# bench/sglang_check.py in SGLang 0.5.23's own environment (../shared/sglang_cpu_env.sh builds it once, ~6 GB, a few
# minutes; SGLANG_CPU_ENV names another place), with this checkout installed into it (no dependencies: the venv has
# torch, transformers and safetensors, all eagle3.model needs).
#   bash bench/sglang_check.sh EXPORT_DIR [EXPORT_DIR ...]
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${EAGLE3_SHARED:-../shared}
ENV=${SGLANG_CPU_ENV:-$HOME/.cache/sglang-cpu}
[ -f "$ENV/.ok" ] || bash "$SHARED/sglang_cpu_env.sh" "$ENV" >/dev/null  # built once; then shared/ is not needed
"$ENV/bin/pip" install -q --no-deps --no-build-isolation . >/dev/null 2>&1 || "$ENV/bin/pip" install -q --no-deps .
PYTHONPATH="$ENV/stubs" exec "$ENV/bin/python" bench/sglang_check.py "$@"
