"""Export to a plain Hugging Face checkpoint: LlamaForCausalLM with hidden_act relu (or silu).

The export loads with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
and no custom code, and gives the same logits as our model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, PreTrainedTokenizerBase

from sparse_llm.config import ModelConfig
from sparse_llm.model.llama import SparseLlamaForCausalLM
from sparse_llm.model.state import model_state_to_save, write_safetensors


def to_hf_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> LlamaConfig:
    special = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        attention_bias=False,
        mlp_bias=False,
        **special,
    )


def export_hf(
    model: SparseLlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = to_hf_config(model.config, tokenizer)
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.dtype = dtype
    hf_config.save_pretrained(out_dir)
    state = {name: tensor.to(dtype) for name, tensor in model_state_to_save(model).items()}
    write_safetensors(state, out_dir / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
