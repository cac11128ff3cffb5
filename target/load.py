"""Load a target LM through transformers' own classes and find its text backbone.

Llama, Qwen2/3, Qwen3-MoE and DeepseekV3 load as `AutoModelForCausalLM`; Kimi-K2.5 (a DeepseekV3 text backbone
inside a vision-language wrapper, native in transformers as `kimi_k25`) loads as `AutoModelForImageTextToText`.
Either way the dump runs only the text backbone: the module that owns `embed_tokens`, the decoder `layers` and the
final `norm`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from eagle3.contract import TargetInfo, TokenizerInfo, config_hash, method_of, sha256_bytes
from eagle3.target import int4_experts as I
from eagle3.target.fingerprint import FULL, hub_revision, weights_fingerprint

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


class TargetError(ValueError):
    pass


@dataclass
class Backbone:
    """The text backbone of a target: call `module(input_ids=..., attention_mask=...)`; hook `layers[i]` and `norm`."""
    module: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    embed_tokens: nn.Module


def hub_snapshot(repo_id: str, repo_type: str | None, what: str) -> str:
    """The local snapshot directory of a hub repo already in the Hugging Face cache (never downloads: the
    machines that dump often cannot reach the hub). FileNotFoundError naming the repo and the cache otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    where = f"the local Hugging Face hub cache {constants.HF_HUB_CACHE} (HF_HUB_CACHE / HF_HOME)"
    try:
        return snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
    except HFValidationError:
        raise FileNotFoundError(f"{what} {repo_id}: no such file or directory (nor a valid hub id to look up in "
                                f"{where})") from None
    except LocalEntryNotFoundError:
        kind = "dataset" if repo_type == "dataset" else "model"
        raise FileNotFoundError(f"{what} {repo_id}: no such file or directory, and no {kind} {repo_id!r} "
                                f"(revision main) in {where}; download it first on a machine that can reach the "
                                "hub, or pass a local path") from None


def resolve_target(target: str) -> str:
    """A target directory as given, else a hub model id looked up in the local HF cache (its snapshot dir)."""
    if os.path.isdir(target):
        return target
    if os.path.exists(target):
        raise TargetError(f"--target {target}: not a directory (expected a transformers model directory)")
    return hub_snapshot(target, None, "--target")


def read_config(target_dir: str) -> dict:
    path = os.path.join(target_dir, "config.json")
    if not os.path.isfile(path):
        raise TargetError(f"{target_dir}: no config.json (expected a transformers model directory)")
    with open(path) as f:
        return json.load(f)


