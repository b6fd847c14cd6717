"""The blocks every swapformer architecture is made of.

Shape legend: B batch, T query length, S key length, E hidden size, H query heads, K key/value
heads, D head dim.

The encoder, the decoder and both halves of the encoder-decoder are the same stack (stack.py) of the
same `Block`s with two switches: causal self-attention, and cross-attention. The stack makes the
forward's plan (plan.py); a block's attention projects, rotates, appends to the cache and calls the
attention function its `LayerPlan` holds, with the mask lowered for it.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers import GradientCheckpointingLayer

from ..configuration.backends import LAYER_TYPE_PATTERN
from ..configuration.configuration_swapformer import GLOBAL_KINDS
from .attention import run_planned
from .global_rows import global_rows
from .hf_compat import ACT2FN
from .linear import cpu_linear_route, onednn_applies, plain_linear, project
from .mla import LatentAttention
from .plan import LayerPlan
from .positions import apply_rope
from .sinks import NATIVE as NATIVE_SINKS
from .sinks import attend_with_sinks, shift_sinks
from .torch_compat import module_hooked

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


# In-place forms of activations whose output may overwrite their input when no gradient is taken.
_IN_PLACE = {
    "gelu": torch.ops.aten.gelu_,
    "relu": torch.relu_,
    "silu": lambda x: nn.functional.silu(x, inplace=True),
}

# Without gradients the MLP runs this many bytes of intermediate activations at a time: glibc hands
# larger blocks out as fresh mappings, so a whole (T, intermediate) activation page-faults and is
# zero-filled by the kernel on every layer (measured: about as long as the GELU itself, and not spread
# over threads). The chunks are equal, and plain `nn.Linear` projections on torch's route write into
# buffers allocated once per call and reused by every chunk: fresh chunk-sized outputs fault too
# whenever glibc has trimmed its heap (a gated BERT-base MLP at 4096 tokens: 36,737 faults per call
# against 5,124, 9% slower; benchmarks/mlp_chunks.py). On the oneDNN route (linear.py), whose op takes
# no output buffer, each chunk calls the projections through `project`. A model with forward hooks on
# its projections runs the MLP in one plain pass, so hooks see one call with the whole output.
MLP_CHUNK_BYTES = 16 * 2**20


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
        self.act_in_place = _IN_PLACE.get(config.hidden_act)
        self.dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_grad_enabled()
            or type(x) is not torch.Tensor
            or torch.compiler.is_compiling()
            or self._hooked()
        ):
            return self._forward(x, self.act_fn)
        act = self.act_in_place or self.act_fn
        rows, width = x.numel() // x.shape[-1], self.up_proj.out_features
        chunks = -(-rows * width * x.element_size() // MLP_CHUNK_BYTES)
        if chunks <= 1:
            return self._forward(x, act)
        step = -(-rows // chunks)
        flat = x.reshape(rows, x.shape[-1])
        if not self._plain(x) or onednn_applies(flat, self.up_proj.weight, self.up_proj.bias):
            # a wrapped or quantized projection, or the oneDNN route (whose op takes no output buffer;
            # measured faster this way than one pass): called as a module, each chunk's output copied
            out = None
            for i in range(0, rows, step):
                part = self._forward(flat[i : i + step], act)
                out = part.new_empty(rows, part.shape[-1]) if out is None else out
                out[i : i + step] = part
            return out.view(*x.shape[:-1], out.shape[-1])
        out = flat.new_empty(rows, self.down_proj.out_features)
        up = flat.new_empty(step, width)
        gate = None if self.gate_proj is None else flat.new_empty(step, width)
        for i in range(0, rows, step):
            part = flat[i : i + step]
            h = _linear_into(self.up_proj, part, up[: len(part)])
            if gate is not None:
                h = act(_linear_into(self.gate_proj, part, gate[: len(part)])).mul_(h)
            else:
                h = act(h)
            _linear_into(self.down_proj, self.dropout(h), out[i : i + step])
        return out.view(*x.shape[:-1], out.shape[-1])

    def _projections(self) -> list[nn.Module]:
        return [p for p in (self.gate_proj, self.up_proj, self.down_proj) if p is not None]

    def _plain(self, x: torch.Tensor) -> bool:
        """Whether every projection is a plain `nn.Linear` (linear.plain_linear) with plain weights of
        x's dtype, so its output can be written into a given buffer (not a PEFT wrapper, a quantized
        weight, an offloaded one, autocast)."""
        return not torch.is_autocast_enabled(x.device.type) and all(
            plain_linear(p) and all(type(t) is nn.Parameter and t.dtype == x.dtype for t in p.parameters())
            for p in self._projections()
        )

    def _hooked(self) -> bool:
        """Whether a forward hook watches a projection (it might keep an output the in-place activation
        would overwrite, and expects one call per forward): then the MLP runs as one plain pass."""
        return any(module_hooked(p) for p in self._projections())

    def _forward(self, x: torch.Tensor, act) -> torch.Tensor:
        if self.gate_proj is None:
            h = act(project(self.up_proj, x))
        else:
            h = act(project(self.gate_proj, x)) * project(self.up_proj, x)
        return project(self.down_proj, self.dropout(h))


def _linear_into(linear: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`linear(x)` written into `out`."""
    if linear.bias is None:
        return torch.mm(x, linear.weight.t(), out=out)
    return torch.addmm(linear.bias, x, linear.weight.t(), out=out)


