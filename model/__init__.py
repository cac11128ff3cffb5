"""Drafter architectures (eagle3.model): what train, export and eval build, one home for every layout.

  config.py   DrafterConfig: shape, layout ("llama" | "mla"), the EAGLE-3.1 options
  layers.py   shared pieces (RMSNorm, MLP, RoPE, the plain training-time-test attention)
  llama.py    SGLang's LlamaForCausalLMEagle3 attention and keys
  mla.py      SGLang's Eagle3DeepseekV2ForCausalLM attention (multi-latent) and keys
  drafter.py  Eagle3Drafter: the EAGLE-3 wiring around either attention (ttt_forward, forward_step), tensor_shapes
  kernels.py  the fast path's memory-lean autograd pieces (fused attention merge, norms, SiLU, the fused loss)
"""

from eagle3.model.config import LAYOUTS, OPTIONS, DrafterConfig
from eagle3.model.drafter import EXPORT_KEYS, Eagle3Drafter, architecture, tensor_shapes

__all__ = ["LAYOUTS", "OPTIONS", "DrafterConfig", "EXPORT_KEYS", "Eagle3Drafter", "architecture", "tensor_shapes"]
