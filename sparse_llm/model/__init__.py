"""The model: a Llama-style decoder whose FFN implementation is fixed when it is built."""

from sparse_llm.model.ffn import FFNPlan, GatedMLP
from sparse_llm.model.kv_cache import KVCache
from sparse_llm.model.llama import CausalLMOutput, FFNStats, SparseLlamaForCausalLM, build_model

__all__ = [
    "CausalLMOutput",
    "FFNPlan",
    "FFNStats",
    "GatedMLP",
    "KVCache",
    "SparseLlamaForCausalLM",
    "build_model",
]
