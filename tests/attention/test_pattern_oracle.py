"""Every backend against an independent oracle of the attention patterns (tests/pattern_oracle.py).

Through the real model path: a config with the pattern, a model, a forward from token ids, padding,
packing markers and global marks. Each attention call of the model is recorded (its q, k, v made
leaves, so the backend's own forward and backward are what is measured), and its output and the
gradients of q, k and v are compared with softmax(q k^T * scale + oracle mask) v computed here. fp32;
outputs within 1e-5, gradients within 1e-4. Outputs at padding queries are not specified (they reach
no real token) and are left out of the comparison and of the loss.

Hypothesis draws the cases (lengths, windows, block sizes, global tokens and marks, random blocks and
seeds, padding side, packed rows, MHA/GQA/MQA, causal decoders and bidirectional encoders, cached
steps, and q, k, v handed to the backend as views strided along their last axis, as any caller of a
registered attention function may); `derandomize=True` makes CI deterministic. eager, sdpa and sparse run every case;
flash_attention_2 runs its full and sliding cases on test_packing's CPU reference kernels; flex runs
two fixed cases (slow: it compiles). tests/mutation_check.py shows that each rule has a test here
that fails without it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swapformer
from swapformer.modeling.core import layers as attention_module
from swapformer.modeling.sparse import sparse as sparse_module

from conftest import SPARSE_CPU_ROUTES, build, odd_strides, tiny_config
from flash_reference import on_flash
from pattern_oracle import KINDS, PatternSpec, RowLayout, allowed_rows, in_window, random_block_table

LAYER_TYPES = list(KINDS)
BACKENDS = ["eager", "sdpa", "sparse"]
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


# The cases -----------------------------------------------------------------------------------------


@dataclass
class Case:
    causal: bool
    layer_types: list[str]
    window: int
    rows: list[RowLayout]  # every row has P + T tokens
    global_tokens: int = 0
    block_size: int = 2
    num_random_blocks: int = 0
    random_seed: int = 0
    kv_heads: int = 2
    past: int = 0  # tokens cached before the step under test (decoders)
    use_marks: bool = False
    use_position_ids: bool = False
    strided: bool = False  # every backend gets q, k, v as views strided along their last axis

    @property
    def length(self) -> int:
        return len(self.rows[0])

    def config(self):
        return tiny_config(
            "decoder" if self.causal else "encoder",
            layer_types=self.layer_types,
            **self.spec(self.layer_types[0]).config_options(),
            num_key_value_heads=self.kv_heads,
            position_embedding_type="rope",
            max_position_embeddings=128,
        )

    def spec(self, layer_type: str) -> PatternSpec:
        return PatternSpec(
            kind=KINDS[layer_type],
            causal=self.causal,
            window=self.window,
            global_tokens=self.global_tokens,
            block_size=self.block_size,
            num_random_blocks=self.num_random_blocks,
            random_seed=self.random_seed,
        )

    def inputs(self) -> dict:
        """The model inputs of all P + T tokens: ids, attention_mask, and global marks and position_ids
        (restarting per sequence, counted over real tokens) where the case uses them."""
        g = torch.Generator().manual_seed(self.random_seed)
        real = torch.tensor([row.real for row in self.rows])
        ids = torch.randint(3, 90, real.shape, generator=g).masked_fill(~real, 0)
        inputs = {"input_ids": ids, "attention_mask": real.long()}
        if self.use_marks:
            inputs["global_attention_mask"] = torch.tensor([row.marked for row in self.rows]).long()
        if self.use_position_ids:
            inputs["position_ids"] = torch.tensor(
                [[row.position(i) if row.real[i] else 0 for i in range(len(row))] for row in self.rows]
            )
        return inputs

    def oracle_mask(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, P + T) allowed keys of the queries P.., and (B, T) which queries are real."""
        spec = self.spec(layer_type)
        allowed, real = [], []
        for row in self.rows:
            rows = allowed_rows(spec, row, self.past)
            real.append([r is not None for r in rows])
            allowed.append([r if r is not None else [False] * len(row) for r in rows])
        return torch.tensor(allowed), torch.tensor(real)


