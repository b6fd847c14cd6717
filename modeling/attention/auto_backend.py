"""attn_implementation="auto" (issue 30): per layer type, the fastest backend that the capability table
accepts for the forward at hand, measured on this machine.

A forward's plan (core/plan.py) calls `resolve` once with its {layer type: backend}; where a layer type says
"auto", the *situation* of its layers decides: the device (type and name: CPU model or CUDA device; CPU
threads), the dtype, the layer type's attention config (kind, window, global tokens, block size, random
blocks, heads, kv heads, head dim, causal, position bias, sinks, Linformer, latent attention, cross-
attention), the key count rounded up to a power of two (at least `FLOOR`), prefill or decode (one query
against a filled cache), gradients or not, attention dropout in training, padding, packing and a custom
4D mask. The candidates are the backends whose row of the table accepts all of it and whose package is
installed (`candidates`), so every candidate computes what eager computes. The first time a situation is
seen, each candidate runs a one-layer twin of the stack (auto_measure.py) and the fastest is kept, in memory
and in the disk cache (auto_cache.py), which later processes read instead of measuring; after that a
forward pays one dict lookup per layer type.

`SWAPFORMER_AUTO=static` takes instead the first candidate of a fixed order per layer kind
(`AUTO_STATIC_ORDER` in configuration/capability_table.py) and measures nothing: reproducible runs. Inside
torch.compile the static order applies too (nothing is measured while tracing). A candidate that fails
while measured is a bug in the table, raised as such: `auto` never falls back silently.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, field
from functools import cache

import torch

from ...configuration.availability import installed, model_needs
from ...configuration.backends import (
    AUTO_BACKEND,
    AUTO_STATIC_ORDER,
    BACKENDS,
    COMPILES_ON,
    LAYER_TYPE_PATTERN,
)
from ..cpu.route_choice import cpu_info
from ..cpu.routes import cpu_routes_on
from .auto_cache import cache_file, lookup, measuring_lock, store
from .auto_cache import forget as forget_cache
from .auto_measure import measure_candidates

ENV = "SWAPFORMER_AUTO"
MODES = {
    "measure": "the fastest candidate, measured once per situation and cached on disk (the default)",
    "static": "the first candidate of a fixed order per layer kind, measuring nothing (reproducible runs)",
}
FLOOR = 256  # the shortest length bucket: below it every backend takes about the same time
GLOBAL_KINDS = ("sliding_global", "bigbird")

# read once: a package lookup (nothing imported), and a dtype's name, as constants torch.compile can trace
_INSTALLED = {name: installed(caps) for name, caps in BACKENDS.items()}
_DTYPE_NAMES = {getattr(torch, name): name for name in ("float32", "float16", "bfloat16", "float64")}

__all__ = [
    "AUTO_BACKEND",
    "LAYER_TYPE_PATTERN",
    "Choice",
    "candidates",
    "mode",
    "resolve",
    "measure_candidates",
]


@dataclass(frozen=True)
class Choice:
    """What `auto` runs in one situation, and why: `how` ("measured now", "measured <when> (cache)",
    "static order", "the only candidate"), the measured times (ms) and the candidates dropped early."""

    situation: dict
    backend: str
    how: str
    times_ms: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)

    def __str__(self) -> str:
        s = self.situation
        where = f"{s['device']} {s['dtype']}, {s['bucket']} keys, {s['step']}, {'gradients' if s['grad'] else 'no gradients'}"
        flags = [name for name in ("padded", "packed", "custom", "dropout") if s.get(name)]
        times = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(self.times_ms.items(), key=lambda nt: nt[1]))
        dropped = (
            "; dropped " + ", ".join(f"{n} ({why})" for n, why in self.dropped.items())
            if self.dropped
            else ""
        )
        detail = f": {times}{dropped}" if times else ""
        return f"{self.backend} ({where}{', ' + ', '.join(flags) if flags else ''}; {self.how}{detail})"


_choices: dict[tuple, Choice] = {}  # this process's choices, by (mode, situation values)
measured_here: list[str] = []  # the situations this process measured (tests count them)


def mode() -> str:
    """SWAPFORMER_AUTO, checked: "measure" (unset) or "static"."""
    value = os.environ.get(ENV, "measure")
    if value not in MODES:
        accepted = "; ".join(f"{name!r}: {what}" for name, what in MODES.items())
        raise ValueError(
            f"{ENV}={value!r} is not a mode of attn_implementation='auto'; set it to one of {accepted}"
        )
    return value


def resolve(stack, patterns: dict, backends: dict[str, str], dtype: torch.dtype) -> dict[str, str]:
    """`backends` ({layer type: backend} of this forward) with every "auto" replaced by its choice for the
    situation of `patterns[layer type]` on `stack`; `backends` itself when none is "auto"."""
    if AUTO_BACKEND not in backends.values():
        return backends
    pick = _traced_pick if torch.compiler.is_compiling() else lambda *args: choose(*args).backend
    return {
        lt: pick(stack, lt, patterns[lt], dtype) if b == AUTO_BACKEND else b for lt, b in backends.items()
    }


def choose(stack, layer_type: str, pattern, dtype: torch.dtype) -> Choice:
    """The choice for `layer_type`'s layers of `stack` in the situation `pattern` (this forward's) shows."""
    situation = situation_of(stack, layer_type, pattern, dtype)
    memo = (mode(), *situation.values())
    choice = _choices.get(memo)
    if choice is None:
        choice = _choices[memo] = _decide(stack, layer_type, situation, memo[0], pattern.device)
    return choice


def _traced_pick(stack, layer_type: str, pattern, dtype: torch.dtype) -> str:
    """Inside torch.compile: the first of the static order that compiles, from facts the tracer reads as
    constants (nothing measured, read from disk or recorded while tracing)."""
    training = stack.training
    return candidates(
        stack.config, pattern.kind, pattern.device.type, _DTYPE_NAMES[dtype], grad=training and torch.is_grad_enabled(),
        padded=pattern.key_valid is not None, packed=pattern.query_packing is not None,
        custom=pattern.custom_mask is not None, compiling=True,
        dropout=training and stack.config.attention_dropout > 0,
    )[0]  # fmt: skip


def _decide(stack, layer_type: str, situation: dict, how: str, device: torch.device) -> Choice:
    s = situation
    found = candidates(
        stack.config, s["kind"], s["device"], s["dtype"], grad=s["grad"], padded=s["padded"],
        packed=s["packed"], custom=s["custom"], compiling=False, dropout=s["dropout"],
    )  # fmt: skip
    if how == "static":
        return Choice(situation, found[0], "static order")
    if len(found) == 1:
        return Choice(situation, found[0], "the only candidate")
    key = json.dumps(situation, sort_keys=True)
    known = _cached(situation, key, found)
    if known is not None:
        return known
    # Another process of this machine meeting this situation now (a rank of a multi-process run) waits here
    # while this one measures, then reads its entry: ranks agree, and no two measure at once (auto_cache.py).
    with measuring_lock():
        forget_cache()  # read the file again: the process that held the lock may have stored the entry
        known = _cached(situation, key, found)
        return known if known is not None else _measure(stack, layer_type, situation, key, found, device)


def _cached(situation: dict, key: str, found: list[str]) -> Choice | None:
    """The choice the disk cache holds for `key`, if it is still a candidate."""
    entry = lookup(key)
    if entry is None or entry.get("choice") not in found:
        return None
    how = f"measured {entry.get('measured', '')} (cache {cache_file()})"
    return Choice(situation, entry["choice"], how, entry.get("times_ms", {}), entry.get("dropped", {}))


def _measure(stack, layer_type: str, situation: dict, key: str, found: list[str], device) -> Choice:
    """Measure `found` on a twin of `layer_type`'s layers on `device`, keep the fastest in memory and on disk."""
    try:
        times, dropped = measure_candidates(stack, layer_type, situation, found, device)
    except Exception as e:
        raise RuntimeError(
            f"attn_implementation='auto': measuring {found} for {layer_type} layers failed ({type(e).__name__}: "
            f"{e}). Every candidate is a backend the capability table says runs this situation, so this is a "
            f"bug in the table (configuration/capability_table.py); meanwhile choose a backend by name"
        ) from e
    best = min(times, key=times.get)
    measured_here.append(key)
    store(key, {"situation": situation, "choice": best, "times_ms": times, "dropped": dropped})
    return Choice(situation, best, "measured now", times, dropped)


