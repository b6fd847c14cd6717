"""The micro-benchmark of attn_implementation="auto" (auto_backend.py): each candidate backend runs a one-layer
twin of the stack, with that layer type's attention config, at the length the situation stands for.

The twin is the stack's own class built from a copy of its config with one layer of the type measured, a
residual stream at most 64 wide (the heads keep their number and width), a vocabulary of 16 and an MLP 8
wide, so its time is mostly attention. A situation is measured as the model
will run: a forward (no gradients), forward + backward (gradients), or one-token steps against a cache
filled to the length (decode). Bounds: a warm-up call at a quarter of the length (at least 2 blocks; a
decode step's warm-up is its prefill) per candidate (first-call costs: allocations, a native kernel's
loading) and one timed run; a candidate whose timed run takes over `DROP_RATIO` x the best time so far is
dropped after it, or after its warm-up alone when that already shows it cannot win (`_hopeless`); a backend
that holds the whole score matrix (eager) is not run at all where its scores would pass `SCORE_BYTES`
(`_too_large`; 12 heads in fp32: a forward at 8k keys, training at 4k), so measuring never needs gigabytes
that the backend chosen does not. The others then run in turn, in rounds (drift of
a busy machine falls on all of them), each keeping its best, until `RUNS` runs or `BUDGET_S` per candidate.
Candidates come in the static order (the likely fastest first), so a long situation costs about one run of
each candidate, and a typical one well under a second. The global RNG (CPU and the device) is saved and
restored: measuring does not change what a user's seeded run draws.
"""

from __future__ import annotations

import copy
import functools
import time

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from ...configuration.backends import BACKENDS
from ..caches.cache import dynamic_cache

RUNS = 5
BUDGET_S = 0.15  # seconds of timed runs per candidate kept, beyond which no new round starts
DROP_RATIO = 2.0
PILOT_S = 0.05  # a warm-up at least this long predicts the full run (fixed costs are small beside it)
# the most a score-matrix backend's scores (and, in training, their two gradients) may take while measured
SCORE_BYTES = 1 << 30


def measure_candidates(stack, layer_type: str, situation: dict, candidates: list[str], device: torch.device):
    """({backend: best time in ms}, {backend: why it was dropped}) for `candidates` on `stack`'s twin on
    `device` (the inputs'; the situation names a GPU by its model, not its index)."""
    dtype = getattr(torch, situation["dtype"])
    devices = [device] if device.type == "cuda" else []
    grad = situation["grad"]
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
        twin = _twin(stack, layer_type, situation["bucket"]).to(device=device, dtype=dtype)
        twin.train(grad or situation["dropout"])
        runs = {name: _runner(twin, name, situation, device) for name in candidates}
        times, dropped = _first_runs(runs, situation, device)
        _rounds(runs, times, device)
    return {n: round(t * 1e3, 4) for n, t in times.items()}, dropped


def _first_runs(runs: dict, situation: dict, device):
    """One warm-up and one timed run of each candidate in turn, dropping those that cannot win."""
    times, dropped = {}, {}
    for name, run in runs.items():
        too_large = _too_large(name, situation)
        if too_large and len(runs) > len(dropped) + 1:  # never every candidate
            dropped[name] = too_large
            continue
        pilot = _timed(functools.partial(run, warm_up=True), device)
        best = min(times.values(), default=None)
        if best is not None and _hopeless(pilot, best, situation):
            dropped[name] = (
                f"its warm-up at a quarter of the length took {pilot * 1e3:.0f} ms, so at the full length it "
                f"would take over {DROP_RATIO:g}x the best ({best * 1e3:.2f} ms)"
            )
            continue
        first = _timed(run, device)
        if best is not None and first > DROP_RATIO * best:
            dropped[name] = f"first run {first * 1e3:.2f} ms > {DROP_RATIO:g}x the best ({best * 1e3:.2f} ms)"
        else:
            times[name] = first
    return times, dropped


def _rounds(runs: dict, times: dict, device) -> None:
    """Rounds of the kept candidates in turn (a busy machine's drift falls on all of them), each keeping its
    best in `times`, until `RUNS` runs or `BUDGET_S` per candidate."""
    spent, rounds = sum(times.values()), 1
    while rounds < RUNS and spent < BUDGET_S * len(times):
        for name in times:
            t = _timed(runs[name], device)
            spent, times[name] = spent + t, min(times[name], t)
        rounds += 1


