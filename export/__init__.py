"""Export a trained drafter for serving (SGLang's LlamaForCausalLMEagle3, or vLLM)."""
