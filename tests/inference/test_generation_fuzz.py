"""Generation that never crashes: random Generator cases (tests/generation_fuzz.py) in
this process and in fresh ones, and the two commands that generate and evaluate through it.

CPU: the static step (what the graphs replay, uncaptured) and the eager decode, every sampling
setting. GPU (`gpu` marker): the CUDA-graph decode, compile on and off, the kernels' FFN on a
Hopper GPU, one GPU visible and two. The draw is seeded: SPARSE_LLM_FUZZ_SEED picks another,
SPARSE_LLM_FUZZ_CASES sets the cases per process; a failing case is printed with its fields.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from generation_fuzz import run

from sparse_llm.config import ModelConfig
from sparse_llm.data import load_tokenizer
from sparse_llm.model import build_model
from sparse_llm.model.hf_export import export_hf

REPO = Path(__file__).resolve().parents[2]
FUZZ = REPO / "tests" / "generation_fuzz.py"
SEED = int(os.environ.get("SPARSE_LLM_FUZZ_SEED", "0"))


def cases(default: int) -> int:
    return int(os.environ.get("SPARSE_LLM_FUZZ_CASES", default))


def make_export(path: Path, hidden: int, intermediate: int, heads: int, context: int) -> Path:
    """A random-init model with the embedded tokenizer, exported (D and H multiples of 8: the
    kernels take it). Peaked logits (initializer_range 0.2): greedy near ties are rare."""
    tokenizer = load_tokenizer("embedded")
    cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        max_position_embeddings=context,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    export_hf(build_model(cfg), tokenizer, path)
    return path


def fuzz_in_fresh_process(
    export: Path, devices: list[str], seed: int, n: int, env: dict[str, str] | None = None, *limits: str
) -> None:
    argv = [sys.executable, str(FUZZ), str(export), "--seed", str(seed), "--cases", str(n), *limits]
    argv += [f"--device={d}" for d in devices]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert f"{n} cases passed" in done.stdout


@pytest.fixture(scope="module")
def cpu_export(tmp_path_factory) -> Path:
    return make_export(tmp_path_factory.mktemp("fuzz") / "export", 64, 128, 2, context=400)


# The CPU cases are smaller (a few seconds each on a laptop CPU); the GPU's take the whole ranges.
CPU_LIMITS = dict(max_batch=6, max_new=24)


def test_generation_fuzz_on_cpu(cpu_export):
    """Static and eager decode, every sampling setting: greedy and seeded tokens equal the eager
    decode's, every finish reason matches its row."""
    run(cpu_export, ["cpu"], SEED, cases(8), compile_cases=0, **CPU_LIMITS)


@pytest.mark.slow
def test_generation_fuzz_on_cpu_in_a_fresh_process(cpu_export):
    limits = ["--max-batch", str(CPU_LIMITS["max_batch"]), "--max-new-tokens", str(CPU_LIMITS["max_new"])]
    fuzz_in_fresh_process(cpu_export, ["cpu"], SEED + 1, cases(2), None, *limits)


# --------------------------------------------------------------------------------------------
# GPU: the CUDA-graph decode.


@pytest.fixture(scope="module")
def gpu_export(tmp_path_factory) -> Path:
    return make_export(tmp_path_factory.mktemp("fuzz_gpu") / "export", 128, 512, 4, context=1024)


def first_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[0] if visible else "0"


@pytest.mark.gpu
def test_generation_fuzz_on_a_gpu(gpu_export):
    """Issue 51's reproducer, then random cases, in this process (one compiled)."""
    run(gpu_export, ["cuda"], SEED, cases(12), compile_cases=1)


@pytest.mark.gpu
def test_generation_fuzz_in_fresh_processes_with_one_gpu_visible(gpu_export):
    for offset in (1, 2):
        fuzz_in_fresh_process(
            gpu_export, ["cuda"], SEED + offset, cases(5), {"CUDA_VISIBLE_DEVICES": first_gpu()}
        )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
def test_generation_fuzz_with_two_gpus_visible(gpu_export):
    """Generators on the first GPU and on the second, one after another, in one fresh process."""
    fuzz_in_fresh_process(gpu_export, ["cuda", "cuda:1"], SEED + 3, cases(8))


@pytest.mark.gpu
def test_generate_command_on_a_gpu(gpu_export):
    """sparse-llm-generate as a user runs it: batch 1 and 8, sampled (seeded and not) and greedy;
    greedy, the graph decode prints the eager decode's text."""

    def generate(*argv: str) -> dict:
        cmd = [
            sys.executable,
            "-m",
            "sparse_llm.generate",
            str(gpu_export),
            "--max-new-tokens",
            "32",
            "--json",
        ]
        done = subprocess.run([*cmd, *argv], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    for batch in (1, 8):
        prompts = [arg for _ in range(batch) for arg in ("--prompt", "import os\ndef main():")]
        for sampling in (["--temperature", "0.8", "--seed", "0"], ["--temperature", "0.7", "--top-k", "40"]):
            result = generate(*prompts, *sampling)
            assert result["decode"] == "graph" and len(result["outputs"]) == batch
        graph = generate(*prompts, "--prompt", "x")
        assert graph["outputs"] == generate(*prompts, "--prompt", "x", "--decode", "eager")["outputs"]


@pytest.mark.gpu
def test_eval_command_on_a_gpu(gpu_export, tmp_path):
    """sparse-llm-eval on a shipped task scores through the Generator (the decode graphs built)."""
    pytest.importorskip("lm_eval")
    export = shutil.copytree(gpu_export, tmp_path / "export")  # its results go under it
    cmd = [
        sys.executable,
        "-m",
        "sparse_llm.eval",
        str(export),
        "--tasks",
        "python_completion",
        "--limit",
        "8",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| python_completion | acc |" in done.stdout
