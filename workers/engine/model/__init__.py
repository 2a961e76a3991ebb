"""Llama-family models over the paged KV cache."""

from workers.engine.model.llama import LlamaForCausalLM
from workers.engine.model.model_config import ModelConfig, RopeConfig, UnsupportedModelError
from workers.engine.model.weights import load_hf_weights

__all__ = ["LlamaForCausalLM", "ModelConfig", "RopeConfig", "UnsupportedModelError", "load_hf_weights"]