def candidates(
    config, kind: str, device: str, dtype, *, grad: bool, padded: bool, packed: bool, custom: bool,
    compiling: bool, dropout: bool = False,
) -> list[str]:  # fmt: skip
    """The backends the capability table accepts for `kind` layers of `config`'s model on `device` in
    `dtype` with these inputs, installed, measured there (`auto_devices`), in the static order of `kind`
    (the likely fastest first). `sparse` is left out of full layers: it runs them as sdpa."""
    dtype = dtype if isinstance(dtype, str) else _DTYPE_NAMES[dtype]
    needs = [feature for feature, needed in model_needs(config).items() if needed]
    wanted = {"padding": padded, "packing": packed, "custom_mask": custom, "dropout": dropout}

    def accepts(name: str, caps) -> bool:
        return (
            _INSTALLED[name]
            and device in caps.devices
            and device in caps.auto_devices
            and dtype in caps.dtypes
            and kind in caps.patterns
            and not (kind == "full" and caps.full_layers_as)
            and all(getattr(caps, f) for f in needs)
            and all(getattr(caps, f) for f, asked in wanted.items() if asked)
            and (not grad or device in caps.backward)
            and (not compiling or (name, kind, device) in COMPILES_ON)
        )

    found = [name for name, caps in BACKENDS.items() if accepts(name, caps)]
    order = AUTO_STATIC_ORDER[kind]
    return [n for n in order if n in found] + [n for n in found if n not in order]


