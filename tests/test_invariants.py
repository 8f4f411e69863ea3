"""Fuzzed invariants of dispatch / combine (hypothesis), on the reference path over 1, 2 and 4 virtual
CPU devices (JAX_EP_TEST_BACKEND points it elsewhere, as for the other tests).

Each example is a static configuration (EP size, tokens per rank with 0 allowed, hidden, top-k,
experts, capacity: the worst case or a smaller one that drops rows, expert alignment, x / row / y
dtypes, FP8 included) plus a routing that hypothesis draws slot by slot (valid and hot experts, -1,
out-of-range ids up to the int32 extremes, repeats of an earlier slot) and data from a drawn seed.
The properties, each a test of its own:

  * kept + dropped = routed on every rank, against the NumPy routing model (sanitise, count the
    (token, expert) pairs per rank); the layout op counts the same pairs; the handle marks
    every pair kept (a distinct row), dropped or not routed; drops happen exactly when the aligned
    segments do not fit, by the documented rule kept_e = min(n_e, C - min(offset_e, C)).
  * group_sizes = round_up(expert_counts, alignment), sum <= C; the segments hold their real rows
    first, then zero padding rows; nothing past the last segment.
  * dispatch equals the NumPy model (tests/numpy_model.py) bit for bit.
  * combine of identity experts (y = the dispatched rows, dequantised for FP8, upcast when y is
    float32) = the gate-weighted sum of the token over its kept experts, within the rounding of y's
    dtype; tokens whose pairs were all dropped (or never routed) come back as exact zeros.
  * inputs the semantics ignore never leak: NaN / inf in x of tokens that go nowhere, in the weights
    of unused, repeated and dropped slots and in every y row that is not a real row leave every
    output bit-identical and finite.
  * the same jitted call repeated gives the same bits.

Cost: a jitted dispatch (with the layout) and a jitted combine per static configuration. With the
default profile every property runs on every configuration of a fixed pool (POOL: edge cases and a
seeded random draw, its coverage asserted by test_pool_covers_the_space), 8 examples each, derandomised
(the same examples every run, no example database), so the compilations are shared by all the
properties: about 30 s on 2 cores. `make test` runs the edge cases; the random rest of the pool is
marked slow (`make test-all`). ``JAX_EP_FUZZ=thorough`` draws the static configurations too (one
compilation per example, about a second each) with random seeds, JAX_EP_FUZZ_EXAMPLES examples per
property (default 200). A failure prints the example and a @reproduce_failure blob.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import hypothesis
import jax
import numpy as np
import numpy_model as nm
from helpers import (
    assert_bits_equal,
    assert_dispatch_matches,
    make_cfg,
    model_for,
    parametrize_slow_tail,
    per_rank,
    to_numpy,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_ep
from jax_ep.types import DROPPED, EMPTY_ROW, NOT_ROUTED, Handle

EP_SIZES = (1, 2, 4)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
POISON = np.array([np.nan, np.inf, -np.inf], np.float32)
BF16_U = 2.0**-8  # bfloat16: 8 significand bits, relative rounding error <= 2^-8 per rounding

PROFILE = os.environ.get("JAX_EP_FUZZ", "ci")
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("jax_ep_ci", max_examples=8, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("jax_ep_thorough", deadline=None, database=None, print_blob=True,
                          max_examples=int(os.environ.get("JAX_EP_FUZZ_EXAMPLES", "200")),
                          suppress_health_check=_HEALTH)
SETTINGS = settings.get_profile("jax_ep_thorough" if PROFILE == "thorough" else "jax_ep_ci")


# ---- static configurations -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Static:
    """What a compilation depends on."""

    ep: int
    tokens: int                 # T on every rank (0 allowed)
    max_tokens: int
    hidden: int
    topk: int
    experts: int
    capacity: int | None        # None = the worst case
    align: int
    x_dtype: str                # "float32" | "bfloat16"
    dispatch_dtype: str | None  # None | "bfloat16" | "float8_e4m3fn"
    y_dtype: str                # combine's y: the row dtype, float32 for FP8 rows (dequantised)

    @functools.cached_property
    def cfg(self):
        return make_cfg(num_experts=self.experts, num_topk=self.topk, hidden=self.hidden,
                        max_tokens_per_rank=self.max_tokens, capacity=self.capacity,
                        expert_alignment=self.align, dispatch_dtype=self.dispatch_dtype)

    @property
    def local(self) -> int:
        return self.experts // self.ep

    @property
    def row_dtype(self) -> str:
        return self.dispatch_dtype or self.x_dtype

    @property
    def capacity_rows(self) -> int:
        return self.cfg.resolved_capacity(self.ep)


def draw_static(integer, choice) -> Static:
    """A static configuration from integer(lo, hi) (inclusive) and choice(options): hypothesis'
    draws or a seeded generator's (the CI pool)."""
    ep = choice(EP_SIZES)
    experts = ep * integer(1, 4)
    topk = integer(1, min(experts, 5))
    max_tokens = integer(1, 6)
    tokens = {"max": max_tokens, "fewer": integer(0, max_tokens), "none": 0}[
        choice(["max", "max", "max", "fewer", "fewer", "none"])]
    x_dtype = choice(["float32", "bfloat16"])
    dispatch_dtype = choice([None, None, "bfloat16", "float8_e4m3fn"])
    hidden = 128 if dispatch_dtype == "float8_e4m3fn" else 8 * integer(1, 5)
    row_dtype = dispatch_dtype or x_dtype
    y_dtype = {"float32": "float32", "float8_e4m3fn": "float32"}.get(row_dtype) or choice(
        ["bfloat16", "float32"])
    align = choice([1, 2, 4])
    static = Static(ep, tokens, max_tokens, hidden, topk, experts, None, align, x_dtype, dispatch_dtype,
                    y_dtype)
    if choice(["worst case", "smaller"]) == "smaller":  # up to half the worst case: drops
        worst = static.capacity_rows
        static = dataclasses.replace(static, capacity=align * integer(1, max(1, worst // align // 2)))
    return static


def _edge_cases() -> list[Static]:
    s = Static(ep=2, tokens=4, max_tokens=4, hidden=16, topk=2, experts=4, capacity=None, align=1,
               x_dtype="float32", dispatch_dtype=None, y_dtype="float32")
    return [
        s,
        dataclasses.replace(s, tokens=0, max_tokens=3),                            # no tokens at all
        dataclasses.replace(s, ep=4, experts=8, topk=8, tokens=3, capacity=4, align=4),  # K = E, C = align
        dataclasses.replace(s, ep=1, experts=1, topk=1, tokens=5, max_tokens=6, capacity=2, align=2),
        dataclasses.replace(s, ep=4, experts=8, topk=3, hidden=128, x_dtype="bfloat16",
                            dispatch_dtype="float8_e4m3fn", capacity=6, align=2),  # FP8 with drops
        dataclasses.replace(s, ep=4, experts=4, topk=3, tokens=5, max_tokens=5, x_dtype="bfloat16",
                            y_dtype="bfloat16", align=4),                          # K > E_local = 1
        dataclasses.replace(s, x_dtype="float32", dispatch_dtype="bfloat16", y_dtype="float32",
                            capacity=3),                                           # f32 -> bf16 rows
        dataclasses.replace(s, tokens=2, x_dtype="bfloat16", y_dtype="float32", align=2),  # y upcast
    ]


def _pool(size: int, seed: int) -> list[Static]:
    rng = np.random.default_rng(seed)
    pool = _edge_cases()
    while len(pool) < size:
        s = draw_static(lambda lo, hi: int(rng.integers(lo, hi + 1)),
                        lambda options: options[int(rng.integers(len(options)))])
        if s not in pool:
            pool.append(s)
    return pool


POOL_SIZE = 22
POOL = _pool(POOL_SIZE, seed=48)


def test_pool_covers_the_space():
    """The CI pool has every EP size, no tokens, fewer tokens than the maximum, every alignment and
    dispatch dtype, both y dtypes for bf16 rows, small capacities and top-k above E_local."""
    assert {s.ep for s in POOL} == set(EP_SIZES)
    assert any(s.tokens == 0 for s in POOL) and any(0 < s.tokens < s.max_tokens for s in POOL)
    assert {s.align for s in POOL} == {1, 2, 4}
    assert {s.dispatch_dtype for s in POOL} == {None, "bfloat16", "float8_e4m3fn"}
    assert {(s.x_dtype, s.y_dtype) for s in POOL if s.row_dtype == "bfloat16"} >= {
        ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "bfloat16")}
    assert sum(s.capacity is not None for s in POOL) >= 6
    assert any(s.topk > s.local for s in POOL) and any(s.topk == s.experts for s in POOL)


def static_id(s: Static | None) -> str:
    if s is None:
        return "random"
    short = {"float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}
    return (f"R{s.ep}-T{s.tokens}of{s.max_tokens}-H{s.hidden}-K{s.topk}-E{s.experts}-C{s.capacity or 'max'}"
            f"-a{s.align}-{short[s.x_dtype]}to{short[s.row_dtype]}-y{short[s.y_dtype]}")


# default profile: every property on every configuration of the pool; thorough: configurations drawn too.
# `make test` takes the edge cases; the seeded random rest of the pool is marked slow (`make test-all`).
STATICS = parametrize_slow_tail("static", [None] if PROFILE == "thorough" else POOL, ids=static_id,
                                fast=len(_edge_cases()))


@st.composite
def statics(draw, static: Static | None):
    if static is not None:
        return static
    return draw_static(lambda lo, hi: draw(st.integers(lo, hi)), lambda o: draw(st.sampled_from(o)))


# ---- examples --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    static: Static
    x: np.ndarray     # [R, T, H] x_dtype
    idx: np.ndarray   # [R, T, K] int32, raw (unsanitised)
    w: np.ndarray     # [R, T, K] float32 in [0.1, 1.1)
    seed: int

    @functools.cached_property
    def model(self) -> nm.ModelResult:
        return model_for(self.static.cfg, self.x, self.idx, self.w)

    @functools.cached_property
    def sanitized(self) -> np.ndarray:
        return nm.sanitize(self.idx, self.static.experts)

    def __repr__(self):  # what hypothesis prints for a failing example
        return (f"Case({self.static}, seed={self.seed}, idx={self.idx.tolist()})")


REPEAT_PREVIOUS, REPEAT_FIRST = "repeat previous slot", "repeat first slot"


@st.composite
def cases(draw, static: Static | None) -> Case:
    """An example for a static configuration (None: drawn as well)."""
    s = draw(statics(static))
    e = s.experts
    hot = draw(st.integers(0, e - 1))
    slot = st.one_of(
        st.integers(0, e - 1),                          # a valid id
        st.just(hot),                                   # a hot expert: overflows small capacities
        st.just(-1),                                    # unused
        st.sampled_from([e, e + 1, INT32_MAX, -2, -7, INT32_MIN]),  # out of range
        st.sampled_from([REPEAT_PREVIOUS, REPEAT_FIRST]),  # the expert of an earlier slot
    )
    flat = draw(st.lists(slot, min_size=s.ep * s.tokens * s.topk, max_size=s.ep * s.tokens * s.topk))
    idx = np.zeros((s.ep, s.tokens, s.topk), np.int64)
    for i, v in enumerate(flat):
        r, t, k = np.unravel_index(i, idx.shape)
        if v == REPEAT_PREVIOUS:
            v = idx[r, t, k - 1] if k else hot
        elif v == REPEAT_FIRST:
            v = idx[r, t, 0] if k else hot
        idx[r, t, k] = v
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s.ep, s.tokens, s.hidden)).astype(np.float32)
    x *= rng.choice(np.array([1e-3, 1.0, 100.0], np.float32), size=(s.ep, s.tokens, 1))
    x = np.where(x == 0, 1.0, x).astype(np_dtype(s.x_dtype))
    w = (rng.random((s.ep, s.tokens, s.topk)) + 0.1).astype(np.float32)
    return Case(s, x, idx.astype(np.int32), w, seed)


# ---- the compiled ops (cached per static configuration; jit caches the shapes) ---------------------
@functools.cache
def dispatch_fn(ep: int, cfg):
    def f(x, idx, w):
        return jax_ep.dispatch(x, idx, w, cfg), jax_ep.get_dispatch_layout(idx, cfg)

    return per_rank(f, ep)


@functools.cache
def combine_fn(ep: int, cfg):
    def f(y, src_index, token_rows, is_token_in_rank, row_weights):
        return jax_ep.combine(y, Handle(src_index, token_rows, is_token_in_rank, row_weights), cfg)

    return per_rank(f, ep)


def run_dispatch(case: Case, x=None, w=None):
    s = case.static
    return to_numpy(dispatch_fn(s.ep, s.cfg)(case.x if x is None else x, case.idx,
                                             case.w if w is None else w))


def run_combine(case: Case, y, handle):
    s = case.static
    return np.asarray(combine_fn(s.ep, s.cfg)(y, *handle[:4]))   # (an unmasked dispatch: no rank_mask)


def identity_y(case: Case, d) -> np.ndarray:
    """Identity experts: y = the dispatched rows, dequantised (FP8) or cast to y's dtype."""
    s = case.static
    if s.row_dtype == "float8_e4m3fn":
        rows = np.stack([nm.dequantize_fp8(d.x[r], d.scales[r]) for r in range(s.ep)])
    else:
        rows = d.x
    return rows.astype(np_dtype(s.y_dtype))


def token_payload(case: Case) -> np.ndarray:
    """[R, T, H] float64: what a row of each token holds once it is y (dequantised FP8 etc.)."""
    s = case.static
    out = []
    for r in range(s.ep):
        q, scales = nm.payload_of(case.x[r], s.dispatch_dtype)
        v = q.astype(np.float32) if scales is None else nm.dequantize_fp8(q, scales)
        out.append(np.asarray(v).astype(np_dtype(s.y_dtype)))
    return np.stack(out).astype(np.float64).reshape(s.ep, s.tokens, s.hidden)


def np_dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(name))


