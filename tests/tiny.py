"""Tiny random targets built from configs, saved as ordinary transformers directories (no hub)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 512  # every tiny tokenizer's ids are below this
LOGIT_SCALE = 40.0

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64,
             intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)

DEEPSEEK_V3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB,
                   hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                   q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
                   norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=False)

# Kimi-K2.5's layout: a vision-language wrapper (model_type kimi_k25) around a DeepseekV3 text backbone.
KIMI_K25 = dict(model_type="kimi_k25", architectures=["Kimi_K25ForConditionalGeneration"],
                text_config=dict(DEEPSEEK_V3, architectures=None),
                vision_config=dict(model_type="kimi_k25_vision", hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                                   mm_hidden_size=32, text_hidden_size=64),
                tie_word_embeddings=False)

CONFIGS = {"llama": LLAMA, "deepseek_v3": DEEPSEEK_V3, "kimi_k25": KIMI_K25}


def make_target(path: str, kind: str = "llama", seed: int = 0, tokenizer=None, layer_scale: float = 1.0,
                **overrides) -> str:
    """Build a random model of `kind` from its config and save it (fp32) with a tiny chat tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg_dict = dict(CONFIGS[kind], **overrides)
    cfg_dict = json.loads(json.dumps(cfg_dict))
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    cls = AutoModelForImageTextToText if kind == "kimi_k25" else AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32)
    # Random init of norms is all-ones; perturb everything so a wrong index or a missing norm shows up.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        # A peaked next-token distribution (as in a trained LM), so the teacher's argmax means something.
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
        # layer_scale > 1: layers that move the residual stream a lot, so neighbouring HF indices hold clearly
        # different states and the next token depends on context (the eval's wrong-export test needs that).
        for name, p in model.named_parameters():
            if ".layers." in name and p.ndim == 2:
                p.mul_(layer_scale)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is None:
        from tiny_tokenizers import make_tokenizer
        tokenizer = make_tokenizer("chatml")
    tokenizer.save_pretrained(path)
    return path


def reference_hidden_states(path: str, input_ids: torch.Tensor, attention_mask=None, dtype=torch.float32):
    """Plain top-level forward with output_hidden_states=True: the contract's definition of HF index k.
    Returns (hidden_states, logits, model)."""
    from eagle3.target.load import load_target
    model = load_target(path, dtype, torch.device("cpu"))
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states, out.logits, model


WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly hum a song about code".split()


def _text(rng, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=rng))


def write_conversations(path, n=12, seed=0, extra_lines=()):
    """ShareGPT-style jsonl with varied lengths, a system turn now and then, and multi-turn chats."""
    rng = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            conv = [{"from": "system", "value": _text(rng, 3)}] if i % 3 == 0 else []
            for _ in range(1 + i % 2):
                conv += [{"from": "human", "value": _text(rng, 2 + int(torch.randint(0, 12, (1,), generator=rng)))},
                         {"from": "gpt", "value": _text(rng, 2 + int(torch.randint(0, 20, (1,), generator=rng)))}]
            f.write(json.dumps({"conversations": conv}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def self_distilled_conversations(target: str, source: str, out_path: str, max_new_tokens: int = 32) -> str:
    """Conversations whose assistant turn is the target's own greedy continuation of the first user turn -- the
    data a drafter should be trained on to accept well on that target's generations."""
    from eagle3.conversations.formats import read_conversations
    from eagle3.target.load import load_target, load_tokenizer
    tok = load_tokenizer(target)
    model = load_target(target, torch.float32, torch.device("cpu"))
    with open(out_path, "w") as f:
        for _, _, messages in read_conversations([source]):
            user = next(m["content"] for m in messages if m["role"] == "user")
            ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
            new = out[0, ids["input_ids"].shape[1]:].tolist()
            special = set(tok.all_special_ids)
            new = new[: next((i for i, t in enumerate(new) if t in special), len(new))]  # the turn ends there
            text = tok.decode(new)
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": text}]}) + "\n")
    return out_path
