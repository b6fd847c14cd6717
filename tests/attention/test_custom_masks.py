"""Custom 4D attention masks (issue 26): `attention_mask` of shape (batch, 1, query, key), bool (True =
attend) or float (0 = attend, large negative = masked), as LlamaModel and BertModel take it for packed
documents, tree attention or any mask the caller builds.

References: transformers' LlamaForCausalLM, LlamaForSequenceClassification and BertModel with the
weights copied across (test_hf_parity's tiny models), given the same mask and position_ids: a float
mask on their eager and sdpa paths, a bool mask on sdpa (Llama's eager path adds a bool mask as 0/1,
which masks nothing); on windowed layers the same models given the 4D mask ANDed with the window. Eager
swapformer for every other backend; the uncached forward for cached decoding; the model's own 2D
padding path for a 4D mask made from the padding mask.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, LlamaForSequenceClassification

import swapformer
from swapformer.configuration.backends import BACKENDS
from swapformer.configuration.configuration_swapformer import LAYER_TYPES

from conftest import SPARSE_CPU_ROUTES, build, max_diff, padded_batch, pattern_config, tiny_config
from hf_models import bert, llama, pair

TOL = 1e-5
# (backend, sparse CPU route): the sparse backend on each route this machine runs
BACKEND_ROUTES = [("sdpa", None), *(("sparse", route) for route in SPARSE_CPU_ROUTES)]


# Masks: (T, T) bool, True where query q may attend key k, and the positions that go with them ------------


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def documents(*lengths: int):
    """Packed documents: a block-diagonal causal mask, positions restarting per document."""
    return torch.block_diag(*(causal(n) for n in lengths)), torch.cat([torch.arange(n) for n in lengths])


def tree(parents: list[int]):
    """Tree attention (speculative decoding's token trees): token i sees itself and its ancestors
    (`parents[i]`, -1 for the root); its position is its depth."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    depth = torch.zeros(len(parents), dtype=torch.long)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
            depth[i] = depth[parent] + 1
    return mask, depth


def left_padded(pad: int, *lengths: int):
    """`pad` padding tokens, then packed documents: no query sees a padding key, a padding query nothing."""
    docs, positions = documents(*lengths)
    n = pad + docs.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[pad:, pad:] = docs
    return mask, torch.nn.functional.pad(positions, (pad, 0))


def prefix_lm(prefix: int, n: int):
    """Bidirectional over the first `prefix` tokens, causal after: not a subset of the causal mask."""
    mask = causal(n)
    mask[:prefix, :prefix] = True
    return mask, torch.arange(n)


CASES = {  # two rows of 8 tokens each
    "packed": (documents(3, 5), documents(5, 3)),
    "tree": (tree([-1, 0, 0, 1, 1, 2, 3, 5]), tree([-1, 0, 1, 1, 0, 4, 4, 2])),
    "left_padded": (left_padded(0, 3, 5), left_padded(2, 2, 4)),
    "prefix_lm": (prefix_lm(3, 8), prefix_lm(5, 8)),
}


def batch(rows):
    """(B, 1, T, T) bool mask, (B, T) positions, and the live query rows (B, T): those that see a key."""
    mask = torch.stack([m for m, _ in rows])[:, None]
    return mask, torch.stack([p for _, p in rows]), mask[:, 0].any(-1)


def additive(mask: torch.Tensor) -> torch.Tensor:
    """The float form transformers' mask functions make: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def as_form(mask: torch.Tensor, form: str) -> torch.Tensor:
    return mask if form == "bool" else additive(mask)


def token_ids(batch_size: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 97, (batch_size, length), generator=torch.Generator().manual_seed(seed))


def with_layers(model, layer_type: str, attn: str, **options):
    """`model`'s weights in a model whose every layer is `layer_type` (config `options` added)."""
    config = model.config.to_dict() | {"layer_types": [layer_type] * model.config.num_hidden_layers} | options
    other = type(model)._from_config(type(model.config).from_dict(config), attn_implementation=attn)
    other.load_state_dict(model.state_dict())
    return other.eval()


# HF behaviour: LlamaForCausalLM and BertModel given the same mask -------------------------------------

# (transformers' backend, mask form, swapformer's backend); Llama's eager path adds a bool mask as 0/1
FORMS = [
    ("eager", "float", "eager"),
    ("sdpa", "float", "sdpa"),
    ("sdpa", "bool", "sdpa"),
    ("sdpa", "bool", "eager"),
]


@pytest.mark.parametrize("hf_attn, form, attn", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_decoder_matches_llama_on_a_4d_mask(case, hf_attn, form, attn):
    hf, ours = pair(llama(hf_attn, LlamaForCausalLM), swapformer.DecoderForCausalLM, attn)
    mask, positions, live = batch(CASES[case])
    ids = token_ids(2, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=as_form(mask, form), position_ids=positions).logits
        got = ours(ids, attention_mask=as_form(mask, form), position_ids=positions).logits
    assert max_diff(got, want, live) <= TOL


def test_without_position_ids_positions_count_from_the_cache_as_llamas_do():
    """No position_ids: 0..T-1 after the P cached tokens, whatever the mask (Llama's cache positions)."""
    hf, ours = pair(llama("sdpa", LlamaForCausalLM), swapformer.DecoderForCausalLM, "sdpa")
    mask, _, live = batch(CASES["packed"])
    ids = token_ids(2, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        assert max_diff(ours(ids, attention_mask=mask).logits, want, live) <= TOL
        hf_cache, cache = DynamicCache(config=hf.config), DynamicCache(config=ours.config)
        hf(ids[:, :5], attention_mask=mask[:, :, :5, :5], cache=hf_cache)
        ours(ids[:, :5], attention_mask=mask[:, :, :5, :5], cache=cache)
        want = hf(ids[:, 5:], attention_mask=mask[:, :, 5:], cache=hf_cache).logits
        got = ours(ids[:, 5:], attention_mask=mask[:, :, 5:], cache=cache).logits
    assert max_diff(got, want, live[:, 5:]) <= TOL


def test_a_mask_of_batch_one_serves_every_row_as_llamas_does():
    hf, ours = pair(llama("sdpa", LlamaForCausalLM), swapformer.DecoderForCausalLM, "sdpa")
    mask, positions = tree([-1, 0, 0, 1, 1, 2, 3, 5])
    ids = token_ids(3, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask[None, None], position_ids=positions[None]).logits
        got = ours(ids, attention_mask=mask[None, None], position_ids=positions[None]).logits
    assert max_diff(got, want) <= TOL


def test_sequence_classification_finds_the_last_token_by_pad_id_as_llama_does():
    """With a 4D mask there is no padding mask: the last token is the last one that is not pad_token_id."""
    hf, ours = pair(
        llama("sdpa", LlamaForSequenceClassification, pad_token_id=0, num_labels=3),
        swapformer.DecoderForSequenceClassification,
        "sdpa",
    )
    mask, positions, _ = batch(CASES["packed"])
    mask = mask & (torch.arange(8) < torch.tensor([[8], [6]]))[:, None, None, :]  # row 1 right padded
    ids = token_ids(2, 8)
    ids[1, 6:] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, position_ids=positions).logits
    assert max_diff(got, want) <= TOL


def documents_bidirectional(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T): each token sees the tokens of its document; -1 marks padding (seen by none, sees none)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & (doc_ids >= 0)[:, None, :])[:, None]


DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, -1, -1]])
DOC_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 0, 0]])


