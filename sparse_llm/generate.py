"""Generate text from a trained model: an HF export directory, a checkpoint or a run directory.

    python -m sparse_llm.generate runs/my_run/export --prompt "def main():" --max-new-tokens 64
    sparse-llm-generate runs/my_run/checkpoints/step_00000300 --prompt-file prompts.txt \
        --temperature 0.8 --top-p 0.95 --seed 0 --prefill-ffn cuda --decode-ffn dense --json

Prompts of different lengths are batched together (left padding); each stops at its EOS or
after --max-new-tokens. Decoding is greedy unless --temperature > 0: greedy repeats a small
model's likeliest token (on the tiny default run, a newline), so sample there
(--temperature 0.7 --top-k 40). --prefill-ffn / --decode-ffn pick the FFN per phase: fastest (the
default: dense and the CUDA kernels timed at load on a GPU where the kernels can run, dense
elsewhere), auto (the kernels wherever they can run), dense, reference or cuda. --decode picks
how decode steps run: auto (one CUDA graph a step on a GPU where the decode FFN can be captured,
else eager), graph, static (the graph's step uncaptured) or eager. The last line (stderr) gives
the new tokens per second of the generation, prefill included, and the decode mode.

Errors are one line on stderr: exit code 2 for a usage error or a path that holds no model, 4 for
a damaged model (a weights file that is truncated or does not match its recorded SHA-256, a
config that does not parse, weights of another shape than the config's: the line names the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from sparse_llm.inference import DECODE_MODES, FASTEST, Generator, SamplingParams, load_model
from sparse_llm.inference.calibrate import CHOICES as FFN_CHOICES
from sparse_llm.inference.loading import DamagedModel

EXIT_DAMAGED = 4  # the model's files are damaged or disagree (sparse_llm.inference.loading)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="export directory, checkpoints/step_* directory or run directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", type=Path, help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-stop-at-eos", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    p.add_argument("--prefill-ffn", default=FASTEST, choices=FFN_CHOICES)
    p.add_argument("--decode-ffn", default=FASTEST, choices=FFN_CHOICES)
    p.add_argument("--decode", default="auto", choices=DECODE_MODES, help="how decode steps run")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the prefill (pays off for long prompts)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def greedy_note(texts: list[str], temperature: float) -> str | None:
    """What to tell a user whose greedy generations are blank (a small model's likeliest token is
    often a newline, which greedy decoding repeats), or None."""
    blank = sum(1 for text in texts if not text.strip())
    if temperature > 0 or not blank:
        return None
    return (
        f"note: greedy decoding gave only whitespace for {blank} of {len(texts)} prompts (a small "
        "model's likeliest token is often a newline); sample instead: --temperature 0.7 --top-k 40"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = list(args.prompt)
    try:
        if args.prompt_file is not None:
            if not args.prompt_file.is_file():
                raise FileNotFoundError(f"--prompt-file: no such file {args.prompt_file}")
            prompts += [line for line in args.prompt_file.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError("give at least one --prompt or a --prompt-file")
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop_at_eos=not args.no_stop_at_eos,
        )
        loaded = load_model(args.model, args.device, args.dtype)
        generator = Generator(
            loaded, args.prefill_ffn, args.decode_ffn, compile=args.compile, decode=args.decode
        )
    except DamagedModel as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_DAMAGED
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = generator.generate_ids(generator.encode(prompts), params)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(t) for t in out.tokens)
    tokens_per_s = new_tokens / max(seconds, 1e-9)
    texts = [generator.tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
    note = greedy_note(texts, args.temperature)
    if note is not None:
        print(note, file=sys.stderr)
    if args.json:
        measurement = generator.ffn_measurement
        result = {
            "model": str(loaded.path),
            "source": loaded.source,
            "device": str(loaded.model.lm_head.weight.device),
            "dtype": str(loaded.model.lm_head.weight.dtype),
            "ffn": generator.ffn,
            "ffn_measurement": measurement and dataclasses.asdict(measurement),
            "decode": generator.decode,
            "decode_reason": generator.decode_reason,
            "seconds": seconds,
            "new_tokens": new_tokens,
            "tokens_per_s": tokens_per_s,
            "outputs": [
                {"prompt": p, "text": t, "tokens": toks, "finish_reason": r}
                for p, t, toks, r in zip(prompts, texts, out.tokens, out.finish_reasons, strict=True)
            ],
        }
        print(json.dumps(result, indent=1))
        return 0
    for prompt, text, reason in zip(prompts, texts, out.finish_reasons, strict=True):
        print(f"{prompt}{text}")
        print(f"--- [{reason}]")
    print(
        f"{new_tokens} new tokens in {seconds:.2f}s ({tokens_per_s:,.1f} tokens/s); "
        f"ffn prefill={generator.ffn['prefill']} decode={generator.ffn['decode']}; decode mode {generator.decode}"
        + (f" ({generator.decode_reason})" if generator.decode_reason else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
