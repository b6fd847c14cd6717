"""Two edges of the sparse backend found by fuzzing (issue 31), each against eager on every CPU route:

- block size 1 and window 1 with a position bias give masks whose last dimension has size 1; torch calls
  such a tensor contiguous whatever that dimension's stride, and the native kernels refused it;
- q, k or v whose last dimension has a stride other than 1 (e.g. heads interleaved in a fused
  projection): torch's private CPU flash op, which the PyTorch path calls, reads each row as
  contiguous memory whatever the stride says.
"""

from __future__ import annotations

import pytest
import torch

import swapformer
from swapformer.modeling.attention.functions import eager_attention_forward
from swapformer.modeling.attention.lowering import lower
from swapformer.modeling.attention.masks import AttentionPattern
from swapformer.modeling.sparse.sparse import sparse_attention_forward

from conftest import SPARSE_CPU_ROUTES, build, generate_steps, max_diff, padded_batch, pattern_config
from pattern_cases import sparse_layer_pattern

pytestmark = pytest.mark.usefixtures("one_thread")

# Layers of blocks of 1 whose masks are one key wide: the band's (window 1), the global keys' (one), or
# both. With a position bias such a mask (B, N, H, 1, 1) has its heads innermost, and any last stride.
ONE_KEY_WIDE = {
    "band": dict(sliding_window=1, attention_block_size=1, global_tokens=0),
    "band-and-globals": dict(sliding_window=1, attention_block_size=1, global_tokens=1),
    "globals": dict(sliding_window=2, attention_block_size=1, global_tokens=1),
}


def one_key_config(arch, position, shape):
    return pattern_config(
        arch, "sliding_global_attention", position_embedding_type=position, **ONE_KEY_WIDE[shape]
    )


@pytest.mark.parametrize("route", SPARSE_CPU_ROUTES)
@pytest.mark.parametrize("shape", ONE_KEY_WIDE)
@pytest.mark.parametrize("position", ["alibi", "relative_bias"])
def test_masks_one_key_wide_with_a_position_bias_encode_as_eager(position, shape, route):
    """Block size 1 and window 1, or one global token, with a position bias: the encoder's hidden
    states on the sparse backend equal eager's."""
    config = one_key_config("encoder", position, shape)
    ids, mask = padded_batch(length=12, padding="right")
    with torch.no_grad():
        want = build(swapformer.EncoderModel, config)(ids, attention_mask=mask).last_hidden_state
        with swapformer.sparse_cpu(route):
            got = build(swapformer.EncoderModel, config, attn="sparse")(ids, attention_mask=mask)
    assert max_diff(got.last_hidden_state, want, mask) <= 1e-5


@pytest.mark.parametrize("route", SPARSE_CPU_ROUTES)
@pytest.mark.parametrize("shape", ONE_KEY_WIDE)
@pytest.mark.parametrize("position", ["alibi", "relative_bias"])
def test_masks_one_key_wide_with_a_position_bias_generate_as_eager(position, shape, route):
    """The same layers in a decoder: greedy generation (prompt, then cached one-token steps) gives
    eager's tokens and logits."""
    config = one_key_config("decoder", position, shape)
    ids, mask = padded_batch(length=10, padding="left")
    runs = {}
    for attn in ("eager", "sparse"):
        model = build(swapformer.DecoderForCausalLM, config, attn=attn)
        with swapformer.sparse_cpu(route):
            runs[attn] = generate_steps(model, ids, 6, attention_mask=mask, output_logits=True)
    assert torch.equal(runs["sparse"].sequences, runs["eager"].sequences)
    for got, want in zip(runs["sparse"].logits, runs["eager"].logits, strict=True):
        assert max_diff(got, want) <= 1e-4


class Heads(torch.nn.Module):
    """What the attention functions read from their module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = False


def interleaved(shape, generator):
    """Three tensors of `shape` whose last-dimension stride is 3: q, k and v interleaved along the
    last axis of one fused projection (`fused[..., i::3]`)."""
    fused = torch.randn(*shape[:-1], 3 * shape[-1], generator=generator)
    return fused[..., 0::3], fused[..., 1::3], fused[..., 2::3]


def global_pattern(batch, length, causal, window) -> AttentionPattern:
    """A window + global layer of blocks of 4: two global tokens per row (keys merged beside the bands, and query
    rows over every key), the last three keys of the last row padding."""
    key_valid = torch.ones(batch, length, dtype=torch.bool)
    key_valid[-1, -3:] = False
    glob = torch.zeros(batch, length, dtype=torch.bool)
    glob[:, :2] = True
    return sparse_layer_pattern(batch, length, causal, window, 4, key_valid, glob)


# (batch, kv heads) of 4 query heads. With one row, no GQA, a window of 1 and whole blocks, the PyTorch
# path hands views of q, k and v to the flash op; otherwise some are copies (reshaped or padded).
SHAPES = [(1, 4), (2, 2)]
LENGTH = 24


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, kv_heads", SHAPES)
@pytest.mark.parametrize("route", SPARSE_CPU_ROUTES)
def test_strided_query_key_value_give_eager_attention(route, batch, kv_heads, causal, window):
    """`sparse_attention_forward` called directly (it is registered for any caller) with q, k, v
    strided along their last axis: output equals `eager_attention_forward`'s with the pattern's mask,
    on each CPU route."""
    heads, length, d = 4, LENGTH, 8
    g = torch.Generator().manual_seed(0)
    q = interleaved((batch, heads, length, d), g)[0]
    k, v = interleaved((batch, kv_heads, length, d), g)[1:]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 3
    pattern = global_pattern(batch, length, causal, window)
    module = Heads(heads, kv_heads)
    with torch.no_grad(), swapformer.sparse_cpu(route):
        want = eager_attention_forward(module, q, k, v, pattern.additive(torch.float32))[0]
        got = sparse_attention_forward(module, q, k, v, lower(pattern, "sparse", torch.float32))[0]
    assert max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("batch, kv_heads", SHAPES)
def test_strided_query_key_value_give_eager_gradients(batch, kv_heads, window):
    """With gradients (the PyTorch path's autograd function, whose backward calls the private flash
    op's backward): output and q, k, v gradients equal eager's."""
    heads, length, d = 4, LENGTH, 8
    g = torch.Generator().manual_seed(1)
    q = interleaved((batch, heads, length, d), g)[0].requires_grad_()
    k, v = (x.requires_grad_() for x in interleaved((batch, kv_heads, length, d), g)[1:])
    pattern = global_pattern(batch, length, causal=False, window=window)
    module = Heads(heads, kv_heads)
    probe = torch.randn(batch, length, heads, d, generator=g)
    results = []
    for run in (
        lambda: eager_attention_forward(module, q, k, v, pattern.additive(torch.float32))[0],
        lambda: sparse_attention_forward(module, q, k, v, lower(pattern, "sparse", torch.float32))[0],
    ):
        out = run()
        results.append((out, *torch.autograd.grad((out * probe).sum(), (q, k, v))))
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert max_diff(got.detach(), want.detach()) <= 1e-5, name
