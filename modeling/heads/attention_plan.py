"""`model.attention_plan()`: per stack and layer type, the backend asked for and, for "auto", what runs in
each situation seen so far and why (the measured times, from this process or the disk cache, or the
static order). Read-only: it measures nothing and changes nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..attention.auto_backend import AUTO_BACKEND, LAYER_TYPE_PATTERN, Choice, choices_made, layer_config
from ..attention.auto_cache import entries


@dataclass(frozen=True)
class PlanRow:
    """One layer type of one stack: `requested` is the backend its config names ("auto" included);
    `choices` what auto chose, one per situation (empty for a named backend)."""

    stack: str
    layer_type: str
    kind: str
    requested: str
    choices: tuple[Choice, ...]

    def __str__(self) -> str:
        head = f"{self.stack + ' ' if self.stack else ''}{self.layer_type} ({self.kind}): {self.requested}"
        if self.requested != AUTO_BACKEND:
            return head
        if not self.choices:
            return f"{head}: chosen at the first forward of each situation (none seen yet; compiled forwards take the static order)"
        return "\n".join([head, *(f"  -> {c}" for c in self.choices)])


@dataclass(frozen=True)
class AttentionPlan:
    rows: tuple[PlanRow, ...]

    def row(self, layer_type: str, stack: str | None = None) -> PlanRow:
        """The row of `layer_type` (of the stack named `stack`, "encoder" or "decoder", when given)."""
        for r in self.rows:
            if r.layer_type == layer_type and stack in (None, r.stack):
                return r
        raise KeyError(f"no {layer_type} layers in this model; it has {[r.layer_type for r in self.rows]}")

    def __str__(self) -> str:
        return "\n".join(map(str, self.rows))


def attention_plan(model) -> AttentionPlan:
    """The plan of every stack of `model` (a swapformer model: one stack, or an encoder and a decoder)."""
    stacks = [m for m in model.modules() if hasattr(m, "forward_stack")]
    rows = []
    for stack in stacks:
        name = ("decoder" if stack.is_decoder else "encoder") if hasattr(stack, "is_decoder") else ""
        for layer_type in dict.fromkeys(stack.layer_types):
            requested = stack.config.backend_for(layer_type)
            choices = tuple(known_choices(stack, layer_type)) if requested == AUTO_BACKEND else ()
            rows.append(PlanRow(name, layer_type, LAYER_TYPE_PATTERN[layer_type], requested, choices))
    return AttentionPlan(tuple(rows))


def cached_choices() -> list[str]:
    """The disk cache's choices measured by this torch and swapformer, one line each (`swapformer env`)."""
    return [
        f"{_layer_summary(e['situation'])}: {_from_entry(e)}" for e in entries().values() if "situation" in e
    ]


def _layer_summary(s: dict) -> str:
    """A layer config as a short phrase: "sliding (window 128, 12 heads x 64, causal)"."""
    parts = [f"window {s['window']}"] if s.get("window") else []
    parts += [f"{s['global_tokens']} global"] if s.get("global_tokens") else []
    parts += [f"{s['random_blocks']} random blocks of {s['block_size']}"] if s.get("random_blocks") else []
    heads = f"{s['heads']} heads" + (f" ({s['kv_heads']} kv)" if s["kv_heads"] != s["heads"] else "")
    parts += [f"{heads} x {s['head_dim']}", "causal" if s["causal"] else "bidirectional"]
    return f"{s['kind']} ({', '.join(parts)})"


def known_choices(stack, layer_type: str) -> list[Choice]:
    """Every choice made for layers configured as `layer_type`'s of `stack`: this process's, then the disk
    cache's (other lengths and situations measured earlier on this machine)."""
    fields = layer_config(stack, layer_type)
    mine = [c for c in choices_made() if _matches(c.situation, fields)]
    seen = {json.dumps(c.situation, sort_keys=True) for c in mine}
    cached = [
        _from_entry(e)
        for key, e in entries().items()
        if key not in seen and _matches(e.get("situation", {}), fields)
    ]
    return mine + cached


def _matches(situation: dict, fields: dict) -> bool:
    return all(situation.get(name) == value for name, value in fields.items())


def _from_entry(entry: dict) -> Choice:
    how = f"measured {entry.get('measured', '')} (cache)"
    return Choice(
        entry["situation"], entry["choice"], how, entry.get("times_ms", {}), entry.get("dropped", {})
    )