def row_layouts(draw, batch, length, packing, padding, marks):
    """Rows of `length` tokens: padding on one side, the real tokens split into packed sequences."""
    rows = []
    for _ in range(batch):
        n_pad = draw(st.integers(0, length - 1)) if padding else 0
        side = draw(st.sampled_from(["left", "right"])) if padding == "any" else padding
        n_real = length - n_pad
        cuts = sorted(draw(st.sets(st.integers(1, n_real - 1), max_size=4))) if packing and n_real > 1 else []
        sequence = []
        for i, size in enumerate([b - a for a, b in zip([0, *cuts], [*cuts, n_real])]):
            sequence += [i] * size
        pad_seq = [0] * n_pad if side == "left" else [sequence[-1]] * n_pad
        real = [True] * n_real
        if side == "left":
            real, sequence = [False] * n_pad + real, pad_seq + sequence
        else:
            real, sequence = real + [False] * n_pad, sequence + pad_seq
        marked = [draw(st.integers(0, 9)) == 0 for _ in range(length)] if marks else [False] * length
        rows.append((real, sequence, marked))
    packed = any(len(set(seq[i] for i in range(length) if real[i])) > 1 for real, seq, _ in rows)
    return [RowLayout(tuple(r), tuple(s), tuple(m), packed=packed) for r, s, m in rows]


@st.composite
def cases(draw, cached: bool = False, focus: str | None = None):
    """Cases of every kind; `cached`: a decoder step after a prompt; `focus="bigbird"`: both layers
    BigBird with random blocks, a narrow window and at most one global token, so the random blocks
    decide most of the mask; `focus="flash"`: what flash_attention_2 computes (full and sliding
    layers, padding or packing but not both)."""
    causal = True if cached else draw(st.booleans())
    length = draw(st.integers(2 if cached else (8 if focus == "bigbird" else 1), 48))
    batch = draw(st.integers(1, 3))
    packing = False if cached else draw(st.booleans())
    padding = draw(st.sampled_from(["left", False] if cached else ["any", False]))
    if focus == "flash" and packing:
        padding = False
    marks = draw(st.booleans()) and focus != "flash"
    past = draw(st.integers(1, length - 1)) if cached else 0
    rows = row_layouts(draw, batch, length, packing, padding, marks)
    if cached:  # a generated step marks no global token (GlobalWindowLayer refuses it): marks in the prompt
        rows = [RowLayout(r.real, r.sequence, r.marked[:past] + (False,) * (length - past)) for r in rows]
        if not all(any(r.real[:past]) for r in rows):
            rows = [RowLayout((True,) * length, r.sequence, r.marked) for r in rows]  # no empty prompt
    layer_types = {"bigbird": ["bigbird_attention"], "flash": LAYER_TYPES[:2]}.get(focus, LAYER_TYPES)
    return Case(
        causal=causal,
        layer_types=[draw(st.sampled_from(layer_types)), draw(st.sampled_from(layer_types))],
        window=draw(st.integers(1, 3 if focus == "bigbird" else 10)),
        global_tokens=draw(st.integers(0, 1 if focus == "bigbird" else 3)),
        block_size=draw(st.sampled_from([2, 3, 4, 8])),
        num_random_blocks=draw(st.integers(1 if focus == "bigbird" else 0, 3)),
        random_seed=draw(st.integers(0, 10_000)),
        kv_heads=draw(st.sampled_from([4, 2, 1])),
        rows=rows,
        past=past,
        use_marks=marks,
        use_position_ids=packing,
        strided=draw(st.booleans()),
    )


# Recording the attention calls and the reference ---------------------------------------------------


@dataclass
class Call:
    module: torch.nn.Module
    q: torch.Tensor  # (B, H, T, D) leaves
    k: torch.Tensor  # (B, K, S, D)
    v: torch.Tensor
    out: torch.Tensor  # (B, T, H, D)


@contextlib.contextmanager
def recording(strided: bool = False):
    """Record every self-attention call of a forward; q, k and v become leaves of their own (views
    strided along their last axis when `strided`: `odd_strides`)."""
    calls: list[Call] = []
    original = attention_module.call_attention
    restride = odd_strides if strided else (lambda x: x)

    def record(fn, backend, kind, module, q, k, v, mask, **kwargs):
        q, k, v = (restride(x.detach()).requires_grad_(torch.is_grad_enabled()) for x in (q, k, v))
        out, weights = original(fn, backend, kind, module, q, k, v, mask, **kwargs)
        calls.append(Call(module, q, k, v, out))
        return out, weights

    attention_module.call_attention = record
    try:
        yield calls
    finally:
        attention_module.call_attention = original


