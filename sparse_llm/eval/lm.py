"""Our lm-evaluation-harness model class: lm-eval's requests scored by the project's inference path.

lm-eval asks a model for three things: the log-likelihood of a continuation after a context
(multiple-choice tasks ask it once per choice), the rolling log-likelihood of a whole document
(perplexity tasks), and greedy generation up to stop strings. `SparseLM` answers them with a
`SparseLlamaForCausalLM` and its FFN plan: a model from `Generator` (the FFN of its prefill phase,
`fastest` by default: the kernels where they run and measure faster) or the model a training run
holds (its evaluation phase). lm-eval's `TemplateLM` turns text into token requests (how a
context and continuation split into tokens, the prefix token before an empty context); scoring
batches requests of similar length, right-padded, through one forward each, so that a CPU run
equals lm-eval's own `hf` model on the export up to floating-point rounding.

    lm = SparseLM.from_pretrained("runs/my_run/export")
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"])

Registered with lm-eval as `sparse-llm`: simple_evaluate(model="sparse-llm",
model_args={"pretrained": "runs/my_run/export"}) once this module is imported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from sparse_llm.inference import FASTEST, Generator, SamplingParams, StaticDecoder, generate_ids
from sparse_llm.model import SparseLlamaForCausalLM

# A token request as TemplateLM hands it over: (the request's strings or None, context ids,
# continuation ids).
TokenRequest = tuple[Any, list[int], list[int]]
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generation tasks that set none
GENERATION_OPTIONS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


@register_model("sparse-llm")
class SparseLM(TemplateLM):
    """lm-eval's model interface over a SparseLlamaForCausalLM and its tokenizer.

    `batch_size` sequences at most per forward, and at most `max_batch_tokens` tokens including
    the padding (the forward's logits are [tokens, vocab]). `autocast` gives the context a forward
    runs in (a training run's mixed precision). `forward` replaces `model(ids)` for scoring (a
    compiled model); `decoder` runs generation's decode steps (a Generator's static decoder).
    `progress`: progress bars while scoring and generating. `max_length`: the context a request
    is cut to and a document windowed by (default and at most: the model's positions).
    """

    def __init__(
        self,
        model: SparseLlamaForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Sequence[int],
        batch_size: int = 32,
        max_batch_tokens: int = 32768,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        forward: Callable[..., Any] | None = None,
        decoder: StaticDecoder | None = None,
        progress: bool = True,
        max_length: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be an integer >= 1, got {max_batch_tokens!r}")
        positions = model.config.max_position_embeddings
        if max_length is not None and not 1 < max_length <= positions:
            raise ValueError(
                f"max_length must be in [2, {positions}] (the model's positions), got {max_length}"
            )
        if not eos_token_ids:
            raise ValueError("the model needs an EOS token id (lm-eval's end-of-text token)")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.autocast = autocast
        self.forward = forward or model
        self.decoder = decoder
        self.progress = progress
        self._max_length = max_length or positions
        self._device = model.lm_head.weight.device

    @classmethod
    def from_generator(cls, generator: Generator, **kwargs: Any) -> SparseLM:
        """Score with a Generator's model (its prefill FFN, its compiled prefill if it compiled
        one) and generate with its decoder."""
        if generator.prefill_forward is not None:  # a compiled forward reads the derived weights made before
            generator.model.prepare_inference()
        return cls(
            generator.model,
            generator.tokenizer,
            generator.eos_token_ids,
            forward=generator.prefill_forward,
            decoder=generator.decoder,
            **kwargs,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        prefill_ffn: str = FASTEST,
        decode_ffn: str = FASTEST,
        compile: bool = False,
        **kwargs: Any,
    ) -> SparseLM:
        """An export, checkpoint or run directory, loaded as `Generator.from_pretrained` loads it."""
        generator = Generator.from_pretrained(path, device, dtype, prefill_ffn, decode_ffn, compile)
        return cls.from_generator(generator, **kwargs)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> SparseLM:
        """lm-eval's constructor: model_args {"pretrained": <path>, ...: from_pretrained's keywords};
        lm-eval adds batch_size, max_batch_size and device where it was given them (model_args win)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        extra.pop("max_batch_size", None)  # lm-eval's bound for batch_size=auto, which we do not take
        args = {**extra, **arg_dict}
        if "pretrained" not in args:
            raise ValueError("model_args needs pretrained=<export, checkpoint or run directory>")
        return cls.from_pretrained(args.pop("pretrained"), **args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> SparseLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # ---- what lm-eval reads -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """Put before an empty context and a document's first window: BOS where the tokenizer has
        one, else the end-of-text token (what the model saw between packed documents)."""
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids of `string`, its special tokens added unless asked not to."""
        add = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=add)

    # ---- scoring ----------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding would give it) per request.

        A sequence longer than the context window keeps its last `max_length` tokens (the
        continuation always whole); requests run longest first, so a batch's padding is small. An
        empty continuation (a choice the tokenizer merges into the context's last token) is
        certain: log-likelihood 0."""
        inputs, targets = [], []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens exceeds the model's context "
                    f"({self.max_length} tokens)"
                )
            inputs.append((context + continuation)[-(self.max_length + 1) : -1])
            targets.append(continuation)
        order = sorted((i for i in range(len(inputs)) if targets[i]), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(inputs)
        bar = tqdm(total=len(order), desc="scoring", disable=disable_tqdm or not self.progress)
        for batch in self._batches(order, [len(inputs[i]) for i in order]):
            scores = self._score([inputs[i] for i in batch], [targets[i] for i in batch])
            for i, score in zip(batch, scores, strict=True):
                results[i] = score
            bar.update(len(batch))
        bar.close()
        return results

    def _batches(self, order: list[int], lengths: list[int]) -> Iterator[list[int]]:
        """Consecutive runs of `order` (longest first) of at most batch_size sequences and
        max_batch_tokens padded tokens; a sequence longer than the token budget runs alone."""
        start = 0
        while start < len(order):
            width = lengths[start]
            count = max(1, min(self.batch_size, self.max_batch_tokens // width, len(order) - start))
            yield order[start : start + count]
            start += count

    @torch.no_grad()
    def _score(self, inputs: list[list[int]], targets: list[list[int]]) -> list[tuple[float, bool]]:
        """One forward over the right-padded inputs (causal attention: the padding after a row's
        tokens changes none of its logits); each row's continuation is read from its last
        positions, all rows' at once: the log-softmax of those positions only, one sum per row."""
        width = len(inputs[0])
        ids = torch.full((len(inputs), width), self.eot_token_id, dtype=torch.long)
        rows, positions, wanted = [], [], []
        for row, (tokens, target) in enumerate(zip(inputs, targets, strict=True)):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            rows += [row] * len(target)
            positions += range(len(tokens) - len(target), len(tokens))
            wanted += target
        with self.autocast():
            logits = self.forward(ids.to(self._device)).logits
        rows_t = torch.tensor(rows, device=self._device)
        wanted_t = torch.tensor(wanted, device=self._device)
        logprobs = logits[rows_t, torch.tensor(positions, device=self._device)].float().log_softmax(-1)
        per_token = logprobs.gather(-1, wanted_t[:, None]).squeeze(-1)
        totals = torch.zeros(len(inputs), device=self._device).index_add_(0, rows_t, per_token)
        misses = (logprobs.argmax(-1) != wanted_t).float()
        greedy = torch.zeros(len(inputs), device=self._device).index_add_(0, rows_t, misses) == 0
        # One copy to the host for the whole batch.
        return list(zip(totals.tolist(), greedy.tolist(), strict=True))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, every token predicted once: lm-eval's rolling windows of
        the model's context (the first conditioned on the prefix token), scored as one pool."""
        owners, windows = [], []
        for doc, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                owners.append(doc)
                windows.append((None, context, continuation))
        totals = [0.0] * len(requests)
        for doc, (loglikelihood, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True
        ):
            totals[doc] += loglikelihood
        return totals

    # ---- generation -------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context, cut before the first stop string; requests with the same
        generation options run in batches of batch_size (left-padded prompts, the KV-cache decode)."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        outputs = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generating", disable=disable_tqdm or not self.progress)
        for members in groups.values():
            params, stops = self._generation_settings(requests[members[0]].args[1])
            room = self.max_length - params.max_new_tokens
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                prompts = [
                    self.tok_encode(requests[i].args[0])[-room:] or [self.prefix_token_id] for i in batch
                ]
                with self.autocast():
                    out = generate_ids(self.model, prompts, params, self.eos_token_ids, decoder=self.decoder)
                for i, tokens in zip(batch, out.tokens, strict=True):
                    outputs[i] = _cut(self.tokenizer.decode(tokens, skip_special_tokens=True), stops)
                bar.update(len(batch))
        bar.close()
        return outputs

    def _generation_settings(self, options: dict[str, Any]) -> tuple[SamplingParams, list[str]]:
        unknown = sorted(set(options) - set(GENERATION_OPTIONS))
        if unknown:
            raise ValueError(
                f"generation options {unknown} are not supported by the sparse-llm model "
                f"(it takes {', '.join(GENERATION_OPTIONS)})"
            )
        until = options.get("until") or []
        stops = [until] if isinstance(until, str) else list(until)
        max_new = int(options.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if max_new >= self.max_length:
            raise ValueError(
                f"max_gen_toks {max_new} leaves no room for a prompt in {self.max_length} tokens"
            )
        sample = bool(options.get("do_sample", False))
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=float(options.get("temperature", 1.0)) if sample else 0.0,
            top_p=float(options.get("top_p", 1.0)),
            top_k=int(options.get("top_k") or 0),
        )
        return params, stops


def _cut(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    cut = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:cut]