def situation_of(stack, layer_type: str, pattern, dtype: torch.dtype) -> dict:
    """What a choice depends on, as plain JSON values (the cache's key)."""
    past, total = pattern.query_offset, pattern.total_length
    decode = pattern.query_length == 1 and not (isinstance(past, int) and past == 0)
    keys = total if isinstance(total, int) else pattern.key_length
    training = stack.training
    return {
        **_machine(pattern.device),
        "dtype": _DTYPE_NAMES[dtype],
        **layer_config(stack, layer_type),
        "bucket": max(FLOOR, 1 << max(keys - 1, 0).bit_length()),
        "step": "decode" if decode else "prefill",
        "grad": training and torch.is_grad_enabled(),
        "dropout": training and stack.config.attention_dropout > 0,
        "padded": pattern.key_valid is not None,
        "packed": pattern.query_packing is not None,
        "custom": pattern.custom_mask is not None,
    }


def _machine(device: torch.device) -> dict:
    if device.type == "cuda":  # the model, not the index: ranks on GPUs of one model share a choice
        return {"device": "cuda", "device_name": _cuda_name(device.index or 0)}
    return {
        "device": device.type,
        "device_name": _cpu_name(),
        "threads": torch.get_num_threads(),
        "cpu_routes": cpu_routes_on(),
    }


@cache
def _cpu_name() -> str:
    return cpu_info("model name") or "unknown CPU"


@cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def layer_config(stack, layer_type: str) -> dict:
    """The attention config of `layer_type`'s layers of `stack`: what decides their cost. Read once per stack
    (a built model's attention config does not change: its layers were made from it; config attribute reads
    cost microseconds each, and a forward should pay nothing measurable)."""
    known = _layer_configs.setdefault(stack, {})
    if layer_type not in known:
        known[layer_type] = _read_layer_config(stack, layer_type)
    return known[layer_type]


_layer_configs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stack -> {layer type: config}


def _read_layer_config(stack, layer_type: str) -> dict:
    config = stack.config
    kind = LAYER_TYPE_PATTERN[layer_type]
    windowed, global_kind = kind != "full", kind in GLOBAL_KINDS
    bias = config.position_embedding_type
    latent = getattr(config, "kv_lora_rank", None)
    return {
        "kind": kind,
        "causal": bool(stack.causal),
        "cross_attention": bool(getattr(stack, "is_decoder", False)),
        "window": config.sliding_window if windowed else None,
        "global_tokens": config.global_tokens if global_kind else 0,
        "block_size": config.attention_block_size if windowed else None,
        "random_blocks": config.num_random_blocks if kind == "bigbird" else 0,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "position_bias": bias if bias in ("alibi", "relative_bias") else None,
        "sinks": bool(config.attention_sinks),
        "linformer_k": None if stack.causal else config.linformer_k,
        "latent": None if latent is None else f"{latent}/{config.qk_nope_head_dim}/{config.v_head_dim}",
        "global_projections": bool(config.global_projections and global_kind and not stack.causal),
    }


def forget() -> None:
    """Forget this process's choices and re-read the disk cache (tests)."""
    _choices.clear()
    measured_here.clear()
    forget_cache()


def choices_made() -> list[Choice]:
    """This process's choices, in the order they were made."""
    return list(_choices.values())
