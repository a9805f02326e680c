"""The target-L0 controller in a real run (its own file: the suite's longest test, which pytest-xdist
can then run beside the rest of tests/training/test_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import tiny_run_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparse_llm.config import RunConfig
from sparse_llm.data.tokenizer import EOS_TOKEN
from sparse_llm.training.trainer import Trainer


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(cfg: RunConfig) -> None:
    Trainer(cfg, Path(cfg.run_dir)).fit()


def byte_tokenizer(directory: Path) -> str:
    """A byte-level tokenizer (256 bytes and EOS, no merges) saved in `directory`, for data.tokenizer.
    The controller's loop does not depend on the vocabulary, and the embedded tokenizer's 4096 made
    the output layer and loss most of the run's time: with 257, a 300-step run takes ~7 s of one core,
    not ~25 s."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE(vocab={**{c: i for i, c in enumerate(alphabet)}, EOS_TOKEN: 256}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN).save_pretrained(str(directory))
    return str(directory)


# A run where the tiny model's L0 settles within ~100 steps: constant lr 1e-2, 512 tokens a step;
# the last record's l0/mean is the mean over its last 150 steps. (300 steps, not 400, for the
# suite's time. At 256 tokens a step and the embedded tokenizer the loop was too noisy: one seed of
# four ended 40% off the target at 400 steps, 18% off at 200. With the byte tokenizer, 200 steps
# ended within 5.4% at seeds 0-3, but with the fixed coefficient only 1.36x the target at seed 1.)
TARGET_RUN = dict(max_steps=300, lr=1e-2, min_lr_ratio=1.0, log_every=150)
TARGET_RUN.update(seq_len=64, global_batch_size=8, micro_batch_size=8)


@pytest.mark.slow
def test_target_l0_controller_reaches_the_target_a_fixed_coefficient_misses(tmp_path: Path):
    """From lambda 3e-3, with which the tiny model holds L0 ~11-19, the controller settles at the
    target L0 8. gain 0.1: the tiny model's L0 drifts during training, and the default 0.05 trails
    it by up to 19% in a run this short (sparse_llm/sparsity/controller.py). With the embedded
    tokenizer, over 8 seeds x 1 or 2 threads the 400-step run ended within 9% of the target, over 4
    seeds (1 thread) this 300-step one within 9.1%. With the byte tokenizer, at seeds 0-3 (train.seed,
    1 thread) this run ended at L0 7.96, 8.17, 7.94, 8.22 (within 2.8%) and the fixed coefficient
    at 13.1, 11.3, 12.5, 12.0 (1.41x to 1.64x the target). (From above, from a lambda 10x too large,
    the spread is wider: units silenced by the large lambda come back slowly.)"""
    target = 8.0
    start = dict(l1_coeff=3e-3, l1_warmup_end=60)
    controlled = dict(start, target_l0=target, controller=dict(gain=0.1))
    tokenizer = byte_tokenizer(tmp_path / "tokenizer")
    for name, sparsity in (("target", controlled), ("fixed", start)):
        cfg = tiny_run_config(tmp_path / name, sparsity=sparsity, **TARGET_RUN)
        cfg.data.tokenizer = tokenizer
        train(cfg)
    records, fixed = read_metrics(tmp_path / "target"), read_metrics(tmp_path / "fixed")
    assert [r["step"] for r in records] == [1, 150, 300]
    assert abs(records[-1]["l0/mean"] / target - 1) < 0.15, records[-1]["l0/mean"]
    assert fixed[-1]["l0/mean"] > 1.3 * target, fixed[-1]["l0/mean"]
    assert fixed[-1]["l1_coeff"] == 3e-3
    # The controller raised lambda (embedded tokenizer: 1.46x to 1.6x across machines at 400 steps,
    # 1.55x to 5.8x over 4 seeds at 300; byte tokenizer: 3.3x to 5.6x at seeds 0-3; the end value is
    # sensitive to the CPU's float kernels and to the seed).
    assert records[-1]["l1_coeff"] > 3e-3 * 1.25
