#!/usr/bin/env python3
"""Peer quality anchor: SpecForge 0.2.0's own EAGLE-3 training (its draft `LlamaForCausalLMEagle3`, its TTT step and
loss `OnlineEagle3Model`, its `BF16Optimizer` and `CosineAnnealingWarmupLR`) trained on OUR dump -- same target, same
(regenerated) data, same train split, same batches, same steps and tokens per step, same draft vocabulary -- and
exported in exactly our SGLang layout, so that `eagle3 eval` compares both drafters on the same prompts.

    pip download --no-deps specforge==0.2.0      # then pip install --no-deps the wheel (nothing else is needed)
    python bench/peer_specforge_quality.py --run runs/quickstart/run --dump runs/quickstart/dump \
        --target example --vocab runs/quickstart/vocab.safetensors \
        --template-export runs/quickstart/sglang-drafter --out runs/quickstart/specforge-drafter
    eagle3 eval --target example --drafter runs/quickstart/specforge-drafter --prompts ... (as for ours)

`--run` (optional) takes every training setting not given on the command line from OUR run's run.json, so both
runs use the same steps, token budget, lr, warmup, min-lr ratio, TTT length, held-out fraction, seed, grad clip,
betas, weight decay, step decay and bf16. `--target example` means the embedded example target, as elsewhere.

What SpecForge's own offline pipeline feeds its model, and how our batch maps onto it (read from specforge 0.2.0:
algorithms/eagle3/data.py `normalize_offline_sample`, modeling/target/target_head.py `TargetHead.preprocess`,
training/strategies/base.py `Eagle3TrainStrategy.forward_loss`, algorithms/eagle3/model.py, core/compact_teacher.py,
core/eagle3_adapters.py `SdpaLikeAdapter.step_view`, modeling/draft/llama3_eagle.py `LlamaAttention.forward`):

* Its offline feature file holds, per token t of a conversation, exactly what our dump holds: `aux_hidden_state[t]`
  (the captured layers concatenated low -> high = our `hidden_state[t]`), `hidden_state[t]` (the target's
  post-final-norm state = our `final_hidden[t]`), `input_ids[t]`, and `loss_mask[t]` = 1 on assistant content and
  end-of-turn tokens (its parser marks the assistant span `header ... end_of_turn`, like our dump's mask).
  `normalize_offline_sample` sets the LAST token's loss_mask to 0 (per sample); its collator right-pads with zeros.
* `TargetHead.preprocess` (also on the compact-teacher path) shifts `input_ids` and the target hidden state LEFT by
  one (`padding(x, left=False)`: x[:, 1:] + a zero column) and does NOT shift `loss_mask`. EAGLE-3's offline and
  streaming (online) feature contracts both admit only target_repr="hidden_state" (algorithms/eagle3/providers.py),
  and its SGLang capture stores per-token, unshifted states, so every path of its pipeline goes through this.
* In `OnlineEagle3Model.forward`, step j at position t therefore reads aux[t] (projected by fc at j = 0, the previous
  step's output after), token input_ids[t + 1 + j], RoPE position t + j, attends causally to the step-0 keys <= t
  plus the step-1..j keys at t (cache_hidden), and is taught the target's distribution at u = t + 1 + j
  (`target_p_padded[:, j:j+T]` of the shifted target), restricted to the draft vocab and renormalised, i.e. the
  prediction of token t + 2 + j. That is exactly our convention (train/loss.py, model/drafter.py): the same inputs,
  the same teacher, the same attention pattern; `specforge_inputs` below does just what its pipeline does (mask of
  the last token, the one-token shift of ids and target, mask unshifted) on our collated batch.
* The pair (t, j) counts in SpecForge iff position_mask[t + j] = t2d[argmax_full(u)] * loss_mask[t + j]
  (position_mask is built once from the unshifted loss_mask and then shifted by one per step together with the
  inputs). Ours counts it iff the same vocab condition holds and loss_mask[t + 2 + j] = 1 (the PREDICTED token is
  assistant-produced) and every position up to t + 2 + j is real. So SpecForge's mask is two tokens behind the
  predicted token: it skips the first two tokens of every assistant span and trains on the two tokens after each
  span (end-of-turn -> e.g. "\\n", "<|im_start|>"), and for a sample ending with an assistant turn on one pair
  past the end (the target's prediction after the last token, position t + 2 + j = n). That is its pipeline's
  behaviour and is reproduced as is.
* Loss normalisation: SpecForge's ploss_j = sum over counted pairs of the soft cross-entropy / (B * T), all positions
  of the padded batch (`LogSoftmaxLoss` returns a mean over B*T rows, masked rows 0); ours = that sum / count_j (a
  mean over counted pairs per step). Both weight step j by 0.8^j. So at equal weights SpecForge's loss is ours
  scaled by about count_j / (B*T) per step (measured at step 0 on the tiny test batch and asserted in
  tests/test_peer_specforge.py): its gradients are smaller by that factor (gradient clipping at 0.5 bites less) and
  later TTT steps, having fewer counted pairs over the same denominator, weigh a little less. With the mask shifted
  as above and the denominators converted, its per-step sums equal ours to float precision.
* acc_j (logged): SpecForge's acc = (draft argmax mapped through d2t == the target's full-vocab argmax) over ALL
  loss-masked positions (an out-of-draft-vocab teacher argmax counts as a miss); ours is over counted pairs only.
* Teacher precision: SpecForge's TargetHead is bf16 (teacher logits from a bf16 matmul, softmax in fp32); ours
  multiplies in fp32. Kept as SpecForge does it (bf16 head under --bf16).
* Optimizer: SpecForge's BF16Optimizer (fp32 master weights, AdamW, global-norm grad clip `--grad-clip`) with OUR
  betas / weight decay (TrainConfig defaults (0.9, 0.95) / 0.0; SpecForge's own AdamW default is (0.9, 0.999));
  its CosineAnnealingWarmupLR (linear warmup (s+1)/W, then cosine over total - W steps) with eta_min = lr *
  --min-lr-ratio (our trainer now uses transformers' get_cosine_with_min_lr_schedule_with_warmup, whose warmup is
  s/W: ours runs one warmup step behind SpecForge's (s+1)/W; SpecForge's BF16Optimizer uses eta_min 0: pass
  --min-lr-ratio 0 for that). SpecForge's scheduler hands over from warmup to its recursive CosineAnnealingLR one
  step late (first step after warmup slightly above lr, 1.007 lr at 2 warmup / 20 steps, then one step behind our
  curve): at most 6e-7 lr apart from ours at 20 warmup / 2000 steps; reproduced as is. Initial weights: SpecForge's own (HF init, normal std 0.02), seeded with --seed.
* The drafter's layout and EAGLE-3.1 options are the template export's (config.json as our loader reads it, which
  must agree with its provenance), mapped onto SpecForge's draft config (modeling/draft/llama3_eagle.py):
  - `fc_norm` -> its config key `fc_norm` (`if getattr(config, "fc_norm", False)`: a ModuleList of 3
    LlamaRMSNorm(target_hidden_size, eps=config.rms_norm_eps), applied per chunk of the concatenation in
    `project_hidden_states` before fc, once at step 0): our function, and the same tensor names `fc_norm.{i}.weight`;
  - our `norm_output` off (lm_head reads norm(m), the next step receives m) -> its `norm_output` True (its default:
    `compute_logits` = lm_head(norm(h)), and OnlineEagle3Model feeds the un-normalised backbone output to the next
    step whatever the flag says);
  - our `norm_output` on (norm(m) is also what the next step receives): REFUSED, SpecForge 0.2.0 has no such
    drafter (its `norm_output` only decides whether lm_head reads norm(m) or m);
  - `norm_before_fc` (tensor `input_norm.weight`): REFUSED, SpecForge 0.2.0 has no norm over the concatenation;
  - layout "mla": REFUSED, SpecForge 0.2.0 has no MLA drafter (its EAGLE-3 draft is LlamaForCausalLMEagle3 only).
  The refusals come before anything is trained or written (`specforge_options`).
* The exported weights are the LAST step's (our quickstart exports the checkpoint with the best held-out decoding
  replay; export our run with `--step N` for a last-step comparison).

On a machine without Triton (CPU tests): specforge.core.loss imports triton at top level and its LogSoftmaxLoss is a
Triton kernel that cannot run on a CPU, so `import_specforge` installs, for CPU runs only, a module that provides
LogSoftmaxLoss as the formula of SpecForge's own reference `_compute_loss` in that file (the same forward, autograd
gives the kernel's backward). torch.compile'd helpers (RMSNorm, RoPE) run eagerly on a CPU (`--no-compile`, the
default there; inductor takes ~20 s per function on 2 cores). On the GPU nothing is replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import types

import torch

PEER = "specforge-0.2.0"
METRICS_FILE = "peer_metrics.jsonl"
OWN_FILES = ("config.json", "model.safetensors", "eagle3_provenance.json", METRICS_FILE)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ loading SpecForge

def _cpu_loss_module() -> types.ModuleType:
    """Stand-in for specforge.core.loss where Triton is unavailable / the device is a CPU (see the docstring)."""
    mod = types.ModuleType("specforge.core.loss")

    def _compute_loss(logits, target_p, position_mask):
        # specforge.core.loss._compute_loss (its reference implementation), without torch.compile
        out_logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * (target_p * out_logp), 2).mean()

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target, position_mask):
            return _compute_loss(logits, target, position_mask)

    mod._compute_loss = _compute_loss
    mod.LogSoftmaxLoss = LogSoftmaxLoss
    mod.__eagle3_cpu_stand_in__ = True
    return mod


def import_specforge(device: str | torch.device = "cpu") -> types.SimpleNamespace:
    """The SpecForge pieces used here. On a CPU (or without Triton) the Triton loss is replaced as documented."""
    on_cuda = torch.device(device).type == "cuda"
    if importlib.util.find_spec("triton") is None and "specforge.core.loss" not in sys.modules:
        sys.modules["specforge.core.loss"] = _cpu_loss_module()  # its top-level `import triton` would fail
    from specforge.algorithms.eagle3 import model as sf_model
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.lr_scheduler import CosineAnnealingWarmupLR
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding
    if not on_cuda:  # a Triton kernel cannot take CPU tensors: the reference formula instead
        sf_model.LogSoftmaxLoss = _cpu_loss_module().LogSoftmaxLoss
    import specforge
    return types.SimpleNamespace(model_module=sf_model, LlamaForCausalLMEagle3=LlamaForCausalLMEagle3,
                                 OnlineEagle3Model=sf_model.OnlineEagle3Model, BF16Optimizer=BF16Optimizer,
                                 CosineAnnealingWarmupLR=CosineAnnealingWarmupLR, padding=padding,
                                 validate_vocab_mapping_consistency=validate_vocab_mapping_consistency,
                                 version=getattr(specforge, "__version__", "0.2.0"))


# ------------------------------------------------------------------------------------------ model and inputs

def drafter_config(drafter):
    """Our DrafterConfig from a DrafterConfig or its dict (run.json's / an export provenance's `drafter`)."""
    from eagle3.model import DrafterConfig
    return drafter if isinstance(drafter, DrafterConfig) else DrafterConfig.from_dict(drafter, strict=False)


# Where SpecForge 0.2.0 says what it computes (quoted in the refusals)
_SF_FILE = "specforge/modeling/draft/llama3_eagle.py"
_SF_TTT = "specforge/algorithms/eagle3/model.py"


def specforge_options(drafter) -> dict:
    """Our drafter's layout and EAGLE-3.1 options -> the keys of SpecForge 0.2.0's draft config that build the SAME
    function. ValueError for what SpecForge 0.2.0 cannot build, saying how it differs (see the module docstring)."""
    c = drafter_config(drafter)
    if c.layout != "llama":
        raise ValueError(
            f"the template drafter has layout {c.layout!r}: SpecForge 0.2.0 has no MLA drafter. Its only EAGLE-3 "
            f"draft model is LlamaForCausalLMEagle3 ({_SF_FILE}: Llama attention, q/k/v/o projections, GQA, RoPE "
            "over the whole head); nothing in the package builds DeepSeek-V2 multi-latent attention (no "
            "kv_lora_rank / kv_a_proj_with_mqa anywhere). Compare an llama-layout run instead")
    if c.num_aux_layers != 3:
        raise ValueError(f"SpecForge's drafter projects exactly 3 captured states ({_SF_FILE}: fc = "
                         f"Linear(target_hidden_size * 3, ...)); this drafter has {c.num_aux_layers}")
    if c.norm_before_fc:
        raise ValueError(
            "the template drafter has norm_before_fc (one RMSNorm over the whole concatenation of captured states, "
            "tensor input_norm.weight): SpecForge 0.2.0 has no such norm. Its "
            "LlamaForCausalLMEagle3.project_hidden_states applies fc_norm per chunk or nothing before fc, and no "
            "config key or tensor of it corresponds to input_norm")
    if c.norm_output:
        raise ValueError(
            "the template drafter has norm_output: ours feeds norm(m), the hidden lm_head reads, to the next draft "
            "step. SpecForge 0.2.0 always feeds the un-normalised backbone output m to the next TTT step "
            f"({_SF_TTT}: `hidden_states = hidden_states_out` before `compute_logits(hidden_states)`); its config "
            f"key norm_output ({_SF_FILE}: `self.norm_output = getattr(config, \"norm_output\", True)`) only "
            "chooses whether compute_logits reads norm(m) (True, its default = our norm_output off) or m (False, "
            "no final norm at all, which no drafter of ours computes). Our norm_output has no SpecForge "
            "counterpart: train the template without --norm-output to compare")
    # fc_norm: its ModuleList of 3 LlamaRMSNorm(target_hidden_size, eps=rms_norm_eps) on the chunks, before fc
    return {"fc_norm": bool(c.fc_norm), "norm_output": True}


def llama_config(drafter):
    """A transformers LlamaConfig for SpecForge's draft model from OUR DrafterConfig (or its dict), with the
    SpecForge option keys that compute the same function (`specforge_options`: refuses what it cannot)."""
    from transformers import LlamaConfig
    options = specforge_options(drafter)
    drafter = drafter_config(drafter).to_dict()
    rs = dict(drafter.get("rope_scaling") or {})
    rope = {**rs, "rope_type": rs.get("rope_type", rs.get("type", "default")),
            "rope_theta": float(drafter["rope_theta"])}
    cfg = LlamaConfig(hidden_size=drafter["hidden_size"], num_attention_heads=drafter["num_attention_heads"],
                      num_key_value_heads=drafter["num_key_value_heads"], head_dim=drafter["head_dim"],
                      intermediate_size=drafter["intermediate_size"], vocab_size=drafter["vocab_size"],
                      max_position_embeddings=drafter["max_position_embeddings"], rope_parameters=rope,
                      rms_norm_eps=drafter["rms_norm_eps"], num_hidden_layers=1, tie_word_embeddings=False,
                      hidden_act=drafter.get("hidden_act", "silu"), pad_token_id=None)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = drafter["draft_vocab_size"]
    cfg.target_hidden_size = drafter["target_hidden_size"]
    for k, v in options.items():  # read by LlamaForCausalLMEagle3.__init__ with getattr(config, k, default)
        setattr(cfg, k, v)
    return cfg


def check_same_function(draft, drafter) -> None:
    """SpecForge's draft model computes our drafter's function: its fc_norm present iff ours is on (3 norms of
    target_hidden_size), lm_head on the normed hidden (its norm_output True), every norm at our rms_norm_eps.
    ContractError otherwise (a guard for export_peer / check_export: weights are only exported under a config.json
    that means what SpecForge trained)."""
    from eagle3 import contract as C
    c = drafter_config(drafter)
    options = specforge_options(c)
    have = {"fc_norm": draft.fc_norm is not None, "norm_output": bool(draft.norm_output)}
    if have != options:
        raise C.ContractError(f"SpecForge's draft model has options {have}; the template's drafter needs {options}")
    norms = [draft.norm, draft.midlayer.hidden_norm, draft.midlayer.input_layernorm,
             draft.midlayer.post_attention_layernorm, *(draft.fc_norm or [])]
    if c.fc_norm and [tuple(n.weight.shape) for n in draft.fc_norm] != [(c.target_hidden_size,)] * 3:
        raise C.ContractError(f"SpecForge's fc_norm shapes {[tuple(n.weight.shape) for n in draft.fc_norm]}")
    if any(n.variance_epsilon != c.rms_norm_eps for n in norms):
        raise C.ContractError(f"SpecForge's norms use eps {sorted({n.variance_epsilon for n in norms})}, ours "
                              f"{c.rms_norm_eps}")


def export_state_dict(draft, drafter) -> dict[str, torch.Tensor]:
    """SpecForge's draft state dict under OUR SGLang names (the frozen target embedding dropped). SpecForge 0.2.0
    names every tensor it has as we do: `fc_norm.{i}.weight` is `self.fc_norm = nn.ModuleList([LlamaRMSNorm ...
    for _ in range(3)])`, i = the chunk of the concatenation, low -> high; our `input_norm.weight`
    (norm_before_fc) has no SpecForge counterpart and is refused by `specforge_options`."""
    check_same_function(draft, drafter)
    # theirs -> ours: every name is the same (export_peer then requires exactly tensor_shapes' key set)
    return {k: v.detach().cpu() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def build_draft(sf, drafter, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, backend: str,
                device, dtype, seed: int | None = None):
    """SpecForge's LlamaForCausalLMEagle3 as its build_eagle3_draft makes it, with our drafter's (a DrafterConfig
    or its dict) shapes and options: own init, the target embedding loaded and frozen, our d2t/t2d installed, then
    moved to device and dtype. ValueError for an option or layout SpecForge 0.2.0 does not compute as we do."""
    cfg = llama_config(drafter)
    if seed is not None:
        torch.manual_seed(seed)
    draft = sf.LlamaForCausalLMEagle3(cfg, attention_backend=backend)
    check_same_function(draft, drafter)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed.float())
        draft.t2d.copy_(t2d.bool())
        draft.d2t.copy_(d2t.long())
    draft.freeze_embedding()
    sf.validate_vocab_mapping_consistency(draft.t2d, draft.d2t)
    return draft.to(device=device, dtype=dtype)


def specforge_inputs(sf, batch, head: torch.Tensor, device, dtype) -> dict:
    """Our collated batch (data/batch.py Batch) -> OnlineEagle3Model.forward kwargs, as SpecForge's own offline
    pipeline builds them for the same conversations (normalize_offline_sample, zero-padding collator,
    TargetHead.preprocess, compact teacher): loss_mask of each sample's last real token set to 0; input_ids and
    the target hidden state shifted left by one token over the padded batch (zero at the end); loss_mask left
    unshifted, [B, T, 1]."""
    am = batch.attention_mask.long()
    lengths = am.sum(1)
    loss_mask = batch.loss_mask.long().clone()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    loss_mask[rows, lengths[rows] - 1] = 0
    fl = dict(device=device, dtype=dtype)
    return dict(input_ids=sf.padding(batch.input_ids.long(), left=False).to(device),
                attention_mask=am.to(device), target=None, loss_mask=loss_mask[..., None].to(device),
                hidden_states=batch.hidden_state.to(**fl),
                target_hidden_for_compact=sf.padding(batch.final_hidden, left=False).to(**fl),
                target_head_weight=head)


def step_outputs(model, kwargs: dict) -> tuple[list[torch.Tensor], tuple]:
    """Run OnlineEagle3Model.forward and also return each TTT step's backbone output (the `m` our drafter's
    ttt_forward returns), captured with a forward hook on the midlayer."""
    outs: list[torch.Tensor] = []
    h = model.draft_model.midlayer.register_forward_hook(lambda mod, inp, out: outs.append(out))
    try:
        res = model(**kwargs)
    finally:
        h.remove()
    return outs, res


def make_optimizer(sf, model, lr: float, betas, weight_decay: float, grad_clip: float, total: int, warmup: int,
                   min_lr_ratio: float):
    """SpecForge's BF16Optimizer (fp32 masters, AdamW, global-norm clipping) with our betas, and its
    CosineAnnealingWarmupLR with an exact warmup step count and eta_min = lr * min_lr_ratio, built on the untouched
    optimizer exactly as BF16Optimizer builds its own (its scheduler is replaced before any step)."""
    opt = sf.BF16Optimizer(model, lr=lr, weight_decay=weight_decay, max_grad_norm=grad_clip, total_steps=total,
                           warmup_ratio=0.0, lr_scheduler="cosine")
    for g in opt.optimizer.param_groups:
        g["betas"] = tuple(betas)
        g["lr"] = lr                 # undo what the first scheduler's construction did
        g.pop("initial_lr", None)
    opt.scheduler = sf.CosineAnnealingWarmupLR(opt.optimizer, total_steps=total, warmup_steps=warmup,
                                               eta_min=lr * min_lr_ratio)
    return opt


# ------------------------------------------------------------------------------------------ settings

TRAIN_KEYS = {"steps": "max_steps", "token_budget": "token_budget", "lr": "lr", "warmup_steps": "warmup_steps",
              "min_lr_ratio": "min_lr_ratio", "ttt": "ttt_steps", "held_out_fraction": "held_out_fraction",
              "seed": "seed", "grad_clip": "grad_clip", "bf16": "bf16", "weight_decay": "weight_decay",
              "step_decay": "step_decay", "betas": "betas", "loss": "loss", "lk_kl_scale": "lk_kl_scale",
              "lk_kl_decay": "lk_kl_decay"}
# our --loss -> OnlineEagle3Model's lk_loss_type (specforge/algorithms/eagle3/model.py, specforge/core/lk_loss.py):
# "alpha" is -mean log(alpha) over its pairs, "lambda" the KL/acceptance mix with kl_scale and kl_decay, as ours
SPECFORGE_LK = {"kl": None, "lk": "alpha", "lk-hybrid": "lambda"}
_PAIRS = "pairs with loss_mask[t+j] and an in-draft-vocab teacher argmax"
# Its acceptance alpha = sum_v min(p_v, q_v) takes the target's FULL-vocab probabilities of the draft tokens
# (compact_teacher's target_p_on_draft, not renormalised), ours renormalises them over the draft vocab
# (train/loss.py Objective): the two agree for a full-vocab drafter and differ by the mass outside a draft vocab.
LOSS_CONVENTION = {
    "kl": f"specforge: sum_j decay^j * (sum of soft CE over {_PAIRS}) / (B*T)",
    "lk": f"specforge lk 'alpha': sum_j decay^j * -(mean over {_PAIRS} of log alpha), alpha from the target's "
          "full-vocab probabilities of the draft tokens",
    "lk-hybrid": f"specforge lk 'lambda': sum_j decay^j * (w_j * KL_j + (1 - w_j) * (1 - mean alpha_j)), w_j = "
                 f"kl_scale * exp(-kl_decay * mean alpha_j) detached, KL_j as for kl, means over {_PAIRS}"}


def resolve_settings(a: argparse.Namespace) -> argparse.Namespace:
    """Command line > --run's run.json["train"] > our TrainConfig defaults; TTT length 7 and bf16 on a GPU when
    neither says otherwise."""
    import dataclasses

    from eagle3.train.config import TrainConfig
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    run_train = {}
    if a.run:
        with open(os.path.join(a.run, "run.json")) as f:
            run = json.load(f)
        run_train = run["train"]
        if int(run_train.get("grad_accum") or 1) != 1:
            raise SystemExit(f"{a.run} trained with gradient accumulation {run_train['grad_accum']}: not reproduced "
                             "here (one optimizer step per batch, as SpecForge's default)")
        if int(run.get("world_size") or 1) != 1:
            log(f"[peer] note: {a.run} ran on {run['world_size']} ranks ({run['world_size']} batches per optimizer "
                "step); this run is rank 0 of a world of 1 (one batch per step): match tokens with --steps / "
                "--token-budget")
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = torch.device(a.device).type == "cuda"
    for ours, theirs in TRAIN_KEYS.items():
        if getattr(a, ours) is not None:
            continue
        if theirs in run_train and run_train[theirs] is not None:
            v = run_train[theirs]
        elif ours == "bf16":
            v = on_gpu
        elif ours == "ttt":
            v = 7
        else:
            v = defaults.get(theirs)
        setattr(a, ours, tuple(v) if ours == "betas" else v)
    if a.steps is None:
        raise SystemExit("--steps is required (or --run with a run whose max_steps is set)")
    if a.compile is None:
        a.compile = on_gpu
    if a.target == "example":
        from eagle3.dump.example import example_target_dir
        a.target = example_target_dir()
    return a


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dump", nargs="+", required=True, help="our dump directories (DumpSet)")
    ap.add_argument("--target", required=True, help="target model directory ('example' = the embedded one)")
    ap.add_argument("--vocab", required=True, help="our vocab.safetensors of the same run (d2t/t2d)")
    ap.add_argument("--template-export", required=True, help="OUR exported drafter of this run (config, provenance)")
    ap.add_argument("--out", required=True, help="the peer's export directory")
    ap.add_argument("--run", default=None, help="our run directory: training settings not given here come from its "
                                                "run.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--token-budget", type=int, default=None, help="padded tokens per step")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--min-lr-ratio", type=float, default=None, help="cosine floor = lr * this (SpecForge's: 0)")
    ap.add_argument("--ttt", type=int, default=None, help="TTT length (default 7)")
    ap.add_argument("--held-out-fraction", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--grad-clip", type=float, default=None, help="max global grad norm (default 0.5)")
    ap.add_argument("--weight-decay", type=float, default=None)
    ap.add_argument("--betas", type=lambda s: tuple(float(x) for x in s.split(",")), default=None)
    ap.add_argument("--step-decay", type=float, default=None, help="ploss weight decay over TTT steps (0.8)")
    ap.add_argument("--loss", default=None, choices=list(SPECFORGE_LK),
                    help="the objective, run by SpecForge's own code (its lk_loss_type: lk = 'alpha', lk-hybrid = "
                         "'lambda'); default: --run's, else kl")
    ap.add_argument("--lk-kl-scale", type=float, default=None, help="--loss lk-hybrid: SpecForge's kl_scale")
    ap.add_argument("--lk-kl-decay", type=float, default=None, help="--loss lk-hybrid: SpecForge's kl_decay")
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 model + SpecForge's fp32 masters (default: on a GPU)")
    ap.add_argument("--attention-backend", default="sdpa", choices=["sdpa", "flex_attention", "fa"],
                    help="SpecForge's attention backend (its GPU default is flex_attention)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="let SpecForge's torch.compile'd helpers compile (default: on a GPU)")
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the dump shards")
    ap.add_argument("--no-check-export", action="store_true",
                    help="skip the check that our drafter loaded from the peer export computes what SpecForge's does")
    return resolve_settings(ap.parse_args(argv))


# ------------------------------------------------------------------------------------------ export

def _check_out_dir(out: str) -> None:
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise SystemExit(f"{out} exists and is not a directory")
        extra = set(os.listdir(out)) - set(OWN_FILES)
        if extra:
            raise SystemExit(f"{out} holds other files ({sorted(extra)[:5]}): choose another --out")


def export_peer(draft, template: str, out: str, info: dict) -> dict:
    """out/ = model.safetensors with exactly our exporter's names, shapes and dtypes (bf16 floats, int64 d2t,
    bool t2d), config.json copied from the template export, eagle3_provenance.json = the template's with the
    weights' sha256, the server command and a note that the weights are the peer's. Written aside, read back with
    our loader, then renamed into place (a peer_metrics.jsonl already there is kept)."""
    from safetensors.torch import save_file

    from eagle3 import contract as C
    from eagle3.export import sglang as X
    from eagle3.model import checkpoint as MC
    from eagle3.model import tensor_shapes

    config, template_tensors, prov = MC.load_export(template)
    dcfg = MC.export_drafter_config(config, prov, template)  # the template's layout and options, as served
    keys = tensor_shapes(dcfg)
    sd = export_state_dict(draft, dcfg)  # our names; refuses a draft that computes another function
    if set(sd) != set(keys):
        raise C.ContractError(f"SpecForge's state dict {sorted(sd)} is not the SGLang key set {sorted(keys)}")
    tensors = {k: (sd[k].to(MC.EXPORT_DTYPE) if sd[k].is_floating_point() else sd[k]).contiguous() for k in keys}
    for k, t in template_tensors.items():
        if tensors[k].shape != t.shape or tensors[k].dtype != t.dtype:
            raise C.ContractError(f"{k}: peer {tuple(tensors[k].shape)} {tensors[k].dtype} vs template "
                                  f"{tuple(t.shape)} {t.dtype}")
    for k in ("d2t", "t2d"):
        if not torch.equal(tensors[k], template_tensors[k]):
            raise C.ContractError(f"{k} differs from the template export's: the two drafters must share the vocab")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, X.WEIGHTS_FILE), metadata={"format": "pt"})
        shutil.copyfile(os.path.join(template, X.CONFIG_FILE), os.path.join(tmp, X.CONFIG_FILE))
        p = prov.to_dict()
        p["model_safetensors_sha256"] = C.file_sha256(os.path.join(tmp, X.WEIGHTS_FILE))
        p["server_command"] = X.server_command(p["engine"], p["target"]["path"], os.path.abspath(out),
                                               p["target"]["model_type"], bool(p.get("needs_disable_cuda_graph")))
        p["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        p["step"] = info["steps"]
        p["run_dir"] = None
        p["checkpoint"] = None
        p["template_export"] = {"path": os.path.abspath(template), "run_dir": prov.run_dir, "step": prov.step,
                                "model_safetensors_sha256": prov.model_safetensors_sha256}
        p["peer"] = info
        p["notes"] = list(p.get("notes") or []) + [
            f"PEER WEIGHTS: trained by {PEER}'s own EAGLE-3 code (LlamaForCausalLMEagle3 + OnlineEagle3Model, "
            "BF16Optimizer, CosineAnnealingWarmupLR) by bench/peer_specforge_quality.py on the same dump, split, "
            "batches and draft vocab as the template export's run; config.json and the rest of this provenance are "
            "the template's"]
        with open(os.path.join(tmp, X.PROVENANCE_FILE), "w") as f:
            json.dump(p, f, indent=1)
        MC.load_export(tmp)
        L = p["target"]["num_hidden_layers"]
        if MC.capture_indices_of_export(tmp, L) != MC.capture_indices_of_export(template, L):
            raise C.ContractError("the peer export would capture other states than the template")
        os.makedirs(out, exist_ok=True)
        for name in (X.WEIGHTS_FILE, X.CONFIG_FILE, X.PROVENANCE_FILE):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return p


@torch.no_grad()
def check_export(sf, out: str, embed: torch.Tensor, batch: dict, ttt: int) -> float:
    """Our Eagle3Drafter loaded from the peer export (load_drafter_from_export, as eval does) and SpecForge's draft
    model built with the options of the export's config.json and holding the same (exported, bf16-rounded) weights
    compute the same TTT step outputs (the backbone output each step hands on) and the same draft logits (what
    lm_head reads: the fc_norm and norm_output mapping) on the first sample of a batch, fp32 on the CPU. Returns
    the max relative difference."""
    from eagle3.data.batch import Batch
    from eagle3.model.checkpoint import export_drafter_config, load_export
    from eagle3.eval.speculative import load_drafter_from_export
    ours = load_drafter_from_export(out, embed, torch.float32, torch.device("cpu"))
    config, tensors, prov = load_export(out)
    dcfg = export_drafter_config(config, prov, out)  # what our loader (and SGLang) build from this export
    draft = build_draft(sf, dcfg, embed, tensors["d2t"], tensors["t2d"], "sdpa", "cpu", torch.float32)
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise RuntimeError(f"export does not fit SpecForge's model: missing {missing}, unexpected {unexpected}")
    n = int(batch.attention_mask[0].sum())
    one = Batch(**{k: v[:1, :n] for k, v in batch.tensors().items()})
    model = sf.OnlineEagle3Model(draft, length=ttt, attention_backend="sdpa")
    head = torch.randn(embed.shape[0], one.final_hidden.shape[-1])  # the teacher plays no part here
    kw = specforge_inputs(sf, one, head, "cpu", torch.float32)
    import torch._dynamo as dynamo
    triton_loss = sf.model_module.LogSoftmaxLoss
    sf.model_module.LogSoftmaxLoss = _cpu_loss_module().LogSoftmaxLoss  # CPU tensors here, also after a GPU run
    try:
        with dynamo.config.patch(disable=True):
            theirs, _ = step_outputs(model, kw)
    finally:
        sf.model_module.LogSoftmaxLoss = triton_loss
    mine = ours.ttt_forward(one.hidden_state.float(), one.input_ids.long(), None, steps=ttt)
    if len(mine) != len(theirs):
        raise RuntimeError(f"{len(mine)} TTT steps of ours vs {len(theirs)} of SpecForge's")
    worst = 0.0
    with dynamo.config.patch(disable=True):
        for a, b in zip(mine, theirs):
            for x, y in ((a, b), (ours.draft_logits(a), draft.compute_logits(b))):
                worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-6)))
    return worst


# ------------------------------------------------------------------------------------------ the job

def main(argv=None) -> dict:
    a = parse_args(argv)
    if not a.compile:
        import torch._dynamo as dynamo
        dynamo.config.disable = True  # SpecForge's @torch.compile'd RMSNorm / RoPE run eagerly
    from eagle3 import contract as C
    from eagle3.data.batch import Batch
    from eagle3.data.dumps import DumpSet, split
    from eagle3.data.loader import BatchPlan, make_loader
    from eagle3.data.vocab import load_vocab
    from eagle3.model import OPTIONS
    from eagle3.model.checkpoint import export_drafter_config, load_export
    from eagle3.target.weights import load_embedding_and_head
    from eagle3.train.setup import check_target_matches_dumps

    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    torch.set_flush_denormal(True)
    _check_out_dir(a.out)
    sf = import_specforge(device)

    # ---- the same contract as our trainer: dumps, target, vocab, template export all agree
    dumps = DumpSet(a.dump, verify=not a.no_verify)
    manifest = dumps.manifest
    check_target_matches_dumps(a.target, manifest)
    config, template_tensors, prov = load_export(a.template_export)
    C.require_same_capture(prov.identity, manifest.identity(), f"template export {a.template_export}", "the dumps")
    drafter = prov.drafter
    served = export_drafter_config(config, prov, a.template_export)  # what config.json makes SGLang / our loader run
    trained = drafter_config(drafter)
    for k in ("layout", *OPTIONS):
        if getattr(served, k) != getattr(trained, k):
            raise C.ContractError(f"template config.json gives {k}={getattr(served, k)} but its provenance's drafter "
                                  f"says {getattr(trained, k)}")
    try:
        specforge_options(served)  # before anything is trained or written
    except ValueError as e:
        raise SystemExit(f"[peer] {PEER} cannot train the template's drafter ({a.template_export}): {e}") from None
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size",
              "target_hidden_size"):
        if config.get(k) != drafter.get(k):
            raise C.ContractError(f"template config.json {k}={config.get(k)} but its provenance's drafter says "
                                  f"{drafter.get(k)}")
    vocab = load_vocab(a.vocab)
    ident = vocab["meta"].get("identity")
    if ident is not None:
        C.require_same_capture(ident, manifest.identity(), f"vocab {a.vocab}", "the dumps")
    if not (torch.equal(vocab["d2t"], template_tensors["d2t"]) and torch.equal(vocab["t2d"], template_tensors["t2d"])):
        raise C.ContractError(f"{a.vocab} is not the vocab of {a.template_export} (d2t/t2d differ)")

    # ---- the same split and batches as our trainer (rank 0 of a world of 1)
    train_refs, held_refs = split(dumps.refs, a.held_out_fraction, a.seed)
    if not train_refs:
        raise SystemExit("no training samples after the held-out split")
    plan = BatchPlan([r.length for r in train_refs], a.token_budget, a.seed, 0, 1)
    total = a.steps

    # ---- SpecForge's model, optimizer and schedule
    embed, head = load_embedding_and_head(a.target)
    draft = build_draft(sf, served, embed, vocab["d2t"], vocab["t2d"], a.attention_backend, device, dtype, a.seed)
    model = sf.OnlineEagle3Model(draft, length=a.ttt, attention_backend=a.attention_backend,
                                 lk_loss_type=SPECFORGE_LK[a.loss], kl_scale=a.lk_kl_scale,
                                 kl_decay=a.lk_kl_decay).to(device=device, dtype=dtype)
    head = head.to(device=device, dtype=dtype)  # SpecForge's TargetHead is bf16 (fp32 with --no-bf16)
    opt = make_optimizer(sf, model, a.lr, a.betas, a.weight_decay, a.grad_clip, total, a.warmup_steps,
                         a.min_lr_ratio)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    settings = {k: getattr(a, k) for k in ("steps", "token_budget", "lr", "warmup_steps", "min_lr_ratio", "ttt",
                                           "held_out_fraction", "seed", "grad_clip", "weight_decay", "betas",
                                           "step_decay", "bf16", "attention_backend", "compile", "loss",
                                           "lk_kl_scale", "lk_kl_decay")}
    settings["betas"] = list(settings["betas"])
    log(f"[peer] {PEER}: draft {n_params / 1e6:.2f}M trainable params, draft vocab {drafter['draft_vocab_size']}, "
        f"capture HF {manifest.capture.hidden_state_indices}; {len(train_refs)} train / {len(held_refs)} held-out "
        f"samples; {total} steps ({len(plan.epoch(0))}/epoch); device {device}; {json.dumps(settings)}")

    os.makedirs(a.out, exist_ok=True)
    metrics_path = os.path.join(a.out, METRICS_FILE)
    open(metrics_path, "w").close()
    K = a.ttt
    # pooled between log lines, as SpecForge's controller does (numerators and denominators summed, then divided)
    pool = torch.zeros(8, K, dtype=torch.float64, device=device)
    tok_since = loss_since = n_since = 0
    tok_total, t_start = 0, time.perf_counter()
    t_last = t_start
    first_batch, rec = None, {}
    loader = make_loader(dumps, train_refs, plan, start_step=0, num_steps=total, num_workers=a.num_workers,
                         pin_memory=on_gpu)
    model.train()
    step = 0
    for batch in loader:
        if first_batch is None:
            first_batch = Batch(**{k: v.clone() for k, v in batch.tensors().items()})
        kw = specforge_inputs(sf, batch, head, device, dtype)
        plosses, accept, acces, corrects, denoms, mlosses, mdenoms = model(**kw)
        loss = sum(a.step_decay ** i * pl for i, pl in enumerate(plosses))
        loss.backward()
        grad_norm = opt.step()
        step += 1
        with torch.no_grad():
            st = lambda xs: torch.stack([torch.as_tensor(x, device=device).double().reshape(()) for x in xs])
            md = st(mdenoms)
            pool += torch.stack([st(corrects), st(denoms), st(mlosses) * md, md, st(accept) * md, md,
                                 torch.zeros(K, dtype=torch.float64, device=device),
                                 torch.zeros(K, dtype=torch.float64, device=device)])
            loss_since = loss_since + loss.detach().double()  # no host sync per step
        ntok = int(batch.attention_mask.sum())
        tok_since += ntok
        tok_total += ntok
        n_since += 1
        if step % a.log_interval == 0 or step == total:
            p = pool.cpu()
            dt = time.perf_counter() - t_last
            acc_j = (p[0] / p[1].clamp(min=1e-6)).tolist()
            ploss_j = (p[2] / p[3].clamp(min=1e-6)).tolist()
            rec = {"step": step, "loss": float(loss_since) / n_since,
                   "ploss_j": ploss_j, "acc_j": acc_j, "acceptance_rate_j": (p[4] / p[5].clamp(min=1e-6)).tolist(),
                   "grad_norm": float(grad_norm), "lr": opt.scheduler.get_last_lr()[0], "tokens": tok_since,
                   "tok_s": tok_since / dt, "time": time.time()}
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            log(f"[peer] step {step}/{total}: loss {rec['loss']:.4f} acc_j "
                f"{' '.join(f'{x:.3f}' for x in acc_j)} lr {rec['lr']:.2e} {rec['tok_s']:,.0f} tok/s")
            pool.zero_()
            tok_since = loss_since = n_since = 0
            t_last = time.perf_counter()
    if step != total:
        raise RuntimeError(f"the loader gave {step} batches, expected {total}")
    if on_gpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_start
    info = {"trainer": PEER, "specforge_version": sf.version, "script": "bench/peer_specforge_quality.py",
            "steps": total, "settings": settings, "dumps": [os.path.abspath(d) for d in a.dump],
            "vocab": os.path.abspath(a.vocab), "train_samples": len(train_refs), "held_out_samples": len(held_refs),
            "tokens": tok_total, "wall_s": wall, "tok_s": tok_total / wall, "final": rec,
            "loss_convention": LOSS_CONVENTION[a.loss]}
    log(f"[peer] trained {total} steps, {tok_total:,} tokens in {wall:.1f}s: {tok_total / wall:,.0f} tok/s")
    p = export_peer(draft, a.template_export, a.out, info)
    if not a.no_check_export:
        diff = check_export(sf, a.out, embed, first_batch, a.ttt)
        log(f"[peer] export check: our drafter loaded from {a.out} vs SpecForge's model with the same weights, "
            f"{a.ttt} TTT steps: max relative difference {diff:.2e}")
        if diff > 1e-3:
            raise RuntimeError(f"the exported drafter does not compute what SpecForge's does (rel diff {diff:.2e})")
        info["export_check_max_rel_diff"] = diff
    with open(metrics_path, "a") as f:
        f.write(json.dumps({"summary": info, "model_safetensors_sha256": p["model_safetensors_sha256"]}) + "\n")
    print(json.dumps({"out": os.path.abspath(a.out), "tok_s": info["tok_s"], "wall_s": wall, "final": rec,
                      "export_check_max_rel_diff": info.get("export_check_max_rel_diff")}))
    return info


if __name__ == "__main__":
    main()
