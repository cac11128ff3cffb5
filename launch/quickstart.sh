#!/usr/bin/env bash
# The main job on the embedded default (README's first set-up command): install, then `eagle3 quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh use  # the jobs and the example: no test extra, no llama.cpp build
exec eagle3 quickstart "$@"
