"""The model: a Llama-style decoder whose FFN implementation is fixed when it is built."""

from sparse_llm.model.ffn import FFNBlock, FFNPlan, FFNStats, GatedMLP
from sparse_llm.model.kv_cache import KVCache
from sparse_llm.model.llama import CausalLMOutput, SparseLlamaForCausalLM, build_model

__all__ = [
    "CausalLMOutput",
    "FFNBlock",
    "FFNPlan",
    "FFNStats",
    "GatedMLP",
    "KVCache",
    "SparseLlamaForCausalLM",
    "build_model",
]