@pytest.mark.parametrize("hf_attn, form, attn", FORMS[:3])
def test_encoder_matches_bertmodel_on_a_block_diagonal_mask(hf_attn, form, attn):
    hf, ours = pair(bert(hf_attn), swapformer.EncoderModel, attn)
    mask = documents_bidirectional(DOCS)
    ids = token_ids(2, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=as_form(mask, form), position_ids=DOC_POSITIONS).last_hidden_state
        got = ours(ids, attention_mask=as_form(mask, form), position_ids=DOC_POSITIONS).last_hidden_state
    assert max_diff(got, want, DOCS >= 0) <= TOL


# Windowed layers: the 4D mask AND the layer's own pattern -----------------------------------------------


def window(n: int, width: int, causal_: bool) -> torch.Tensor:
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    return (d >= 0) & (d < width) if causal_ else d.abs() < width


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("case", ["packed", "tree", "prefix_lm"])
def test_sliding_layers_apply_their_causal_window_within_the_4d_mask(case, backend):
    """Llama given mask & causal window: the window and causality stay (a prefix-LM mask included)."""
    hf, ours = pair(llama("sdpa", LlamaForCausalLM), swapformer.DecoderForCausalLM, "sdpa")
    windowed = with_layers(ours, "sliding_attention", backend, sliding_window=3)
    mask, positions, live = batch(CASES[case])
    ids = token_ids(2, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask & window(8, 3, True), position_ids=positions).logits
        got = windowed(ids, attention_mask=mask, position_ids=positions).logits
    assert max_diff(got, want, live) <= TOL


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sparse"])
def test_bidirectional_sliding_layers_apply_their_window_within_the_4d_mask(backend):
    hf, ours = pair(bert("sdpa"), swapformer.EncoderModel, "sdpa")
    windowed = with_layers(ours, "sliding_attention", backend, sliding_window=2, attention_block_size=4)
    mask = documents_bidirectional(DOCS)
    ids = token_ids(2, 8)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask & window(8, 2, False), position_ids=DOC_POSITIONS)
        got = windowed(ids, attention_mask=mask, position_ids=DOC_POSITIONS)
    assert max_diff(got.last_hidden_state, want.last_hidden_state, DOCS >= 0) <= TOL


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_a_4d_mask_made_from_the_padding_mask_equals_the_padding_mask(arch, layer_type):
    """On every pattern kind: the 4D mask takes the padding mask's place, the layer's pattern stays.
    BigBird's bidirectional random layout follows the real length of a row, which a 4D mask does not
    state, so that case runs unpadded."""
    model = build(
        swapformer.EncoderModel if arch == "encoder" else swapformer.DecoderModel,
        pattern_config(arch, layer_type),
    )
    padding = "none" if (arch, layer_type) == ("encoder", "bigbird_attention") else "right"
    ids, padding_mask = padded_batch(length=12, padding=padding)
    valid = padding_mask.bool()
    mask = valid[:, None, None, :].expand(-1, 1, 12, -1)
    if arch == "decoder":
        mask = mask & causal(12)
    with torch.no_grad():
        want = model(ids, attention_mask=padding_mask).last_hidden_state
        got = model(ids, attention_mask=mask).last_hidden_state
    assert max_diff(got, want, valid) <= TOL