def text_config_dict(cfg: dict) -> dict:
    """The language-model part of a config: itself for text models, `text_config` for VLM wrappers (Kimi-K2.5)."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def target_info(target_dir: str, full_weights: bool = False, like: str | None = None,
                weights: bool = True) -> TargetInfo:
    """The target's identity: its config, and its weights' digest (target/fingerprint.py; sampled unless
    full_weights, or taken by the method of `like`, a recorded weights_sha256 it is to be compared with; left ''
    with weights=False, for a --server run's config-only copy)."""
    cfg = read_config(target_dir)
    text = text_config_dict(cfg)
    if like:
        full_weights = method_of(like) == FULL
    try:
        info = dict(path=os.path.abspath(target_dir), architecture=(cfg.get("architectures") or ["?"])[0],
                    num_hidden_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                    vocab_size=int(text["vocab_size"]), config_sha256=config_hash(cfg),
                    model_type=cfg.get("model_type", ""))
    except KeyError as e:
        raise TargetError(f"{target_dir}/config.json: missing {e} (of the text model)") from e
    except (TypeError, ValueError) as e:
        raise TargetError(f"{target_dir}/config.json: {e} (of the text model)") from e
    try:
        digest = weights_fingerprint(target_dir, full=full_weights)["sha256"] if weights else ""
    except FileNotFoundError as e:
        raise TargetError(str(e)) from None
    return TargetInfo(**info, weights_sha256=digest, revision=hub_revision(target_dir))


def tokenizer_info(tokenizer, remote_code: str | None = None) -> TokenizerInfo:
    """Hashes that tell whether two artefacts tokenised the same way (vocab + specials, and the chat template),
    and the shipped tokenizer code that was run to load it (`remote_code`, recorded in the manifest)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = sorted(str(t) for t in tokenizer.all_special_tokens)
    tok_hash = sha256_bytes(json.dumps([vocab, specials], ensure_ascii=False).encode())
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)
    return TokenizerInfo(sha256=tok_hash, chat_template_sha256=sha256_bytes((template or "").encode()),
                         remote_code=remote_code)


def remote_code_tokenizer(target_dir: str) -> str | None:
    """The custom tokenizer class a target ships as code (tokenizer_config.json auto_map.AutoTokenizer), e.g.
    Kimi-K2.5's `tokenization_kimi.TikTokenTokenizer`; None for a tokenizer transformers loads by itself."""
    path = os.path.join(target_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        auto = (json.load(f).get("auto_map") or {})
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    return ref or None


def load_tokenizer(target_dir: str, trust_remote_code: bool = False):
    """The target's tokenizer. One that ships as custom code runs that code only with trust_remote_code: without it
    transformers 5.24 silently substitutes its own conversion (for Kimi-K2.5: tiktoken.model turned into a fast
    tokenizer with transformers' default split regex, not Kimi's), which is not the tokenizer the serving engine
    runs, so a dump made with it would not match serving. Refused instead. Fast and slow tokenizers are both
    returned (the shipped Kimi one is slow)."""
    from transformers import AutoTokenizer
    remote = remote_code_tokenizer(target_dir)
    if remote and not trust_remote_code:
        raise TargetError(f"{target_dir}: the tokenizer ships as custom code ({remote}, from tokenizer_config.json "
                          "auto_map); pass --trust-remote-code to run it (read it first), as the serving engine "
                          "does. Without it transformers would substitute a conversion that may tokenise differently")
    try:
        if remote:
            # Only the tokenizer's own module runs (and what it imports): the class is taken from its file, not
            # through AutoTokenizer(trust_remote_code=True), which would also run config.json's auto_map code
            # (a configuration or modeling file) to look the tokenizer up.
            from transformers.dynamic_module_utils import get_class_from_dynamic_module
            cls = get_class_from_dynamic_module(remote, target_dir)
            tok = cls.from_pretrained(target_dir)
        else:
            tok = AutoTokenizer.from_pretrained(target_dir)
    except Exception as e:  # transformers raises many types here; the user needs the directory named
        raise TargetError(f"{target_dir}: cannot load a tokenizer ({type(e).__name__}: {e})") from e
    if not getattr(tok, "chat_template", None):
        raise TargetError(f"{target_dir}: the tokenizer has no chat template; the dump renders conversations with it "
                          "(add `chat_template` to tokenizer_config.json or a chat_template.jinja file)")
    # A slow tokenizer (no offsets; Kimi-K2.5's custom TikTokenTokenizer is one) is fine: the loss mask has an
    # offset-free path for it (conversations/masking.py, module docstring step 4).
    return tok


def _model_class(cfg: dict):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if cfg.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if isinstance(cfg.get("text_config"), dict):
        return AutoModelForImageTextToText
    raise TargetError(f"model_type {cfg.get('model_type')!r} is neither a causal LM nor a vision-language wrapper "
                      "that transformers knows")


def check_tp_divisibility(cfg: dict, tp_size: int, source: str) -> None:
    """Transformers' TP 'loads' with sizes that don't divide and crashes later in the forward: refuse up front."""
    if tp_size <= 1:
        return
    text = text_config_dict(cfg)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "n_routed_experts", "num_experts"):
        v = text.get(key)
        if isinstance(v, int) and v % tp_size:
            raise TargetError(f"{source}: --tp {tp_size} does not divide {key}={v}")


def load_target(target_dir: str, dtype: torch.dtype, device: torch.device, tp_size: int = 1, dp_size: int = 1):
    """Load the target for inference. With tp_size > 1 this must run under torchrun: transformers shards it."""
    cfg = read_config(target_dir)
    check_tp_divisibility(cfg, tp_size, f"{target_dir}/config.json")
    cls = _model_class(cfg)
    kwargs: dict = {"dtype": dtype}
    if tp_size > 1:
        from transformers.distributed import DistributedConfig
        dc = DistributedConfig(tp_size=tp_size, tp_plan="auto")
        if dp_size > 1:
            # DP x TP in one world: transformers wraps the replicas with FSDP2 (HSDP, fsdp_size 1). Its default
            # plan groups (norm, lm_head) into one fully_shard call, which fails for untied heads ("FSDP requires a
            # single root module", transformers 5.24); sharding lm_head on its own avoids that path.
            dc = DistributedConfig(tp_size=tp_size, dp_replicate_size=dp_size, tp_plan="auto",
                                   fsdp_plan={"lm_head": "free_full_weight"})
        kwargs["distributed_config"] = dc
    else:
        kwargs["device_map"] = {"": device}
    packed = I.packed_int4_config(cfg)
    if packed is None:
        model = cls.from_pretrained(target_dir, **kwargs)
    else:
        model = _load_with_packed_experts(cls, target_dir, packed, tp_size, kwargs)
    model.eval()
    model.requires_grad_(False)
    return model


VISION_KEY = re.compile(r"(^|\.)(vision_tower|mm_projector)\.")


def _load_with_packed_experts(cls, target_dir: str, qc: dict, tp_size: int, kwargs: dict):
    """A compressed-tensors pack-quantized checkpoint (Kimi-K2.5 as shipped): everything but the routed experts
    through transformers as usual; the experts stay INT4-packed (target/int4_experts.py says why)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(target_dir)
    I.strip_for_packed_loading(config)
    with I.packed_experts_construction():
        model, info = cls.from_pretrained(target_dir, config=config, output_loading_info=True, **kwargs)
    # The packed tensors are the only checkpoint keys transformers may skip, and nothing the dump runs may be left
    # uninitialised: a silently random weight would make a plausible-looking but wrong dump. The vision tower and
    # projector never run here (the dump feeds text to the text backbone), so their keys are not held against it.
    def runs(key):
        return not VISION_KEY.search(key)
    unexpected = [k for k in info.get("unexpected_keys", ()) if not I.PACKED_KEY.search(k) and runs(k)]
    missing = [k for k in info.get("missing_keys", ()) if runs(k)]
    mismatched = [k for k in info.get("mismatched_keys", ()) if runs(str(k))]
    if unexpected or missing or mismatched:
        raise TargetError(f"{target_dir}: loading with packed experts left missing {missing[:5]}, unexpected "
                          f"{unexpected[:5]}, mismatched {mismatched[:5]}")
    try:
        n = I.load_packed_experts(model, target_dir, qc, tp_size)
    except I.PackedExpertsError as e:
        raise TargetError(str(e)) from e
    if n == 0:
        raise TargetError(f"{target_dir}: pack-quantized, but the model has no routed-expert layer to hold them")
    return model


def find_backbone(model: nn.Module, num_layers: int) -> Backbone:
    """The module holding the decoder layers: a ModuleList named `layers` of num_layers entries with a sibling
    `norm` and `embed_tokens`. Works for XForCausalLM.model and for VLM wrappers (model.model.language_model)."""
    found = []
    for name, mod in model.named_modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers and hasattr(mod, "norm") \
                and hasattr(mod, "embed_tokens"):
            found.append((name, mod))
    if len(found) != 1:
        raise TargetError(f"cannot find a unique text backbone with {num_layers} decoder layers in "
                          f"{type(model).__name__} (candidates: {[n for n, _ in found]})")
    mod = found[0][1]
    return Backbone(module=mod, layers=mod.layers, norm=mod.norm, embed_tokens=mod.embed_tokens)