# Attention -----------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention with MHA/GQA/MQA, optional RoPE, KV cache and cross-attention."""

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        is_causal: bool,
        layer_type: str = "full_attention",
        is_cross_attention: bool = False,
    ):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        # The layer type picks the backend under a per-layer mapping; cross-attention follows its block.
        self.layer_type = layer_type
        windowed = layer_type != "full_attention" and not is_cross_attention
        self.sliding_window = config.sliding_window if windowed else None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.effective_attention_scale
        self.attention_dropout = config.attention_dropout
        e, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, e, bias=bias)
        # Longformer's query_global/key_global/value_global: the global tokens' own projections
        # (config.global_projections; bidirectional layers with global tokens only, checked by the config)
        self.global_projections = (
            config.global_projections
            and LAYER_TYPE_PATTERN[layer_type] in GLOBAL_KINDS
            and not is_cross_attention
            and not is_causal
        )
        # gpt-oss's learned sinks (sinks.py): one logit per query head, self-attention only
        self.sinks = (
            nn.Parameter(torch.zeros(self.num_heads))
            if config.attention_sinks and not is_cross_attention
            else None
        )
        if self.global_projections:
            self.q_global_proj = nn.Linear(e, self.num_heads * d, bias=bias)
            self.k_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
            self.v_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)

    def _project_kv(self, x: torch.Tensor):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism (config.base_model_tp_plan) each rank holds a share of them
        k = project(self.k_proj, x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, K, S, D)
        v = project(self.v_proj, x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask,
        *,
        plan: LayerPlan,
        key_value_states: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, E).
            attention_mask: `plan.mask`, handed over as an argument of the block (see Block.forward).
            plan: this layer type's plan for this forward (plan.py).
            key_value_states: (B, S, E) encoder output, for cross-attention.
        """
        b, t, _ = hidden_states.shape
        q = project(self.q_proj, hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if self.is_cross_attention:
            k, v = plan.cache.cross_keys_values(self.layer_idx, lambda: self._project_kv(key_value_states))
        else:
            k, v = self._project_kv(hidden_states)
            if plan.rope is not None:
                q, k = apply_rope(q, *plan.rope), apply_rope(k, *plan.rope)
            k, v = plan.cache.append(k, v, self.layer_idx)
            if plan.linformer is not None:  # Linformer: (B, K, S, D) -> (B, K, linformer_k, D); mask is None
                k, v = plan.linformer.project(self.layer_idx, k, v, plan.pattern)
            if plan.sink_shift is not None:  # streaming sinks at their positions within the cache
                k = shift_sinks(k, plan.pattern.key_prefix, *plan.sink_shift)

        fn = None  # the plan's function, or a kernel's with the learned sinks folded in as one extra key
        if self.sinks is not None and plan.backend not in NATIVE_SINKS:
            fn = partial(attend_with_sinks, plan.attention_fn, pattern=plan.pattern)
        out, weights = run_planned(
            self, plan, q, k, v, attention_mask, output_attentions, fn=fn, sliding_window=self.sliding_window
        )
        if self.global_projections and plan.pattern.global_queries is not None:
            out, weights = global_rows(self, hidden_states, out, weights, plan.pattern, plan.rope)
        out = project(self.o_proj, out.reshape(b, t, -1))  # (B, T, E)
        return out, (weights if output_attentions else None)


# Block ---------------------------------------------------------------------------------------------


class Block(GradientCheckpointingLayer):
    """Self-attention, optional cross-attention, MLP; each a residual branch, pre- or post-norm."""

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        is_causal: bool,
        cross_attention: bool,
        layer_type: str = "full_attention",
    ):
        super().__init__()
        cpu_linear_route()  # a wrong SWAPFORMER_CPU_LINEAR fails when the model is built
        self.pre_norm = config.pre_norm
        self.layer_type = layer_type
        # multi-head latent attention (mla.py) when a decoder config sets kv_lora_rank
        attention = LatentAttention if getattr(config, "kv_lora_rank", None) is not None else Attention
        self.self_attn = attention(config, layer_idx, is_causal=is_causal, layer_type=layer_type)
        self.self_attn_norm = make_norm(config)
        self.cross_attn = (
            Attention(config, layer_idx, is_causal=False, layer_type=layer_type, is_cross_attention=True)
            if cross_attention
            else None
        )
        self.cross_attn_norm = make_norm(config) if cross_attention else None
        self.mlp = MLP(config)
        self.mlp_norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _residual(self, h, norm, branch):
        """h + branch(norm(h)) when pre-norm, norm(h + branch(h)) when post-norm."""
        if self.pre_norm:
            out, weights = branch(norm(h))
            return h + self.dropout(out), weights
        out, weights = branch(h)
        return norm(h + self.dropout(out)), weights

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
        """`attention_mask` and `encoder_attention_mask` are `plan.mask` and `cross_plan.mask`, passed
        positionally with the hidden states: a trained position bias (T5) is in the mask, and activation
        checkpointing tracks the gradients of positional tensors only."""
        h, self_weights = self._residual(
            hidden_states,
            self.self_attn_norm,
            lambda x: self.self_attn(x, attention_mask, plan=plan, output_attentions=output_attentions),
        )
        cross_weights = None
        if self.cross_attn is not None:
            h, cross_weights = self._residual(
                h,
                self.cross_attn_norm,
                lambda x: self.cross_attn(
                    x,
                    encoder_attention_mask,
                    plan=cross_plan,
                    key_value_states=encoder_hidden_states,
                    output_attentions=output_attentions,
                ),
            )
        h, _ = self._residual(h, self.mlp_norm, lambda x: (self.mlp(x), None))
        return h, self_weights, cross_weights