# Every backend that takes arbitrary masks gives eager's result -------------------------------------------


def mixed_rows(arch: str):
    """Two rows of 16 tokens: packed documents in one, padding and a tree (decoder) or documents
    (encoder) in the other; (B, 1, T, T) mask, positions, live rows."""
    if arch == "decoder":
        tree_mask, depth = tree([-1, 0, 0, 1, 1, 2, 3, 5, 6, 6, 8, 9, 10])
        padded = torch.zeros(16, 16, dtype=torch.bool)
        padded[3:, 3:] = tree_mask
        return batch([documents(9, 7), (padded, torch.nn.functional.pad(depth, (3, 0)))])
    docs = torch.tensor([[0] * 9 + [1] * 7, [-1] * 3 + [0] * 5 + [1] * 8])
    positions = torch.tensor([list(range(9)) + list(range(7)), [0] * 3 + list(range(5)) + list(range(8))])
    return documents_bidirectional(docs), positions, docs >= 0


def run_backends(arch: str, layer_type: str, backend: str, route: str | None, **options):
    """(eager's, `backend`'s) last hidden states on `mixed_rows`, and the live rows."""
    config = pattern_config(arch, layer_type, attention_block_size=4, **options)
    cls = swapformer.EncoderModel if arch == "encoder" else swapformer.DecoderModel
    mask, positions, live = mixed_rows(arch)
    ids = token_ids(2, 16)
    results = []
    with torch.no_grad():
        for attn in ("eager", backend):
            with swapformer.sparse_cpu(route or "auto"):
                out = build(cls, config, attn=attn)(ids, attention_mask=mask, position_ids=positions)
            results.append(out.last_hidden_state)
    return *results, live


@pytest.mark.parametrize("backend, route", BACKEND_ROUTES)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_backends_equal_eager_on_a_4d_mask(arch, layer_type, backend, route):
    eager, got, live = run_backends(arch, layer_type, backend, route)
    assert max_diff(got, eager, live) <= TOL


@pytest.mark.parametrize("backend", ["sdpa", "sparse"])
def test_backends_equal_eager_on_a_4d_mask_with_gqa_and_alibi(backend):
    eager, got, live = run_backends(
        "decoder",
        "sliding_global_attention",
        backend,
        "torch",
        num_key_value_heads=2,
        position_embedding_type="alibi",
    )
    assert max_diff(got, eager, live) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_flex_attention_equals_eager_on_a_4d_mask(arch):
    """flex compiles a kernel per shape on the CPU (~15 s each): one layer kind with global tokens per
    architecture, its full layer beside it."""
    eager, got, live = run_backends(arch, "sliding_global_attention", "flex_attention", None)
    assert max_diff(got, eager, live) <= TOL


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_cached_steps_with_4d_masks_equal_the_uncached_forward(layer_type, backend):
    """A prefill with a (B, 1, P, P) mask, then steps of one token with (B, 1, 1, P + i + 1) and one of two
    tokens: each step's logits are the uncached forward's under the whole (B, 1, T, T) mask. The window
    and window + global caches drop keys over these steps (window 5, 2 global tokens)."""
    model = build(swapformer.DecoderForCausalLM, pattern_config("decoder", layer_type), attn=backend)
    mask, _, live = mixed_rows("decoder")
    ids = token_ids(2, 16)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
        model(ids[:, :8], attention_mask=mask[:, :, :8, :8], cache=cache)
        for start, stop in ((8, 9), (9, 10), (10, 12), (12, 13), (13, 14), (14, 15), (15, 16)):
            step = model(ids[:, start:stop], attention_mask=mask[:, :, start:stop, :stop], cache=cache).logits
            assert max_diff(step, whole[:, start:stop], live[:, start:stop]) <= TOL, (start, stop)


