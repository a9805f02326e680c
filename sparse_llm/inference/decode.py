"""Static-shape decode, captured in CUDA graphs: one token per row per step, no host sync.

The eager decode (generate.py: `eager_decode`) runs the same forward (`model.decode_step`) one
launch at a time and checks the EOS with a host sync every step, so a small batch spends its step
launching kernels. Here a `DecodeSlot` (one batch
size and cache-length bucket) holds static buffers (the KV cache; per row the token to feed, its
RoPE position, its cache column, its first real column and whether it has finished; the EOS ids),
and a step reads and advances them in place on the device (`decode_step`): `model.decode_step`
(attention over the whole cache under a key mask, the KV write at each row's device-side column,
the FFN of the plan's decode phase), sampling, the EOS bookkeeping. The step is captured once per
slot and sampling setting and replayed every step; between replays a device copy keeps each step's
tokens, and the host reads `finished.all()` every `EOS_CHECK_EVERY` steps.

Raw CUDA graphs, not torch.compile(mode="reduce-overhead"): the step's inputs already live in
static buffers that it mutates in place (the cache, positions, columns), which is exactly what a
raw graph replays. reduce-overhead would copy its inputs into buffers of its own, check guards on
every call, compile with Inductor per batch size and sampling setting, and quietly run eager where
it cannot capture (mutated inputs, a graph break), where a raw capture either happens or fails
when it is made. The step runs the same ops as the eager decode on a cache of the same length, so
it computes the same numbers; only the launches go.

`why_not_graph` says where graphs cannot be had (no CUDA device, a decode FFN that reads on the
host, for some batch sizes or all); a Generator decides its mode once, when it is built
(`resolve_decode_mode`).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparse_llm.inference.sampling import SamplingParams, sample_next
from sparse_llm.model import KVCache, SparseLlamaForCausalLM
from sparse_llm.ops.ffn.inference import decode_kernel_fits

DECODE_MODES = ("auto", "graph", "static", "eager")
# Decode FFNs a CUDA graph always captures. The kernels ("cuda") only where their decode kernel
# takes the rows (ops.ffn.inference.decode_kernel_fits); beyond it the TwELL kernels read their
# heavy-row count on the host in every call.
CAPTURABLE_DECODE_FFNS = frozenset({"dense", "reference"})
# A slot's cache length is the batch's need rounded up to this: nearby lengths share a graph, the
# attention reads at most this many columns more than needed, and mask rows stay 16-byte aligned.
CACHE_LEN_MULTIPLE = 256
# How often (in steps) the host reads whether every row has finished: the loop's one sync.
EOS_CHECK_EVERY = 16
# Steps run before a capture, so that one-time work (cuBLAS handles, kernel setup) is not captured.
WARMUP_STEPS = 2
# Slots (batch size x cache length) a StaticDecoder keeps, least recently used dropped first.
MAX_SLOTS = 16
NO_TOKEN = -1  # pads the EOS buffer: no token id equals it


def cache_len_bucket(columns: int) -> int:
    """The cache length of a slot for a batch that needs `columns` (prompt width + new tokens)."""
    return -(-columns // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE


def eos_capacity(count: int) -> int:
    """Room for `count` EOS ids in a slot's buffer: 4, or the next power of two."""
    return max(4, 1 << max(count - 1, 0).bit_length())


def why_ffn_not_capturable(impl: str, hidden_size: int, batch: int | None) -> str | None:
    """Why the decode FFN `impl` cannot be captured in a CUDA graph at `batch` rows (None: at some
    batch), or None when it can."""
    if impl in CAPTURABLE_DECODE_FFNS:
        return None
    if not decode_kernel_fits(1, hidden_size):
        return (
            f"the {impl!r} decode FFN reads on the host at hidden size {hidden_size} (its decode "
            "kernel, which does not, takes smaller models)"
        )
    if batch is not None and not decode_kernel_fits(batch, hidden_size):
        return (
            f"the {impl!r} decode FFN reads on the host at batch {batch} (its decode kernel, which "
            "does not, takes fewer rows)"
        )
    return None