def round_up(a, m):
    return -(-np.asarray(a) // m) * m


def record(case: Case, d) -> None:
    """What the example exercised (pytest --hypothesis-show-statistics lists these)."""
    s = case.static
    hypothesis.event(f"EP size {s.ep}")
    hypothesis.event(f"rows {s.row_dtype}, y {s.y_dtype}")
    hypothesis.event("no tokens" if s.tokens == 0 else "tokens")
    hypothesis.event("rows dropped" if d.num_dropped.any() else "nothing dropped")
    san = case.sanitized
    hypothesis.event("ids: " + ", ".join(kind for kind, there in [
        ("-1", (case.idx == -1).any()), ("out of range", ((case.idx < -1) | (case.idx >= s.experts)).any()),
        ("repeats", ((san == -1) & (case.idx >= 0) & (case.idx < s.experts)).any())] if there))


# ---- the properties ----------------------------------------------------------------------------------
@STATICS
@SETTINGS
@given(data=st.data())
def test_kept_plus_dropped_equals_routed(static, data):
    case = data.draw(cases(static), label="case")
    s, san = case.static, case.sanitized
    d, lay = run_dispatch(case)
    record(case, d)
    capacity = s.capacity_rows
    local = s.local
    # the layout op counts the pairs of each source rank, before capacity
    np.testing.assert_array_equal(lay.num_tokens_per_expert.sum(axis=0),
                                  np.bincount(san[san >= 0], minlength=s.experts))
    for r in range(s.ep):
        mine = (san >= 0) & (san // local == r)                      # pairs routed to rank r
        routed = np.bincount(san[mine] % local, minlength=local)     # per local expert
        kept, dropped = d.expert_counts[r], int(d.num_dropped[r])
        assert int(kept.sum()) + dropped == int(mine.sum()), (r, kept, dropped, routed)
        # the documented capacity rule, from the routed counts alone
        aligned = round_up(routed, s.align)
        offsets = np.minimum(np.cumsum(aligned) - aligned, capacity)
        np.testing.assert_array_equal(kept, np.minimum(routed, capacity - offsets), f"rank {r} kept")
        assert (dropped > 0) == (aligned.sum() > capacity), (r, routed, capacity)
        if s.capacity is None:
            assert dropped == 0
        # the handle: a distinct row in [0, C) per kept pair, DROPPED per dropped pair, NOT_ROUTED
        # for every pair that is not this rank's
        rows = d.handle.token_rows[r].reshape(s.ep, s.tokens, s.topk)
        assert ((rows >= 0) | (rows == DROPPED) | (rows == NOT_ROUTED)).all()
        np.testing.assert_array_equal(rows == NOT_ROUTED, ~mine, f"rank {r} not routed")
        assert int((rows == DROPPED).sum()) == dropped
        used = rows[rows >= 0]
        assert len(used) == int(kept.sum()) and len(np.unique(used)) == len(used)
        assert (used < capacity).all()


@STATICS
@SETTINGS
@given(data=st.data())
def test_group_sizes_padded_to_alignment(static, data):
    case = data.draw(cases(static), label="case")
    s = case.static
    d, _ = run_dispatch(case)
    capacity = s.capacity_rows
    assert d.x.shape[1] == capacity
    if s.capacity is None:
        assert capacity % s.align == 0
    for r in range(s.ep):
        gs, cnt = d.group_sizes[r], d.expert_counts[r]
        np.testing.assert_array_equal(gs, round_up(cnt, s.align), f"rank {r} group_sizes")
        assert (gs % s.align == 0).all() and int(gs.sum()) <= capacity
        src, weights = d.handle.src_index[r], d.row_weights[r]
        start = 0
        for e in range(s.local):  # real rows first, then zero padding rows
            real = slice(start, start + cnt[e])
            pad = slice(start + cnt[e], start + gs[e])
            assert (src[real] >= 0).all() and (weights[real] > 0).all()
            assert (src[pad] == EMPTY_ROW).all() and (weights[pad] == 0).all()
            assert (d.x[r, pad].astype(np.float32) == 0).all()
            start += gs[e]
        assert (src[start:] == EMPTY_ROW).all() and (weights[start:] == 0).all()


@STATICS
@SETTINGS
@given(data=st.data())
def test_dispatch_matches_numpy_model(static, data):
    case = data.draw(cases(static), label="case")
    d, _ = run_dispatch(case)
    assert_dispatch_matches(d, case.model, case.static.ep)


@STATICS
@SETTINGS
@given(data=st.data())
def test_combine_of_identity_experts_is_weighted_sum(static, data):
    case = data.draw(cases(static), label="case")
    s, m = case.static, case.model
    d, _ = run_dispatch(case)
    out = run_combine(case, identity_y(case, d), d.handle)
    assert out.shape == (s.ep, s.tokens, s.hidden) and out.dtype == identity_y(case, d).dtype
    # sum over the kept experts of w_k * (the same row): payload * (sum of the kept weights)
    kept_weight = np.where(m.kept, case.w.astype(np.float64), 0.0).sum(axis=2)
    want = token_payload(case) * kept_weight[..., None]
    got = out.astype(np.float64)
    if s.y_dtype == "bfloat16":  # the partial sum of each rank rounded to bf16, then their sum
        rtol = 2 * BF16_U * 1.01
    else:
        rtol = (2 * s.topk + s.ep + 2) * 2.0**-24  # one rounding per product and per sum
    bad = ~(np.abs(got - want) <= rtol * np.abs(want))
    if bad.any():
        r, t, h = (int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{bad.sum()} elements off; first rank {r} token {t} channel {h}: got {got[r, t, h]!r} want "
            f"{want[r, t, h]!r} (kept weight {kept_weight[r, t]}, slots {case.sanitized[r, t].tolist()}, "
            f"kept {m.kept[r, t].tolist()})")
    # tokens whose pairs were all dropped or never routed: exact zeros
    nothing = ~m.kept.any(axis=2)
    assert (out[nothing].astype(np.float32) == 0).all()


@STATICS
@SETTINGS
@given(data=st.data())
def test_unused_inputs_never_leak(static, data):
    case = data.draw(cases(static), label="case")
    poison_seed = data.draw(st.integers(0, 2**32 - 1), label="poison seed")
    s, m, san = case.static, case.model, case.sanitized
    rng = np.random.default_rng(poison_seed)
    d, lay = run_dispatch(case)
    y = identity_y(case, d)
    clean = run_combine(case, y, d.handle)

    # x of tokens that go nowhere; weights of unused / repeated / out-of-range and of dropped slots
    nowhere = ~(san >= 0).any(axis=2)
    x = case.x.copy()
    x[nowhere] = rng.choice(POISON, size=(int(nowhere.sum()), s.hidden)).astype(x.dtype)
    w = np.where(m.kept, case.w, rng.choice(POISON, size=case.w.shape)).astype(np.float32)
    d2, lay2 = run_dispatch(case, x=x, w=w)
    for a, b in zip(jax.tree.leaves((d, lay)), jax.tree.leaves((d2, lay2)), strict=True):
        assert_bits_equal(b, a, "dispatch with poisoned unused inputs")
    # every y row that is not a real row (padding, past the last segment)
    real = np.stack([rank.src >= 0 for rank in m.ranks])
    y2 = y.copy()
    y2[~real] = rng.choice(POISON, size=(int((~real).sum()), s.hidden)).astype(y.dtype)
    poisoned = run_combine(case, y2, d.handle)
    assert_bits_equal(poisoned, clean, "combine with poisoned non-rows")
    for name, a in [("rows", d.x), ("scales", d.scales), ("row_weights", d.row_weights),
                    ("combine", clean), ("combine poisoned", poisoned)]:
        if a is not None:
            assert np.isfinite(np.asarray(a).astype(np.float32)).all(), name


@STATICS
@SETTINGS
@given(data=st.data())
def test_repeated_call_same_bits(static, data):
    case = data.draw(cases(static), label="case")
    first = run_dispatch(case)
    y = identity_y(case, first[0])
    first_c = run_combine(case, y, first[0].handle)
    for _ in range(2):
        again = run_dispatch(case)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            assert_bits_equal(b, a, "repeated dispatch")
        assert_bits_equal(run_combine(case, y, again[0].handle), first_c, "repeated combine")
