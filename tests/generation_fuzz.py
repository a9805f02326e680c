"""Random generation cases for the Generator: what tests/inference/test_generation_fuzz.py runs in
its own process and, as a script, in fresh ones.

    python tests/generation_fuzz.py EXPORT --device cuda --seed 7 --cases 10

A case draws a batch (1-16 rows, one prompt repeated or distinct ones of 1 token up to near the
context), max_new_tokens (1-300), a sampling setting (greedy, temperature, top-k, top-p, a seed or
none), the FFN of each phase (fastest, dense and, where the kernels run, cuda), compile off or on,
the decode mode (auto: CUDA graphs where they can run; static; eager), sometimes an EOS that some
rows sample, and builds a new Generator for it (generators made one after another, as a user
makes them). Each case checks that nothing raises, that every row's finish reason matches its
tokens, and, greedy, that the Generator's decode gives the eager decode's tokens, token for token
up to a near tie (`check_same_up_to_ties`); seeded, that the same call gives the same tokens again
(and, on the CPU, where both run the same arithmetic, the eager decode's samples). Every case is
printed before it runs: a failure names its case, and `--seed` replays the draw.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sparse_llm.inference import GenerationOutput, Generator, SamplingParams, generate_ids, load_model
from sparse_llm.inference.loading import LoadedModel
from sparse_llm.ops import kernels_unavailable

MAX_BATCH = 16
MAX_NEW_TOKENS = 300
# A greedy divergence is a floating-point tie when the two tokens' logits differ by at most this
# fraction of the largest logit (bf16 keeps 8 bits of mantissa; the graph's attention kernels round
# otherwise than the eager decode's).
TIE_FRACTION = 2**-6


@dataclass(frozen=True)
class Case:
    index: int
    device: str
    batch: int
    repeated: bool  # one prompt in every row, else a prompt of its own length per row
    longest: int  # the longest prompt's tokens
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    prefill_ffn: str
    decode_ffn: str
    compile: bool
    decode: str
    eos_from_output: bool  # stop at a token the eager decode gives (some rows stop early)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )


def ffn_choices(device: str) -> tuple[str, ...]:
    """The FFN values a case draws from on `device`: cuda only where the kernels run."""
    if kernels_unavailable(device) is None:
        return ("fastest", "dense", "cuda")
    return ("fastest", "dense")


def draw_case(
    rng: random.Random,
    index: int,
    devices: list[str],
    context: int,
    compile_ok: bool,
    max_batch: int = MAX_BATCH,
    max_new: int = MAX_NEW_TOKENS,
) -> Case:
    """One random case; `compile_ok` allows compile=True (slow: Inductor compiles per shape)."""
    device = rng.choice(devices)
    new_tokens = rng.choice([1, rng.randint(2, min(40, max_new)), rng.randint(2, max_new)])
    longest = rng.choice([1, rng.randint(2, 64), rng.randint(1, context - new_tokens)])
    sampling = rng.choices(["greedy", "temperature", "top_k", "top_p", "all"], [4, 1, 1, 1, 1])[0]
    temperature = 0.0 if sampling == "greedy" else rng.choice([0.5, 0.8, 1.0, 1.3])
    top_k = rng.choice([1, 5, 40]) if sampling in ("top_k", "all") else 0
    top_p = rng.choice([0.5, 0.9, 0.95]) if sampling in ("top_p", "all") else 1.0
    ffns = ffn_choices(device)
    return Case(
        index=index,
        device=device,
        batch=rng.choice([1, 2, 3, rng.randint(4, max_batch)]),
        repeated=rng.random() < 0.4,
        longest=longest,
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=None if rng.random() < 0.35 else rng.randint(0, 2**31 - 1),
        prefill_ffn=rng.choice(ffns),
        decode_ffn=rng.choice(ffns),
        compile=compile_ok and rng.random() < 0.5,
        decode=rng.choice(["auto", "auto", "eager"] if device.startswith("cuda") else ["static", "eager"]),
        eos_from_output=rng.random() < 0.3,
    )


def case_prompts(case: Case, vocab_size: int) -> list[list[int]]:
    rng = random.Random(case.index * 7919 + case.batch)
    prompt = [rng.randrange(1, vocab_size) for _ in range(case.longest)]  # 0 is the EOS here
    if case.repeated:
        return [prompt] * case.batch
    rows = [prompt] + [prompt[: rng.randint(1, case.longest)] for _ in range(case.batch - 1)]
    rng.shuffle(rows)
    return rows


def check_finish_reasons(out: GenerationOutput, eos: set[int], max_new: int, where: str) -> None:
    """Each row: "eos" and its last token (only) an EOS, or "length" and max_new tokens, no EOS."""
    for row, (tokens, reason) in enumerate(zip(out.tokens, out.finish_reasons, strict=True)):
        assert 1 <= len(tokens) <= max_new, f"{where}: row {row} has {len(tokens)} tokens"
        stops = [i for i, t in enumerate(tokens) if t in eos]
        if reason == "eos":
            assert stops == [len(tokens) - 1], f"{where}: row {row} 'eos' but its EOS at {stops}"
        else:
            assert reason == "length" and not stops and len(tokens) == max_new, (
                f"{where}: row {row} {reason!r} with {len(tokens)} tokens, EOS at {stops}"
            )


@torch.no_grad()
def check_same_up_to_ties(gen: Generator, prompts, got: GenerationOutput, want: GenerationOutput, where: str):
    """Greedy: each row's tokens equal the reference's until their first difference, where the
    two tokens must be a near tie of the model's logits there (then the rows legitimately part)."""
    for row, (mine, theirs) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        if mine == theirs:
            continue
        step = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        assert step is not None, (
            f"{where}: row {row} stopped at {len(mine)} tokens, the reference at {len(theirs)}"
        )
        ids = torch.tensor([list(prompts[row]) + theirs[:step]], device=gen.model.lm_head.weight.device)
        logits = gen.model(ids, last_logits_only=True).logits[0, -1].float()
        gap = (logits[mine[step]] - logits[theirs[step]]).abs().item()
        scale = logits.abs().max().item()
        assert gap <= TIE_FRACTION * scale, (
            f"{where}: row {row} differs at step {step} ({mine[step]} vs {theirs[step]}), a logit "
            f"gap of {gap:.4f} (largest logit {scale:.2f}): not a tie"
        )