def why_not_graph(model: SparseLlamaForCausalLM, batch: int | None = None) -> str | None:
    """Why `model`'s decode step (of `batch` rows; None: of some batch) cannot be captured in a
    CUDA graph, or None when it can."""
    why = why_ffn_not_capturable(model.ffn_plan.decode.impl, model.config.hidden_size, batch)
    if why:
        return why
    device = model.lm_head.weight.device
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the model is on {device}"
    return None


def resolve_decode_mode(model: SparseLlamaForCausalLM, requested: str) -> tuple[str, str | None]:
    """The decode mode a Generator runs (fixed when it is built) and why it is not `graph`:

    auto    graph where it can run (a CUDA device, a capturable decode FFN), eager elsewhere
    graph   the static step captured in CUDA graphs; a ValueError where it cannot run
    static  the same static step, not captured (any device: what the graphs replay, for checks)
    eager   one forward per step over the filled columns of the cache (generate.py)
    """
    if requested not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {requested!r}")
    why = why_not_graph(model)
    if requested == "auto":
        return ("eager", why) if why else ("graph", None)
    if requested == "graph" and why:
        raise ValueError(f"decode='graph' cannot run: {why}; use decode='eager' or 'auto'")
    return requested, None if requested == "graph" else f"decode={requested!r} was asked for"


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether each token is one of the ids in `eos` (on the device, no sync)."""
    return (tokens[:, None] == eos[None, :]).any(-1)


@dataclass
class DecodeState:
    """The static buffers one slot decodes in: what `decode_step` reads and advances in place,
    and what a captured graph replays on. All [B] but the cache and `eos`."""

    cache: KVCache
    tokens: torch.Tensor  # int64: the token each row feeds next (the last one sampled)
    positions: torch.Tensor  # int64: its RoPE position
    columns: torch.Tensor  # int64: the cache column it is written to
    first_columns: torch.Tensor  # int64: the row's first real column (left padding before it)
    finished: torch.Tensor  # bool: the row has sampled an EOS
    eos: torch.Tensor  # int64 [E]: the EOS ids, padded with NO_TOKEN

    @classmethod
    def over(cls, cache: KVCache, eos_slots: int) -> DecodeState:
        """The buffers of a batch decoding into `cache`, with room for `eos_slots` EOS ids."""
        batch, device = cache.k.shape[1], cache.k.device

        def ids() -> torch.Tensor:
            return torch.zeros(batch, device=device, dtype=torch.long)

        return cls(
            cache=cache,
            tokens=ids(),
            positions=ids(),
            columns=ids(),
            first_columns=ids(),
            finished=torch.zeros(batch, device=device, dtype=torch.bool),
            eos=torch.full((eos_slots,), NO_TOKEN, device=device, dtype=torch.long),
        )

    def reset(self) -> None:
        """Every row at column and position 0, unfinished: where warm-up steps may run whatever
        the last batch left (its columns may end at the cache's last)."""
        for ids in (self.tokens, self.positions, self.columns, self.first_columns):
            ids.zero_()
        self.finished.zero_()

    def prefill_cache(self) -> KVCache:
        """The cache as an empty KVCache, for a prefill to fill from column 0."""
        return KVCache.from_tensors(self.cache.k, self.cache.v)

    def load(self, first: torch.Tensor, lengths: torch.Tensor, width: int, eos: torch.Tensor) -> None:
        """Start decoding after the prefill of prompts left-padded to `width` columns (`lengths`:
        [B] real tokens each) whose first new tokens are `first` ([B]); `eos`: the EOS ids (empty:
        none). Device-to-device copies only."""
        if first.shape != self.tokens.shape or lengths.shape != self.tokens.shape:
            raise ValueError(
                f"need {self.tokens.shape[0]} first tokens and lengths, got {tuple(first.shape)}"
            )
        if eos.numel() > self.eos.numel():
            raise ValueError(f"{eos.numel()} EOS ids exceed this slot's {self.eos.numel()}")
        self.tokens.copy_(first)
        self.positions.copy_(lengths)
        self.columns.fill_(width)
        self.first_columns.copy_(width - lengths)
        self.eos.fill_(NO_TOKEN)[: eos.numel()].copy_(eos)
        self.finished.copy_(is_eos(first, self.eos))


def decode_step(
    forward: Callable[..., torch.Tensor],
    state: DecodeState,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> None:
    """One token per row, in place on `state`, with static shapes and no host sync: the forward
    (`model.decode_step`, or it compiled) of the fed tokens, the next tokens sampled (0 for rows
    already finished, as in the eager decode), the finished flags updated, positions and columns
    advanced."""
    logits = forward(state.tokens, state.cache, state.positions, state.columns, state.first_columns)
    token = sample_next(logits, params, generator)
    token = torch.where(state.finished, 0, token)
    state.finished.logical_or_(is_eos(token, state.eos))
    state.tokens.copy_(token)
    state.positions.add_(1)
    state.columns.add_(1)


class CaptureMemory:
    """Where one decoder's graphs are captured: a memory pool and a stream on the model's device,
    both held for the decoder's life.

    The pool: the caching allocator counts the users of a graph pool (graphs captured into it and
    MemPool objects), not the handles that name it. With a bare `graph_pool_handle()` the count
    fell to 0 whenever every graph captured into it was gone (the decoder grew its cache memory,
    made a slot anew for more EOS ids, evicted its last captured slot); a block the captures had
    left allocated (likely cuBLAS's workspace for the capture stream) kept the pool registered,
    and the next capture into it failed in
    `create_or_incref_pool` (`it->second->use_count > 0 INTERNAL ASSERT FAILED`). The failed
    `capture_begin` had already put the graph's generators (the device's default one, the slot's)
    in capture mode and never took them out, so every later draw raised "Offset increment outside
    graph capture encountered unexpectedly". A MemPool is one user of its pool for as long as it
    lives: the count never reaches 0 while the decoder can capture.

    The stream: warm-up and capture run on this one stream. Work that is done once per stream
    (cuBLAS and cuBLASLt give every stream a workspace, allocated on its first GEMM) then happens
    in a warm-up, outside any capture, instead of in the first capture on torch.cuda.graph's own
    stream, where the workspace came from the graph pool and stayed allocated there for the life
    of the process. And the stream is on the model's device: torch.cuda.graph's default stream is
    one for the process, made on whichever device was current at the first capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):  # a MemPool belongs to the current device
            self.pool = torch.cuda.MemPool()
            self.stream = torch.cuda.Stream()


class DecodeGraph:
    """`step` captured in a CUDA graph: calling it replays the step on whatever the buffers it was
    captured on hold. `generator` (a seeded generator the step draws from) is registered with the
    graph, so that a replay draws what an eager step would at the generator's state.

    The graphs of a decoder share one memory pool (`CaptureMemory`): a step keeps nothing it
    allocates (its results go to the slot's buffers, made outside the capture), and only one graph
    runs at a time, so their temporaries may overlap."""

    def __init__(
        self, step: Callable[[], None], memory: CaptureMemory, generator: torch.Generator | None
    ) -> None:
        with torch.cuda.device(memory.device):
            memory.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(memory.stream):
                for _ in range(WARMUP_STEPS):
                    step()
            torch.cuda.current_stream().wait_stream(memory.stream)
            self.graph = torch.cuda.CUDAGraph()
            if generator is not None:
                self.graph.register_generator_state(generator)
            with torch.cuda.graph(self.graph, pool=memory.pool.id, stream=memory.stream):
                step()

    def __call__(self) -> None:
        self.graph.replay()


def _sampling_key(params: SamplingParams) -> tuple[SamplingParams, bool]:
    """What a captured step depends on: how it samples, and whether from a seeded generator."""
    if params.greedy:
        return SamplingParams(max_new_tokens=1), False
    how = SamplingParams(
        max_new_tokens=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k
    )
    return how, params.seed is not None


class DecodeSlot:
    """One batch size and cache length of a `StaticDecoder`: its `DecodeState` and its steps, one
    per sampling setting (graphs captured in `graph_memory`, else, without it, `decode_step`
    itself)."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        cache: KVCache,
        eos_slots: int,
        graph_memory: CaptureMemory | None = None,
    ) -> None:
        self.forward, self.graph_memory = forward, graph_memory
        self.state = DecodeState.over(cache, eos_slots)
        # Seeded calls draw from this one generator, reseeded per call: a graph captured with it
        # registered replays for any seed.
        self.generator = torch.Generator(cache.k.device)
        self.steps: dict[tuple[SamplingParams, bool], Callable[[], None]] = {}

    @torch.no_grad()
    def step_for(self, params: SamplingParams) -> Callable[[], None]:
        """The step for `params`, made (captured) on first use. A capture runs WARMUP_STEPS steps on
        the buffers and the cache: ask for the step before the prefill and `load`."""
        key = _sampling_key(params)
        if key not in self.steps:
            how, seeded = key
            generator = self.generator if seeded else None
            step = functools.partial(decode_step, self.forward, self.state, how, generator)
            if self.graph_memory is not None:
                self.state.reset()
                step = DecodeGraph(step, self.graph_memory, generator)
            self.steps[key] = step
        return self.steps[key]

    @torch.no_grad()
    def decode(
        self,
        first: torch.Tensor,
        lengths: torch.Tensor,
        width: int,
        params: SamplingParams,
        eos: torch.Tensor,
    ) -> torch.Tensor:
        """New tokens [B, n] (n <= max_new_tokens; 0 after a row's EOS), `first` ([B], sampled from
        the prefill's last logits) and then one step a token, after a prefill into this slot's cache
        of prompts left-padded to `width` columns (`lengths`: [B] real tokens each); `eos`: the
        EOS ids (empty: none), read on the host every EOS_CHECK_EVERY steps. The step must have
        been asked for (`step_for`) before the prefill: its capture writes the cache."""
        steps = params.max_new_tokens
        step = self.step_for(params) if steps > 1 else None
        self.state.load(first, lengths, width, eos)
        tokens = torch.empty(steps, first.shape[0], device=first.device, dtype=torch.long)
        tokens[0] = first
        for i in range(1, steps):
            if eos.numel() and i % EOS_CHECK_EVERY == 0 and bool(self.state.finished.all()):
                return tokens[:i].T
            step()
            tokens[i].copy_(self.state.tokens)
        return tokens.T

    def generator_for(self, params: SamplingParams) -> torch.Generator | None:
        """The generator of a call's draws, the first token's included: this slot's, reseeded,
        for seeded sampling; None (torch's default generator) otherwise."""
        if params.greedy or params.seed is None:
            return None
        return self.generator.manual_seed(params.seed)


class StaticDecoder:
    """The static-shape decode of one model: a `DecodeSlot` per batch size and cache length
    (`cache_len_bucket`), made on first use. With `capture` (a CUDA device and a capturable decode
    FFN: `why_not_graph`) every step is a CUDA graph replay, but for a batch the decode FFN cannot
    capture (the kernels' above their row limit), which runs the step uncaptured; without
    `capture`, every batch does (any device).

    A slot is made for the exact batch size, not a padded bucket: seeded sampling then draws over
    the same [B, V] shape as the eager decode (the same samples), the prefill writes a contiguous
    cache (the fused write kernel), and no padding row is computed. All slots lay their caches over
    one allocation (only one decodes at a time): the memory is that of the largest, kept between
    calls; `clear()` frees it. Growing it drops every slot (their graphs hold its addresses).
    """

    def __init__(self, model: SparseLlamaForCausalLM, capture: bool, compile: bool = False) -> None:
        why = why_not_graph(model) if capture else None
        if why:
            raise ValueError(f"cannot capture the decode step: {why}")
        self.model, self.capture = model, capture
        model.prepare_inference()  # derived weights (Wd^T, [Wq; Wk; Wv]) made before any trace or capture
        # `compile`: the step's forward through Inductor, once per batch size and cache length (on
        # the first, uncaptured warm-up step), then captured: RMSNorm, RoPE, the residual adds and
        # casts fuse into a few kernels a layer, where eager runs ~40 small ones (~1.4 of the ~2.45 ms
        # of a captured dense 1b decode step at batch 1 on an H100, 4368863; compiling took the step
        # from 2.37 to 1.74 ms at 37b96fc: docs/benchmarks.md).
        self.forward = (
            torch.compile(model.decode_step, dynamic=False, fullgraph=True) if compile else model.decode_step
        )
        self.graph_memory = CaptureMemory(model.lm_head.weight.device) if capture else None
        self.slots: OrderedDict[tuple[int, int], DecodeSlot] = OrderedDict()
        self._memory: tuple[torch.Tensor, torch.Tensor] | None = None

    def slot(self, batch: int, columns: int, eos_count: int) -> DecodeSlot:
        """The slot for `batch` rows that need `columns` cache columns and `eos_count` EOS ids. A
        batch the decode FFN cannot capture (`why_not_graph(model, batch)`) runs the same step
        uncaptured: the same tokens, without the graph."""
        # Derived weights (Wd^T, [Wq; Wk; Wv]) brought up to date in place, where the captured or
        # compiled steps read them: the weights may have changed since the last batch.
        self.model.prepare_inference()
        key = (batch, cache_len_bucket(columns))
        slot = self.slots.get(key)
        if slot is None or slot.state.eos.numel() < eos_count:
            self.slots.pop(key, None)
            cache = self._cache(*key)
            capture = self.capture and why_not_graph(self.model, batch) is None
            graph_memory = self.graph_memory if capture else None
            slot = DecodeSlot(self.forward, cache, eos_capacity(eos_count), graph_memory)
            self.slots[key] = slot
            while len(self.slots) > MAX_SLOTS:
                self.slots.popitem(last=False)
        self.slots.move_to_end(key)
        return slot

    def _cache(self, batch: int, cache_len: int) -> KVCache:
        """A contiguous cache at the start of the shared memory, grown (and every slot dropped)
        when it is too small. Zeroed when allocated: columns a step masks out must hold finite
        values (a masked NaN still poisons the softmax and 0 * v)."""
        cfg = self.model.config
        heads = cfg.num_key_value_heads or cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch, cache_len, heads, cfg.hidden_size // cfg.num_attention_heads)
        size = math.prod(shape)
        if self._memory is None or self._memory[0].numel() < size:
            self.clear()  # free the old memory before allocating the new
            weight = self.model.lm_head.weight
            self._memory = tuple(torch.zeros(size, device=weight.device, dtype=weight.dtype) for _ in "kv")
        k, v = (m[:size].view(shape) for m in self._memory)
        return KVCache.from_tensors(k, v)

    def clear(self) -> None:
        """Drop every slot and the cache memory."""
        self.slots.clear()
        self._memory = None

    @torch.no_grad()
    def generate(
        self,
        prefill: Callable[[KVCache], torch.Tensor],
        lengths: torch.Tensor,
        width: int,
        params: SamplingParams,
        eos: torch.Tensor,
    ) -> torch.Tensor:
        """New tokens [B, n] (n <= max_new_tokens; 0 after a row's EOS) for B prompts left-padded
        to `width` columns (`lengths`: [B] real tokens each). `prefill(cache)` fills `cache` with
        the prompts and returns their last logits [B, V]; `eos`: the EOS ids (empty: none)."""
        steps = params.max_new_tokens
        slot = self.slot(lengths.shape[0], width + steps, eos.numel())
        if steps > 1:  # before the prefill: a capture's warm-up writes the cache
            slot.step_for(params)
        generator = slot.generator_for(params)
        first = sample_next(prefill(slot.state.prefill_cache()), params, generator)
        return slot.decode(first, lengths, width, params, eos)
