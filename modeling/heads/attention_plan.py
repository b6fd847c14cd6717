"""`model.attention_plan()`: per stack and layer type, the backend asked for and, for "auto", what runs in
each situation seen so far and why (the measured times, from this process or the disk cache, or the
static order). Read-only: it measures nothing and changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.auto_backend import AUTO_BACKEND, LAYER_TYPE_PATTERN, Choice, known_choices


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
            return f"{head}: chosen at the first forward of each situation (none seen yet)"
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