def reference(q, k, v, allowed, scale):
    """softmax(q k^T * scale + mask) v, written out: q (B, H, T, D), k and v (B, K, S, D), allowed
    (B, T, S) bool; rows with no key give zeros. Returns (B, T, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys: all -inf, NaN -> 0
    return (probs @ v).transpose(1, 2)


def probe_loss(out, real):
    """A loss over the real queries (B, T) against a fixed random probe."""
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return torch.where(real[:, :, None, None], out * probe, torch.zeros(())).sum()


def diff(a, b, real=None) -> float:
    d = (a.detach() - b.detach()).abs()
    if real is not None:
        d = d[real]
    return float(d.max()) if d.numel() else 0.0


def check_call(case: Case, layer_type: str, call: Call, *, grads: bool, keys=None, label=""):
    """Compare one recorded call with the reference over the oracle's mask; `keys` (k, v) of all P + T
    tokens replace the call's (a cache may hand over fewer)."""
    allowed, real = case.oracle_mask(layer_type)
    k, v = keys if keys is not None else (call.k, call.v)
    want = reference(call.q, k, v, allowed, call.module.scaling)
    assert call.out.shape == want.shape
    d_out = diff(call.out, want, real)
    assert d_out <= OUT_TOL, f"{label} {layer_type}: output differs from the oracle's by {d_out:.2e}"
    if not grads:
        return
    got_grads = torch.autograd.grad(probe_loss(call.out, real), (call.q, call.k, call.v))
    want_grads = torch.autograd.grad(probe_loss(want, real), (call.q, call.k, call.v))
    for name, g, w in zip("qkv", got_grads, want_grads):
        d = diff(g, w)
        assert d <= GRAD_TOL, f"{label} {layer_type}: d{name} differs from the oracle's by {d:.2e}"


def model_for(case: Case):
    cls = swapformer.DecoderModel if case.causal else swapformer.EncoderModel
    return build(cls, case.config())


def check_uncached(case: Case, backends=BACKENDS, grads=True):
    model = model_for(case)
    inputs = case.inputs()
    if case.causal:
        inputs["use_cache"] = False
    for backend in backends:
        if backend == "flash_attention_2":
            on_flash(model)  # CPU reference kernels (flash_reference.py), no CUDA check
        else:
            model.set_attn_implementation(backend)
        with torch.set_grad_enabled(grads), recording(case.strided) as calls:
            model(**inputs)
        assert len(calls) == len(case.layer_types)
        for layer_type, call in zip(case.layer_types, calls):
            check_call(case, layer_type, call, grads=grads, label=backend)


def check_cached_step(case: Case, backends=BACKENDS):
    """The step of tokens P.. after a prefix of P cached tokens, against the oracle over all P + T keys
    (taken from an uncached forward: a cache that dropped a key the query may see shows here)."""
    model = model_for(case)
    inputs = case.inputs()
    p = case.past
    for backend in backends:
        model.set_attn_implementation(backend)
        with torch.no_grad():
            with recording() as whole:
                model(**inputs, use_cache=False)
            prompt = {name: x[:, :p] for name, x in inputs.items()}
            cache = model(**prompt, use_cache=True).cache
            step = {name: x if name != "input_ids" else x[:, p:] for name, x in inputs.items()}
            with recording(case.strided) as calls:
                model(**step, cache=cache, use_cache=True)
        for layer_type, call, full in zip(case.layer_types, calls, whole):
            assert diff(call.q, full.q[:, :, p:]) <= OUT_TOL  # the same queries at the same positions
            check_call(case, layer_type, call, grads=False, keys=(full.k, full.v), label=f"{backend} cached")


# Property tests ------------------------------------------------------------------------------------


@settings(max_examples=120, **SETTINGS)
@given(case=cases())
def test_backends_equal_the_oracle(case):
    """eager, sdpa and sparse: output and q/k/v gradients of every layer equal the oracle's attention;
    and sparse's paths without gradients give the oracle's output too: the PyTorch path (one query
    block per kernel call, the global query rows over as many pieces of the keys) and the native CPU
    kernels (cpu/sparse_native.py)."""
    check_uncached(case)
    with pytest.MonkeyPatch.context() as patch, swapformer.sparse_cpu("torch"):
        patch.setattr(sparse_module, "CHUNK_BYTES", 1)
        check_uncached(case, backends=("sparse",), grads=False)
    if "native" in SPARSE_CPU_ROUTES:
        with swapformer.sparse_cpu("native"):
            check_uncached(case, backends=("sparse",), grads=False)