def run_case(case: Case, loaded: dict[str, LoadedModel]) -> None:
    """Build the case's Generator and check its generation (see the module docstring)."""
    where = f"case {case.index} {asdict(case)}"
    print(where, flush=True)
    model = loaded[case.device]
    gen = Generator(model, case.prefill_ffn, case.decode_ffn, compile=case.compile, decode=case.decode)
    prompts = case_prompts(case, model.model.config.vocab_size)
    params = case.params
    eos: tuple[int, ...] = model.eos_token_ids

    def reference() -> GenerationOutput:  # the eager decode with the Generator's FFN plan
        return generate_ids(gen.model, prompts, params, eos)

    def generated() -> GenerationOutput:
        return generate_ids(gen.model, prompts, params, eos, gen.prefill_forward, gen.decoder)

    want = reference() if params.greedy or params.seed is not None else None
    if case.eos_from_output and want is not None:
        row = want.tokens[0]
        eos = (row[len(row) // 2],)  # row 0 stops there, other rows where they sample it
        want = reference()
    got = generated()
    check_finish_reasons(got, set(eos), params.max_new_tokens, where)
    if params.greedy:
        check_same_up_to_ties(gen, prompts, got, want, where)
    elif params.seed is not None:
        assert generated().tokens == got.tokens, f"{where}: the same seeded call gave other tokens"
        if case.device == "cpu":  # the same arithmetic: the eager decode's samples
            assert got.tokens == want.tokens, f"{where}: seeded samples differ from the eager decode's"


def reproducer(export: Path, device: str) -> None:
    """Issue 51's reproducer: a Generator from the export, one prompt at batch 1, then 8 times,
    seeded and not."""
    print(f"reproducer on {device}", flush=True)
    for seed in (0, None):
        gen = Generator.from_pretrained(export, device=device)
        for batch in (1, 8):
            out = gen.generate(
                ["import os\ndef main():"] * batch, max_new_tokens=32, temperature=0.8, seed=seed
            )
            assert len(out.texts) == batch and set(out.finish_reasons) <= {"eos", "length"}


def run(
    export: Path,
    devices: list[str],
    seed: int,
    cases: int,
    compile_cases: int,
    max_batch: int = MAX_BATCH,
    max_new: int = MAX_NEW_TOKENS,
) -> float:
    """The reproducer (on a GPU), then `cases` random cases (at most `compile_cases` compiled) of at
    most `max_batch` rows and `max_new` new tokens; the seconds taken."""
    start = time.perf_counter()
    loaded = {device: load_model(export, device=device) for device in devices}
    context = next(iter(loaded.values())).model.config.max_position_embeddings
    for device in devices:
        if device.startswith("cuda"):
            reproducer(export, device)
    rng = random.Random(seed)
    compiled = 0
    for index in range(cases):
        case = draw_case(rng, index, devices, context, compiled < compile_cases, max_batch, max_new)
        compiled += case.compile
        run_case(case, loaded)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path)
    p.add_argument("--device", action="append", help="a device the cases draw from (repeat); default cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--compile-cases", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = p.parse_args()
    took = run(
        args.export,
        args.device or ["cuda"],
        args.seed,
        args.cases,
        args.compile_cases,
        args.max_batch,
        args.max_new_tokens,
    )
    print(f"{args.cases} cases passed in {took:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
