"""The drafter's configuration: one typed dataclass for every layout and option (docs/drafters.md).

Layouts (the attention inside the one decoder layer; everything around it is EAGLE-3's):
  * "llama": SGLang's `LlamaForCausalLMEagle3` (q/k/v/o projections, GQA, RoPE over the whole head);
  * "mla":   SGLang's `Eagle3DeepseekV2ForCausalLM` (DeepSeek-V2 multi-latent attention: q_a -> q_b, kv_a -> latent
             c_kv + shared k_pe -> kv_b; RoPE on the rope dims only, DeepSeek's YaRN).
EAGLE-3.1 options (either layout):
  * fc_norm:        one RMSNorm per captured state, on each target_hidden_size chunk before fc (`fc_norm.{i}`);
  * norm_before_fc: one RMSNorm over the whole concatenation before fc (`input_norm`); exclusive with fc_norm;
  * norm_output:    the post-norm hidden norm(m) is what lm_head reads AND what the next draft step receives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

LAYOUTS = ("llama", "mla")
ACTIVATIONS = ("silu",)
LLAMA_ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
OPTIONS = ("fc_norm", "norm_before_fc", "norm_output")  # the EAGLE-3.1 switches, in the order flags list them
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int            # the TARGET's vocab (embedding rows, t2d length)
    draft_vocab_size: int      # lm_head rows (== vocab_size: a full-vocab drafter)
    target_hidden_size: int
    head_dim: int | None = None  # llama: None -> hidden/heads; mla: qk_nope + qk_rope (always written out)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    num_aux_layers: int = 3
    hidden_act: str = "silu"
    layout: str = "llama"
    # EAGLE-3.1
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    # MLA (layout "mla" only; None elsewhere)
    q_lora_rank: int | None = None   # None: q projected straight from the layer input (q_proj)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        import math
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {LAYOUTS}")
        # A config read from an --init-from export or a preset: values no forward can mean are refused here (an
        # rms_norm_eps of -1 or a rope_theta of -5 trained to NaN and the export shipped them)
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} {v!r} must be a finite number > 0")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "target_hidden_size", "vocab_size", "draft_vocab_size", "num_aux_layers"):
            v = getattr(self, name, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} {v!r} must be an integer >= 1")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are exclusive (one RMSNorm per captured state, or one over "
                             "their concatenation)")
        if self.layout == "mla":
            missing = [f for f in _MLA_FIELDS if not getattr(self, f)]
            if missing:
                raise ValueError(f"layout 'mla' needs {missing}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim not in (None, qk):
                raise ValueError(f"layout 'mla': head_dim is qk_nope_head_dim + qk_rope_head_dim = {qk}, got "
                                 f"{self.head_dim}")
            self.head_dim = qk
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError("layout 'mla': every head has its own key (num_key_value_heads = "
                                 "num_attention_heads)")
            kinds = MLA_ROPE_TYPES
        else:
            given = [f for f in ("q_lora_rank", *_MLA_FIELDS) if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given} are MLA fields: layout 'llama' takes none of them")
            if self.head_dim is None:
                if self.hidden_size % self.num_attention_heads:
                    raise ValueError("head_dim not given and hidden_size is not divisible by num_attention_heads")
                self.head_dim = self.hidden_size // self.num_attention_heads
            if self.head_dim % 2:
                raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
            kinds = LLAMA_ROPE_TYPES
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported (SGLang's Eagle3 drafters use 'silu')")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in 1..vocab_size ({self.vocab_size})")
        if self.num_aux_layers < 1:
            raise ValueError("num_aux_layers must be >= 1")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = rope_type(self.rope_scaling)
            if kind not in kinds:
                raise NotImplementedError(f"rope_scaling type {kind!r} not supported by layout {self.layout!r}; "
                                          f"supported: {kinds}")

    @property
    def v_dim(self) -> int:
        """Per-head value width (llama: head_dim)."""
        return self.v_head_dim if self.layout == "mla" else self.head_dim

    @property
    def options(self) -> list[str]:
        """The EAGLE-3.1 options switched on, in OPTIONS order."""
        return [o for o in OPTIONS if getattr(self, o)]

    def draft_kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """What one speculated token costs in the serving engine's draft KV cache: llama, a key and a value per kv
        head; mla, SGLang's latent (kv_lora_rank + qk_rope_head_dim, shared by all heads)."""
        if self.layout == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_value
        return 2 * self.num_key_value_heads * self.head_dim * bytes_per_value

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return d

    @classmethod
    def from_dict(cls, d: dict, *, strict: bool = True) -> "DrafterConfig":
        """Inverse of to_dict. strict: unknown keys raise (a typo must not silently become a default). Records
        written before layouts and options existed read as the llama layout with every option off."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown and strict:
            raise ValueError(f"unknown DrafterConfig keys: {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})