@settings(max_examples=60, **SETTINGS)
@given(case=cases(focus="bigbird"))
def test_bigbird_equals_the_oracle(case):
    """BigBird with the random blocks deciding most of the mask (packed rows: counted per sequence)."""
    check_uncached(case)


@settings(max_examples=50, **SETTINGS)
@given(case=cases(cached=True))
def test_cached_steps_equal_the_oracle(case):
    """A step of 1.. tokens after P cached ones (left padding, global marks in the prompt): each
    backend's output over the keys its cache kept equals the oracle's over all P + T keys (sparse:
    on each CPU route)."""
    for route in SPARSE_CPU_ROUTES:
        with swapformer.sparse_cpu(route):
            check_cached_step(case, backends=BACKENDS if route == "torch" else ("sparse",))


@settings(
    max_examples=30,
    **{**SETTINGS, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]},
)
@given(case=cases(focus="flash"))
def test_flash_equals_the_oracle(case, reference_flash):
    """flash_attention_2 (full and sliding layers; padding or packing, not both) through transformers'
    own flash routing, with the CUDA kernels replaced by test_packing's plain-torch references of their
    contract: output and gradients equal the oracle's attention."""
    check_uncached(case, backends=["flash_attention_2"])


# The oracle itself, by hand ------------------------------------------------------------------------


def picture(rows) -> list[str]:
    return ["".join("x" if a else "." for a in row) for row in rows]


def plain_row(n, marked=()):
    return RowLayout((True,) * n, (0,) * n, tuple(i in marked for i in range(n)))


def test_oracle_window_edges():
    causal = PatternSpec("sliding", causal=True, window=2)
    assert picture(allowed_rows(causal, plain_row(4))) == ["x...", "xx..", ".xx.", "..xx"]
    both = PatternSpec("sliding", causal=False, window=2)
    assert picture(allowed_rows(both, plain_row(4))) == ["xx..", "xxx.", ".xxx", "..xx"]
    assert not in_window(causal, 5, 3) and in_window(causal, 5, 4) and not in_window(causal, 4, 5)


def test_oracle_global_tokens_padding_and_packing():
    spec = PatternSpec("sliding_global", causal=False, window=1, global_tokens=1)
    # left padding: the first real token (index 1) is global; index 4 is marked
    row = RowLayout((False, True, True, True, True), (0,) * 5, (False,) * 4 + (True,))
    rows = allowed_rows(spec, row)
    assert rows[0] is None and picture(rows[1:]) == [".xxxx", ".xx.x", ".x.xx", ".xxxx"]
    # two packed sequences of 3: each sequence's first token is global within its sequence only
    packed = RowLayout((True,) * 6, (0, 0, 0, 1, 1, 1), (False,) * 6, packed=True)
    assert picture(allowed_rows(spec, packed)) == ["xxx...", "xx....", "x.x...", "...xxx", "...xx.", "...x.x"]