def _hopeless(pilot: float, best: float, situation: dict) -> bool:
    """Whether a prefill candidate whose warm-up at a quarter of the length took `pilot` seconds cannot come
    within `DROP_RATIO` of `best`: attention's work grows at least linearly with the length, so the full run
    takes at least 4x the warm-up once fixed costs are small (`PILOT_S`). This keeps a long situation from
    paying a full run of a dense backend (eager at 8k tokens: seconds and gigabytes)."""
    return situation["step"] == "prefill" and pilot > PILOT_S and 4 * pilot > DROP_RATIO * best


def _too_large(name: str, situation: dict) -> str:
    """Why `name` is not measured in `situation` (its scores would pass `SCORE_BYTES`), or ""."""
    if not BACKENDS[name].score_matrix or situation["step"] == "decode":
        return ""
    length, width = situation["bucket"], torch.finfo(getattr(torch, situation["dtype"])).bits // 8
    need = situation["heads"] * length * length * width * (3 if situation["grad"] else 1)
    if need <= SCORE_BYTES:
        return ""
    return (
        f"not measured: its scores of {situation['heads']} heads x {length}^2 keys would take {need / 2**30:.1f} GiB "
        f"(over {SCORE_BYTES / 2**30:g} GiB), far more than the other candidates"
    )


def _timed(run, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def _twin(stack, layer_type: str, length: int):
    """A one-layer model of `stack`'s class whose only layer is of `layer_type`, as the stack's config
    configures it, able to take `length` positions."""
    config = copy.deepcopy(stack.config)
    seq2seq = not isinstance(stack, PreTrainedModel)  # a half of the encoder-decoder (Seq2SeqStack)
    config.num_hidden_layers, config.layer_types = 1, [layer_type]
    if seq2seq:
        config.decoder_layers, config.decoder_layer_types = 1, [layer_type]
    # attention's shapes are the heads' (head_dim is explicit once a config is built); a narrow residual
    # stream, vocabulary and MLP keep the rest of the twin cheap, so its time is mostly attention
    config.hidden_size, config.vocab_size, config.intermediate_size = min(config.hidden_size, 64), 16, 8
    config.pad_token_id = 0 if config.pad_token_id is not None else None
    config.max_position_embeddings = max(config.max_position_embeddings, length + 8)
    config.hidden_dropout, config.use_cache = 0.0, False  # a prefill builds no cache it would not use
    if seq2seq:
        return type(stack)(config, decoder=stack.is_decoder, embed_tokens=None)
    return type(stack)(config)


def _runner(twin, backend: str, situation: dict, device):
    """A call that runs one measured step of `situation` on `twin` with `backend` (`warm_up=True`: a forward
    at two blocks, or the prefill of a decode step)."""
    length, decode = situation["bucket"], situation["step"] == "decode"
    causal = twin.causal
    ids = torch.randint(3, 16, (1, length), device=device)
    extra = {}
    if getattr(twin, "is_decoder", False):  # a seq2seq decoder half reads encoder states
        extra["encoder_hidden_states"] = torch.randn(1, length, twin.config.hidden_size, device=device)
        extra["encoder_hidden_states"] = extra["encoder_hidden_states"].to(next(twin.parameters()).dtype)

    # padded situations: an eighth of the tokens, on the left of a causal row (fixed while decoding), else right
    pad = max(1, length // 8)

    def mask(n: int):
        if not situation["padded"]:
            return None
        m, k = torch.ones(1, n, dtype=torch.long, device=device), min(pad, n // 2)
        return m.index_fill(
            1, torch.arange(k, device=device) if causal else torch.arange(n - k, n, device=device), 0
        )

    def forward(n: int):
        twin.config._attn_implementation_internal = backend
        out = twin(ids[:, :n], attention_mask=mask(n), **extra)
        if situation["grad"]:
            twin.zero_grad(set_to_none=True)
            out.last_hidden_state.float().square().mean().backward()

    if not decode:
        pilot = max(2 * twin.config.attention_block_size, length // 4)
        return lambda warm_up=False: forward(pilot if warm_up else length)
    state = {}

    def step(warm_up=False):
        twin.config._attn_implementation_internal = backend
        if warm_up or "cache" not in state:
            state["cache"] = _fresh_cache(twin)
            state["n"] = length - 1
            twin(ids[:, : length - 1], attention_mask=mask(length - 1), cache=state["cache"], **extra)
        n = state["n"] = state["n"] + 1
        token = ids[:, (n - 1) % length :][:, :1]
        twin(token, attention_mask=mask(n), cache=state["cache"], **extra)

    return step


def _fresh_cache(twin):
    if getattr(twin, "is_decoder", False):
        return EncoderDecoderCache(dynamic_cache(twin.config), DynamicCache())
    return dynamic_cache(twin.config)