# Refusals ----------------------------------------------------------------------------------------------


def decoder():
    return build(swapformer.DecoderModel, pattern_config("decoder", "full_attention"))


MASK = causal(6)[None, None].expand(2, 1, 6, 6)
BAD_MASKS = [
    (torch.ones(3, 1, 6, 6, dtype=torch.bool), ValueError, r"\(3, 1, 6, 6\).*batch=2"),
    (torch.ones(2, 1, 5, 6, dtype=torch.bool), ValueError, r"\(2, 1, 5, 6\).*query=6"),
    (torch.ones(2, 1, 6, 7, dtype=torch.bool), ValueError, r"\(2, 1, 6, 7\).*key=6"),
    (torch.ones(2, 4, 6, 6, dtype=torch.bool), ValueError, r"\(2, 4, 6, 6\).*one mask for every head"),
    (MASK.long(), TypeError, r"4D attention_mask has dtype torch.int64.*bool.*float"),
    (additive(MASK) + 1.0, ValueError, r"positive value 1.0.*0 where"),
    (additive(MASK).masked_fill(MASK, float("nan")), ValueError, r"NaN"),
    (additive(MASK).masked_fill(MASK, -0.5), ValueError, r"-0.5.*soft bias"),
]


@pytest.mark.parametrize("mask, error, message", BAD_MASKS, ids=[m for _, _, m in BAD_MASKS])
def test_bad_4d_masks_are_refused(mask, error, message):
    with pytest.raises(error, match=message):
        decoder()(token_ids(2, 6), attention_mask=mask)


def test_a_step_mask_must_cover_the_cached_and_new_tokens():
    model = decoder()
    cache = DynamicCache(config=model.config)
    ids = token_ids(2, 6)
    with torch.no_grad():
        model(ids[:, :5], attention_mask=MASK[:, :, :5, :5], cache=cache)
        with pytest.raises(ValueError, match=r"\(2, 1, 1, 5\).*key=6\) \(5 cached \+ 1 new\)"):
            model(ids[:, 5:], attention_mask=MASK[:, :, 5:, :5], cache=cache)


def test_a_4d_mask_with_packed_sequence_boundaries_is_refused():
    cu = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="4D attention_mask.*cu_seq_lens_q.*one or the other"):
        decoder()(token_ids(1, 12), attention_mask=causal(12)[None, None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)


@pytest.mark.parametrize("backend", [n for n, caps in BACKENDS.items() if not caps.custom_mask])
def test_backends_without_custom_masks_refuse_them_when_the_mask_is_seen(backend):
    """Put in place without the device check (these run on CUDA only): the table's refusal."""
    model = decoder()
    model.config._attn_implementation_internal = backend
    offered = ", ".join(repr(n) for n, caps in BACKENDS.items() if caps.custom_mask)
    with pytest.raises(ValueError) as info:
        model(token_ids(2, 6), attention_mask=MASK)
    assert str(info.value) == (
        f"attn_implementation={backend!r} does not support a 4D attention_mask (batch, 1, query, key), which "
        f"this batch needs; use one of {offered}"
    )


def test_linformer_refuses_a_4d_mask():
    config = tiny_config("encoder", position_embedding_type="learned", linformer_k=5)
    model = build(swapformer.EncoderModel, config)
    with pytest.raises(ValueError, match="4D attention_mask.*linformer_k=5"):
        model(token_ids(2, 6), attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool))


# Encoder-decoder ----------------------------------------------------------------------------------------


def test_seq2seq_refuses_a_4d_encoder_mask_and_takes_a_4d_decoder_mask():
    """The encoder's attention_mask also masks cross-attention, so it stays the (batch, source) padding
    mask; the decoder's may be 4D, and one made from the decoder's padding mask gives its result."""
    model = build(swapformer.Seq2SeqModel, pattern_config("seq2seq", "sliding_global_attention"))
    ids, padding_mask = padded_batch(length=10)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 1, 10, 10\).*cross-attention"):
        model(ids, attention_mask=padding_mask[:, None, None, :].expand(-1, 1, 10, -1), decoder_input_ids=ids)
    valid = padding_mask.bool()
    decoder_mask = valid[:, None, None, :] & causal(10)
    with torch.no_grad():
        want, got = (
            model(ids, attention_mask=padding_mask, decoder_input_ids=ids, decoder_attention_mask=m)
            for m in (padding_mask, decoder_mask)
        )
    assert max_diff(got.last_hidden_state, want.last_hidden_state, valid) <= TOL
