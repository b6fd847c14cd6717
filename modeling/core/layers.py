"""The blocks every swapformer architecture is made of: norms, MLP, attention, block.

Shape legend: B batch, T query length, S key length, E hidden size, H query heads, K key/value
heads, D head dim.

The stack (stack.py) makes each forward's plan (plan.py); a block's attention projects, rotates, appends
to the cache and calls the attention function its `LayerPlan` holds, with the mask lowered for it.
Variants subclass `Attention` (or `AttentionBase`: MLA) in variants/ and are chosen once, when the stack
is built (attention_choice.py); learned sinks are a parameter and a backend call (sinks.run_with_sinks)
chosen in `Attention.__init__`. `project` and `MLP.forward` are the seam of the CPU speed routes (cpu/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import GradientCheckpointingLayer

from ...configuration.backends import APPLIES_DROPOUT, COMPILES_ON, TRAINS_ON, check_backend_for_forward
from ..attention.functions import attention_weights, run_uncompiled
from ..compat.hf_compat import ACT2FN
from ..cpu import IN_PLACE, cpu_linear_route, cpu_mlp
from ..cpu.routes import Seam, onednn_project, resolve_environment_route
from ..variants.sinks import run_with_sinks
from .positions import apply_rope

if TYPE_CHECKING:
    from .plan import LayerPlan

# Norms ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (https://arxiv.org/abs/1910.07467), computed in fp32 like Llama and T5."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.hidden_size, config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


# MLP -----------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """up -> act -> down, or act(gate) * up -> down when `mlp_type="gated"` (SwiGLU, GeGLU:
    https://arxiv.org/abs/2002.05202)."""

    def __init__(self, config):
        super().__init__()
        e, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(e, f, bias=bias) if config.mlp_type == "gated" else None
        self.up_proj = nn.Linear(e, f, bias=bias)
        self.down_proj = nn.Linear(f, e, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.act_in_place = IN_PLACE.get(config.hidden_act)  # used by the CPU route without gradients
        self.dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # without gradients, activations over one chunk go to the CPU route of row chunks (the seam)
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or self.fits_one_chunk(x):
            return self.compute(x, self.act_fn)
        return cpu_mlp(self, x)

    def fits_one_chunk(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return rows * self.up_proj.out_features * x.element_size() <= Seam.mlp_chunk_bytes

    def compute(self, x: torch.Tensor, act) -> torch.Tensor:
        if self.gate_proj is None:
            h = act(project(self.up_proj, x))
        else:
            h = act(project(self.gate_proj, x)) * project(self.up_proj, x)
        return project(self.down_proj, self.dropout(h))


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`: the seam through which layers and heads call their projections, where the CPU linear
    route enters (cpu/routes.py): where "onednn" is in force, its call. The route is read as values, so
    on torch's route a projection runs no code of the cpu package."""
    if torch.compiler.is_compiling():  # first: the route's context variable is not traceable
        return module(x)
    route = Seam.linear.get() or Seam.environment or resolve_environment_route()
    return module(x) if route == "torch" else onednn_project(module, x)


# Attention -----------------------------------------------------------------------------------------


class AttentionBase(nn.Module):
    """What every attention layer shares: its place, its head counts and the call of the plan's
    backend function (`attend`). Subclasses make the projections and the forward."""

    def __init__(self, config, layer_idx: int, *, is_causal: bool, layer_type: str, windowed: bool):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        # The layer type picks the backend under a per-layer mapping; cross-attention follows its block.
        self.layer_type = layer_type
        self.sliding_window = config.sliding_window if windowed else None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.effective_attention_scale
        self.attention_dropout = config.attention_dropout
        self.sinks = None  # gpt-oss's learned sinks (Attention), read by eager's softmax
        self.call_backend = AttentionBase.run_backend  # or, with learned sinks, the kernels' form (sinks.py)

    def attend(self, hidden_states, q, k, v, attention_mask, plan: LayerPlan, output_attentions: bool):
        """(B, T, H, D) attention output of q (B, H, T, D) over k, v (B, K, S, D), and the weights
        (B, H, T, S) when asked. `hidden_states` is for the variants that need it (global_rows.py)."""
        return self.call_backend(
            self, plan, q, k, v, attention_mask, output_attentions, sliding_window=self.sliding_window
        )

    def run_backend(
        self, plan: LayerPlan, q, k, v, attention_mask, output_attentions: bool, fn=None, **kwargs
    ):
        """The attention through its `LayerPlan`'s backend function (or `fn`, a wrapper of it):
        (output (B, T, H, D), the probabilities when `output_attentions`, recomputed from the pattern
        where the kernel returns none)."""
        fn = plan.attention_fn if fn is None else fn
        dropout = self.attention_dropout if self.training else 0.0
        kwargs.update(plan.kernel_kwargs, scaling=self.scaling, dropout=dropout)
        out, weights = call_attention(
            fn, plan.backend, plan.pattern.kind, self, q, k, v, attention_mask, **kwargs
        )
        if output_attentions and weights is None:
            weights = attention_weights(self, q, k, plan.pattern, self.scaling).to(q.dtype)
        return out, weights


def call_attention(fn, backend: str, kind: str, module: nn.Module, *args, **kwargs):
    """Run attention function `fn` of `backend`. Inside torch.compile, a backend the capability table
    says cannot compile on this device fails with a message naming it (fullgraph=True, export); when
    compile falls back to eager for that (fullgraph=False), the call runs uncompiled, e.g. flex on CPU
    with its own standalone-compiled kernel, as an uncompiled model runs it."""
    device = args[0].device  # the query
    if torch.compiler.is_compiling():
        check_backend_for_batch(backend, kind, module, device)
    if (backend, kind, device.type) in COMPILES_ON:
        return fn(module, *args, **kwargs)
    return run_uncompiled(fn, module, *args, **kwargs)


def check_backend_for_batch(backend: str, kind: str, module: nn.Module, device: torch.device) -> None:
    """The checks of `check_backend_for_forward` for one layer kind of `module`'s forward on `device`,
    read from the table's sets (`TRAINS_ON`, ...); the table's refusal is raised when one fails."""
    training, compiling = module.training, torch.compiler.is_compiling()
    grads = training and torch.is_grad_enabled()
    dropout = training and module.config.attention_dropout > 0
    if (
        (grads and (backend, device.type) not in TRAINS_ON)
        or (dropout and backend not in APPLIES_DROPOUT)
        or (compiling and (backend, kind, device.type) not in COMPILES_ON)
    ):
        check_backend_for_forward(
            backend,
            kind,
            module.config,
            device.type,
            training=training,
            needs_grad=torch.is_grad_enabled(),
            compiling=compiling,
        )


class Attention(AttentionBase):
    """Multi-head self-attention with MHA/GQA/MQA, optional RoPE and a KV cache."""

    is_cross_attention = False

    def __init__(self, config, layer_idx: int, *, is_causal: bool, layer_type: str = "full_attention"):
        windowed = layer_type != "full_attention" and not self.is_cross_attention
        super().__init__(config, layer_idx, is_causal=is_causal, layer_type=layer_type, windowed=windowed)
        e, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, e, bias=bias)
        if config.attention_sinks and not self.is_cross_attention:
            # gpt-oss's learned sinks: one logit per query head; kernels take them as one extra key
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            self.call_backend = run_with_sinks

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """(B, T, E) -> (B, heads, T, D) through `proj`. -1 heads: under tensor parallelism
        (config.base_model_tp_plan) each rank holds a share of them."""
        b, t, _ = x.shape
        return project(proj, x).view(b, t, -1, self.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_proj, x), self.heads(self.v_proj, x)  # (B, K, T, D)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask,
        *,
        plan: LayerPlan,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, E).
            attention_mask: the mask the plan lowered for this layer type's backend (see Block.forward).
            plan: this layer type's plan for this forward (plan.py).
        """
        b, t, _ = hidden_states.shape
        q = self.heads(self.q_proj, hidden_states)  # (B, H, T, D)
        k, v = self.project_kv(hidden_states)  # (B, K, T, D)
        if plan.rope is not None:
            q, k = apply_rope(q, *plan.rope), apply_rope(k, *plan.rope)
        k, v = plan.cache.append(k, v, self.layer_idx)  # (B, K, S, D), the cached keys first
        out, weights = self.attend(hidden_states, q, k, v, attention_mask, plan, output_attentions)
        out = project(self.o_proj, out.reshape(b, t, -1))  # (B, T, E)
        return out, (weights if output_attentions else None)


# Block ---------------------------------------------------------------------------------------------


class Block(GradientCheckpointingLayer):
    """Self-attention, optional cross-attention, MLP; each a residual branch, pre- or post-norm.
    `attention` is the self-attention class the stack chose for this layer (attention_choice.py),
    `cross_attention` the cross-attention class of a seq2seq decoder (variants/cross_attention.py)."""

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        is_causal: bool,
        cross_attention: type[AttentionBase] | None,
        layer_type: str = "full_attention",
        attention: type[AttentionBase] = Attention,
    ):
        super().__init__()
        cpu_linear_route()  # a wrong SWAPFORMER_CPU_LINEAR fails when the model is built
        self.pre_norm = config.pre_norm
        self.layer_type = layer_type
        self.self_attn = attention(config, layer_idx, is_causal=is_causal, layer_type=layer_type)
        self.self_attn_norm = make_norm(config)
        self.cross_attn = self.cross_attn_norm = None
        if cross_attention is not None:
            self.cross_attn = cross_attention(config, layer_idx, is_causal=False, layer_type=layer_type)
            self.cross_attn_norm = make_norm(config)
        self.mlp = MLP(config)
        self.mlp_norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask=None,
        *,
        plan: LayerPlan,
        cross_plan: LayerPlan | None = None,
        output_attentions: bool = False,
    ):
        """`attention_mask` and `encoder_attention_mask` are the masks the plan lowered for this layer
        (`ForwardPlan.masks`), as transformers' layers take theirs; positional, because a trained
        position bias (T5) is in them and reentrant activation checkpointing tracks the gradients of
        positional tensors only. Pre-norm: h + f(norm(h)); post-norm (BERT): norm(h + f(h))."""
        h = hidden_states
        x = self.self_attn_norm(h) if self.pre_norm else h
        out, self_weights = self.self_attn(x, attention_mask, plan=plan, output_attentions=output_attentions)
        h = self.add(h, out, self.self_attn_norm)
        cross_weights = None
        if self.cross_attn is not None:
            x = self.cross_attn_norm(h) if self.pre_norm else h
            out, cross_weights = self.cross_attn(
                x,
                encoder_attention_mask,
                plan=cross_plan,
                key_value_states=encoder_hidden_states,
                output_attentions=output_attentions,
            )
            h = self.add(h, out, self.cross_attn_norm)
        x = self.mlp_norm(h) if self.pre_norm else h
        h = self.add(h, self.mlp(x), self.mlp_norm)
        return h, self_weights, cross_weights

    def add(self, h: torch.Tensor, branch: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """The residual sum, normed after it when post-norm."""
        h = h + self.dropout(branch)
        return h if self.pre_norm else norm(h)