def test_oracle_random_blocks():
    # causal: never a block after the query's own; every query block draws min(r, j + 1) blocks
    table = random_block_table(3, 6, 6, 2, True)
    assert all(kb <= qb for qb, kb in table)
    assert [sum(qb == j for qb, _ in table) for j in range(6)] == [1, 2, 2, 2, 2, 2]
    spec = PatternSpec("bigbird", causal=False, window=1, block_size=2, num_random_blocks=1, random_seed=3)
    rows = allowed_rows(spec, plain_row(8))
    drawn = random_block_table(3, 4, 4, 1, False)
    for q in range(8):
        for k in range(8):
            assert rows[q][k] == (q == k or (q // 2, k // 2) in drawn)


def test_sparse_gradients_when_rows_hold_different_numbers_of_global_queries():
    """Regression: the sparse backend wrote its dense global-query rows back with a scatter whose
    unused slots (rows with fewer global queries than the batch's most) pointed at query 0, so query 0's
    band result received their gradient too: outputs right, dq wrong by ~0.1-1."""
    marks = [(0, 5), (), (3, 4, 9)]
    rows = [plain_row(12, marked=m) for m in marks]
    for causal in (False, True):
        case = Case(
            causal=causal,
            layer_types=["sliding_global_attention", "bigbird_attention"],
            window=2,
            global_tokens=1,
            block_size=4,
            num_random_blocks=1,
            random_seed=1,
            rows=rows,
            use_marks=True,
        )
        check_uncached(case, backends=["sparse"])


def test_window_global_cache_without_global_tokens():
    """Regression: a window + global layer with no global token (global_tokens=0, no marks) whose cache
    dropped keys reported key offset 0, so cached steps masked the wrong keys (all backends)."""
    case = Case(
        causal=True,
        layer_types=["sliding_global_attention", "sliding_global_attention"],
        window=2,
        rows=[plain_row(9), plain_row(9)],
        past=6,
    )
    check_cached_step(case)


@pytest.mark.parametrize("step", [1, 3])
def test_window_of_one_cached(step):
    """Regression: transformers' windowed cache keeps its last `sliding_window - 1` tokens as
    `[-sliding_window + 1:]`, which for a window of 1 is `[-0:]`, every token: the keys then disagreed
    with the mask's sizes (wrong outputs for one new token, a shape error for several)."""
    case = Case(
        causal=True,
        layer_types=["sliding_attention", "sliding_attention"],
        window=1,
        rows=[plain_row(8)],
        past=8 - step,
    )
    check_cached_step(case)


@pytest.mark.parametrize("causal, side", [(False, "right"), (True, "left")])
def test_bigbird_padded_row_equals_the_row_alone(causal, side):
    """docs/architecture.md, decision 7 for BigBird: padding on either side leaves a row's random blocks (counted from
    its first real token, in the layout its real length has alone) and so its outputs unchanged."""
    case = Case(
        causal=causal,
        layer_types=["bigbird_attention", "bigbird_attention"],
        window=2,
        block_size=4,
        num_random_blocks=2,
        rows=[plain_row(20)],
    )
    model = model_for(case)
    ids = case.inputs()["input_ids"]
    pad = torch.zeros(1, 6, dtype=torch.long)
    padded = torch.cat([ids, pad] if side == "right" else [pad, ids], dim=1)
    # beside a longer row: a bidirectional row's layout must not follow the batch's longest row either
    longer = torch.arange(3, 3 + padded.shape[1] + 4)[None]
    batch = torch.cat([torch.nn.functional.pad(padded, (0, 4) if side == "right" else (4, 0)), longer])
    mask = (batch != 0).long()
    for backend in BACKENDS:
        model.set_attn_implementation(backend)
        with torch.no_grad():
            alone = model(ids).last_hidden_state
            got = model(batch, attention_mask=mask).last_hidden_state[:1][mask[:1].bool()][None]
        assert diff(got, alone) <= OUT_TOL, backend


@pytest.mark.slow
@pytest.mark.parametrize(
    "causal, layer_types, padding, packing, strided",
    [
        (True, ["bigbird_attention", "sliding_global_attention"], "left", False, False),
        (False, ["sliding_global_attention", "bigbird_attention"], "right", True, True),
    ],
)
def test_flex_equals_the_oracle(causal, layer_types, padding, packing, strided):
    """flex_attention compiles on CPU (slow): two fixed cases, forward only (flex has no CPU backward)."""
    g = __import__("random").Random(7)
    length = 24
    rows = []
    for n_pad in (0, 5):
        real = [True] * (length - n_pad)
        sequence = [0] * 7 + [1] * (len(real) - 7) if packing else [0] * len(real)
        marked = [g.random() < 0.1 for _ in range(length)]
        if padding == "left":
            real, sequence = [False] * n_pad + real, [0] * n_pad + sequence
        else:
            real, sequence = real + [False] * n_pad, sequence + [sequence[-1]] * n_pad
        rows.append(RowLayout(tuple(real), tuple(sequence), tuple(marked), packed=packing))
    case = Case(
        causal=causal,
        layer_types=layer_types,
        window=3,
        global_tokens=2,
        block_size=4,
        num_random_blocks=2,
        random_seed=11,
        rows=rows,
        use_marks=True,
        use_position_ids=packing,
        strided=strided,
    )
    try:
        check_uncached(case, backends=["flex_attention"], grads=False)
    finally:
        torch._dynamo.reset()  # leave no compiled flex kernel (and its shapes) to later tests
