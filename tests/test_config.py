"""Config composition and start-up validation: every bad input names its key before compute."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from sparse_llm.config import ConfigError, load_config
from sparse_llm.train import CONFIG_DIR


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_default_config_is_valid():
    cfg = load_config(composed())
    assert cfg.model.name == "tiny"
    assert cfg.data.source == "embedded"
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


@pytest.mark.parametrize("preset,layers", [("0.5b", 8), ("1b", 18), ("1.5b", 28), ("2b", 38)])
def test_paper_presets(preset, layers):
    cfg = load_config(composed(f"model={preset}"))
    m = cfg.model
    assert (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.vocab_size) == (
        2048,
        5632,
        32,
        49152,
    )
    assert m.num_hidden_layers == layers and m.tie_word_embeddings and m.rope_theta == 1e5


def test_experiment_preset_composes():
    cfg = load_config(composed("experiment=bench_1b"))
    assert cfg.model.name == "1b" and cfg.train.seq_len == 2048 and cfg.sparsity.l1_coeff == 0.0


def test_unknown_key_on_command_line_is_rejected():
    with pytest.raises(ConfigCompositionException, match="maxsteps"):
        composed("train.maxsteps=3")


def test_unknown_key_in_a_config_file_is_named():
    with pytest.raises(ConfigError, match=r"train\.maxsteps"):
        load_config({"train": {"maxsteps": 3}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        load_config(composed("train.max_steps=abc"))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.global_batch_size=12", "train.micro_batch_size=8"], "train.global_batch_size"),
        (["model.num_attention_heads=3"], "model.num_attention_heads"),
        (["model.ffn_impl=sparse"], "model.ffn_impl"),
        (["model.ffn_dense_above=0"], "model.ffn_dense_above"),
        (["data.prefetch=-1"], "data.prefetch"),
        (["data=files", "data.paths=[]"], "data.paths"),
        (["data=files", "data.paths=[/nonexistent/*.jsonl]"], "data.paths"),
        (["data.tokenizer=/nonexistent/tokenizer"], "data.tokenizer"),
        (["data.source=hub"], "data.hub_id"),
        (["train.seq_len=4096"], "train.seq_len"),
        (["sparsity.l1_coeff=-1"], "sparsity.l1_coeff"),
        (["train.resume=/nonexistent/ckpt"], "train.resume"),
        (["logger.wandb.mode=sometimes"], "logger.wandb.mode"),
    ],
)
def test_cross_field_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(composed(*overrides))


def test_global_batch_must_divide_by_world_size():
    raw = composed("train.global_batch_size=16", "train.micro_batch_size=8")
    load_config(raw, world_size=2)
    with pytest.raises(ConfigError, match="world size"):
        load_config(raw, world_size=3)


def test_local_file_paths_are_accepted(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    cfg = load_config(composed("data=files", f"data.paths=[{tmp_path}/*.jsonl]"))
    assert cfg.data.paths == [f"{tmp_path}/*.jsonl"]
