"""Decoding: the MoE layer's decode path (jax_ep.ll_dispatch / ll_combine) computes the function of its
throughput path (dispatch / combine) within the roundings the low-latency ops add, unfilled slots never
reach the output, decode leaves the layer's state alone; the example LM's key/value cache (prefill, then
one token per step) gives the logits and greedy tokens of the full forward on the growing sequence.

Tolerances, with u = 2^-8 (bfloat16's unit roundoff: round to nearest moves a value by at most u times
its magnitude) and S_t = sum_k |w_k y_k| (token t's gate-weighted expert outputs, float64):

* bf16 experts (``dtype="bfloat16"``, the GPU setting), decode against throughput: both run the same
  bf16 tokens through the same bf16 SwiGLU; they differ in the combine only. The throughput combine
  rounds each rank's partial sum p_r to bf16 and then the sum over ranks (error <= u sum_r |p_r| +
  u |s|), ll_combine rounds the float32 sum once (<= u |s|): |decode - throughput| <= 3 u S_t. We
  allow 4 u S_t (one more bf16 ulp for a GEMM that accumulates in another order). The throughput
  path here takes the gate weights in combine (``EPOptions(gate_weights="combine")``), as ll_combine
  does: the layer's default on the flat exchange scales SwiGLU's rows by them before their bf16
  rounding, a rounding at another place whose error the down GEMM carries, outside this analysis (its
  own tests: tests/test_moe.py, against the dense computation).
* float32 experts (``dtype=None``): the decode path rounds the tokens to bf16 for the wire and the
  expert outputs to bf16 for ll_combine, so it is a different function of x; it equals, within
  u S_t (outputs) + u |s| (the sum) <= 2 u S_t plus float32 noise, the float64 computation of the
  same experts on the bf16-rounded tokens (routing on the float32 tokens, as the layer routes before
  sending).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import parametrize_slow_tail
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from models import LMConfig, MoETransformerLM, shard_model  # examples/models.py

import jax_ep.balancing
import jax_ep.moe
from jax_ep import eplb, gating
from jax_ep.gating import RouterConfig
from jax_ep.moe import EPOptions, MoE

HIDDEN, FFN, EXPERTS, TOPK = 16, 24, 8, 2
U = 2.0 ** -8  # bfloat16 unit roundoff


def make_mesh(shape, axes):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)


def make_layer(mesh, seed=0, ep=None, hidden=HIDDEN, **kw):
    """The gate weights in combine on the throughput path, as decode applies them (module docstring)."""
    ep = {"backend": "reference", "gate_weights": "combine", **(ep or {})}
    return MoE(hidden, FFN, RouterConfig(EXPERTS, TOPK, score_func="sigmoid"), rngs=nnx.Rngs(seed),
               mesh=mesh, ep=EPOptions(**ep), **kw)


def fresh_tokens(rng, batch, seq=1, hidden=HIDDEN):
    """Fresh random decode tokens (one per sequence by default), scaled so that the experts see O(1)."""
    return jnp.asarray(rng.standard_normal((batch, seq, hidden)) * rng.uniform(0.5, 2.0), jnp.float32)


def to_bf16(x):
    """x rounded to bfloat16 (to nearest even), as float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def routed_terms(layer: MoE, x, expert_tokens=None):
    """float64 w_k * y_k [T, K, H] of every token's picks (routing on x, as the layer does; the experts
    on expert_tokens, default x) and the shared expert's output [T, H] (0 without one)."""
    tokens = np.asarray(x, np.float32).reshape(-1, layer.hidden)
    routing = gating.route(jnp.asarray(tokens) @ layer.router[...], layer.routing, layer.expert_bias[...])
    idx, w = np.asarray(routing.topk_idx), np.asarray(routing.topk_weights, np.float64)
    xe = tokens if expert_tokens is None else np.asarray(expert_tokens, np.float32).reshape(tokens.shape)
    xe = xe.astype(np.float64)
    w_gate_up = np.asarray(layer.w_gate_up[...], np.float64)[idx]        # [T, K, H, 2F]
    w_down = np.asarray(layer.w_down[...], np.float64)[idx]              # [T, K, F, H]
    gate, up = np.split(np.einsum("th,tkhf->tkf", xe, w_gate_up), 2, axis=2)
    y = np.einsum("tkf,tkfh->tkh", gate / (1 + np.exp(-gate)) * up, w_down)
    shared = (np.asarray(layer.shared(jnp.asarray(tokens)), np.float64) if layer.shared is not None
              else np.zeros_like(tokens, np.float64))
    return w[:, :, None] * y, shared


def assert_within(got, want, bound, what):
    got, want = np.asarray(got, np.float64).reshape(want.shape), np.asarray(want, np.float64)
    excess = np.abs(got - want) - bound
    assert np.all(np.isfinite(got)), what
    assert excess.max() <= 0, (f"{what}: |got - want| exceeds the bound by {excess.max():.3g} "
                               f"(max |diff| {np.abs(got - want).max():.3g}, max bound {bound.max():.3g})")


# ---------------------------------------------------------------------------------------------------------
# The layer's decode path
# ---------------------------------------------------------------------------------------------------------
CASES = {
    "ep8": dict(shape=(8,), axes=("ep",)),
    "data2_ep4_shared": dict(shape=(2, 4), axes=("data", "ep"), shared_ffn_hidden=8),
    "ep4_fp8": dict(shape=(4,), axes=("ep",), ep=dict(dispatch_dtype="float8_e4m3fn"), hidden=128),
    "ep4_placement": dict(shape=(4,), axes=("ep",), placement=True),
}


@parametrize_slow_tail("case", list(CASES))
def test_decode_matches_throughput_path_bf16_experts(case):
    """dtype=bfloat16: decode (ll_dispatch / ll_combine) vs throughput (dispatch / combine) on the same
    tokens, within 4 u S_t (module docstring). FP8: both paths quantise each token the same way
    (per-token per-128-channel scales) and dequantise it to bf16 before the experts: same bound."""
    spec = dict(CASES[case])
    mesh = make_mesh(spec.pop("shape"), spec.pop("axes"))
    placed = spec.pop("placement", False)
    rng = np.random.default_rng([7, len(case)])
    layer = make_layer(mesh, seed=int(rng.integers(1000)), dtype="bfloat16",
                       placement=eplb.plan_placement(np.r_[20.0, np.ones(EXPERTS - 1)], 4, 3) if placed
                       else None, **spec)
    for batch in (mesh.size, 3 * mesh.size):                 # 1 and 3 tokens per rank
        x = fresh_tokens(rng, batch, hidden=layer.hidden)
        throughput = nnx.jit(lambda m, x: m(x, update_stats=False))(layer, x)
        decoded = nnx.jit(lambda m, x: m(x, decode=True))(layer, x)
        assert decoded.shape == x.shape and decoded.dtype == x.dtype
        terms, _ = routed_terms(layer, to_bf16(x))    # a bf16 layer routes its bf16 tokens
        bound = 4 * U * np.abs(terms).sum(axis=1) + 1e-6
        assert_within(decoded, np.asarray(throughput, np.float64).reshape(bound.shape), bound, case)


@parametrize_slow_tail("shape,axes,shared", [((8,), ("ep",), 0), ((2, 4), ("data", "ep"), 8)])
def test_decode_float32_experts_is_the_bf16_wire_function(shape, axes, shared):
    """dtype=None (a float32 model): the decode path equals, within 2 u S_t, the float64 experts on the
    bf16-rounded tokens; the throughput path stays float32 (its own tests: to 2e-5 of float64)."""
    mesh = make_mesh(shape, axes)
    rng = np.random.default_rng(11)
    layer = make_layer(mesh, seed=3, shared_ffn_hidden=shared)
    x = fresh_tokens(rng, 2 * mesh.size, seq=2)                # [B, S, H] works too
    decoded = nnx.jit(lambda m, x: m(x, decode=True))(layer, x)
    assert decoded.dtype == jnp.float32
    terms, shared_out = routed_terms(layer, x, expert_tokens=to_bf16(x))
    scale = np.abs(terms).sum(axis=1)
    bound = 2 * U * scale + 1e-5 * (scale + np.abs(shared_out) + 1)
    assert_within(decoded, terms.sum(axis=1) + shared_out, bound, "decode, float32 experts")
    # and it is not the float32 function of x: the bf16 wire shows
    exact_terms, _ = routed_terms(layer, x)
    assert np.abs(np.asarray(decoded).reshape(-1, HIDDEN) - exact_terms.sum(1) - shared_out).max() > 1e-6


def test_unfilled_slots_never_reach_the_output(monkeypatch):
    """The CUDA ll_dispatch leaves unfilled slots as they were (NaN possible): the layer zeroes them
    before the expert GEMM and ll_combine reads only filled slots. Poison them with NaN and Inf: the
    output is bit for bit the unpoisoned one."""
    mesh = make_mesh((4,), ("ep",))
    layer = make_layer(mesh, seed=9, dtype="bfloat16")
    x = fresh_tokens(np.random.default_rng(5), 8)
    clean = np.asarray(nnx.jit(lambda m, x: m(x, decode=True))(layer, x))

    real = jax_ep.moe.ll_dispatch
    seen = {}

    def poisoned(x, topk_idx, topk_weights, cfg, rank_mask=None):
        d = real(x, topk_idx, topk_weights, cfg, rank_mask=rank_mask)
        local, slots, _ = d.x.shape
        ranks = d.counts.shape[1]
        filled = (jnp.arange(slots // ranks)[None, None, :] < d.counts[:, :, None]).reshape(local, slots)
        garbage = jnp.where(jnp.arange(d.x.shape[2]) % 2 == 0, jnp.nan, jnp.inf).astype(d.x.dtype)
        seen["unfilled"] = slots * local - jnp.sum(d.counts)
        return d._replace(x=jnp.where(filled[:, :, None], d.x, garbage))

    monkeypatch.setattr(jax_ep.moe, "ll_dispatch", poisoned)
    dirty = np.asarray(nnx.jit(lambda m, x: m(x, decode=True))(layer, x))
    np.testing.assert_array_equal(dirty, clean)
    assert np.all(np.isfinite(dirty))
    assert "unfilled" in seen   # the poisoned op ran (some slots are always unfilled: R*T*E_local > T*K)


def test_decode_state_view_and_gradient():
    """Decode records no statistics unless asked (update_stats=True: the same loads as the throughput
    path, nothing dropped); nnx.view(decode=True) and MoE(decode=True) make decode the default; the
    low-latency ops have no gradient."""
    mesh = make_mesh((4,), ("ep",))
    layer = make_layer(mesh, seed=4, balancing=jax_ep.balancing.BalancingConfig(bias_update_rate=0.1))
    x = fresh_tokens(np.random.default_rng(6), 8)
    stats = lambda: jax.tree.map(np.asarray, nnx.state(layer, nnx.Not(nnx.Param)))  # noqa: E731
    before = stats()
    decoded = nnx.jit(lambda m, x: m(x, decode=True))(layer, x)
    jax.tree.map(np.testing.assert_array_equal, stats(), before)      # bias and loads untouched

    nnx.jit(lambda m, x: m(x, decode=True, update_stats=True))(layer, x)
    decode_load = np.asarray(layer.last_load[...])
    assert decode_load.sum() == x.shape[0] * TOPK and int(layer.last_dropped[...]) == 0
    assert not np.array_equal(np.asarray(layer.expert_bias[...]), before["expert_bias"][...])
    nnx.update(layer, before)
    nnx.jit(lambda m, x: m(x))(layer, x)                                # throughput, default: recorded
    np.testing.assert_array_equal(np.asarray(layer.last_load[...]), decode_load)
    nnx.update(layer, before)

    view = nnx.view(layer, decode=True)
    assert view.decode and not layer.decode
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(view, x)), np.asarray(decoded))
    jax.tree.map(np.testing.assert_array_equal, stats(), before)
    built = make_layer(mesh, seed=4, decode=True)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(built, x)), np.asarray(decoded))
    assert nnx.view(built, decode=False).decode is False

    with pytest.raises(NotImplementedError, match="forward-only"):
        nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, decode=True))))(layer)


def test_call_flags_are_bools_and_a_call_without_statistics_needs_no_whole_sequences():
    """decode= and update_stats= are checked (before 2026-12-05 bool("False") ran the decode path and
    recorded statistics); a call that records nothing computes no aux loss, so it does not ask for whole
    sequences per shard (speculative decoding: 2 sequences x 4 draft tokens on 4 ranks was refused)."""
    from jax_ep.errors import EPTypeError

    mesh = make_mesh((4,), ("ep",))
    layer = make_layer(mesh, seed=3, balancing=jax_ep.balancing.BalancingConfig(aux_loss_alpha=0.01))
    for name in ("decode", "update_stats"):
        with pytest.raises(EPTypeError, match=rf"MoE: {name} must be None or a bool, got 'False' \(str\)"):
            layer(fresh_tokens(np.random.default_rng(1), 8), **{name: "False"})
    # as MoE(decode=...) and EPConfig's flags: a NumPy bool is named, not taken
    with pytest.raises(EPTypeError, match=r"MoE: decode must be None or a bool, got np.True_ \(numpy.bool\)"):
        layer(fresh_tokens(np.random.default_rng(1), 8), decode=np.True_)
    x = fresh_tokens(np.random.default_rng(2), 2, seq=4)          # sequences straddle the 4 ranks
    # jitted: eager calls of the layer compiled each op on its own (about a minute on CI's CPUs)
    run = nnx.jit(lambda m, x, **flags: m(x, **flags), static_argnames=("decode", "update_stats"))
    flat = np.asarray(run(layer, x.reshape(8, HIDDEN), decode=True))
    np.testing.assert_array_equal(np.asarray(run(layer, x, decode=True)).reshape(8, HIDDEN), flat)
    np.testing.assert_array_equal(np.asarray(run(layer, x, update_stats=False)).reshape(8, HIDDEN),
                                  np.asarray(run(layer, x.reshape(8, HIDDEN), update_stats=False)))
    with pytest.raises(ValueError, match="not whole sequences of 4"):   # recording it still asks
        run(layer, x)


def test_decode_inside_user_shard_map():
    """mesh=None: decode on this rank's tokens and expert shard inside the caller's shard_map equals the
    layer with a mesh."""
    mesh = make_mesh((4,), ("ep",))
    x = fresh_tokens(np.random.default_rng(8), 8).reshape(-1, HIDDEN)
    expected = nnx.jit(lambda m, x: m(x, decode=True))(make_layer(mesh, seed=5), x)
    graphdef, params, rest = nnx.split(make_layer(None, seed=5), nnx.Param, ...)
    specs = jax.tree.map(lambda _: P(), params)
    for name in ("w_gate_up", "w_down"):
        specs[name] = P("ep")

    def body(params, x):
        return nnx.merge(graphdef, params, rest)(x, decode=True)

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))(params, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.slow
@parametrize_slow_tail("shape,axes,mask,wire", [
    ((4,), ("ep",), (1, 0, 1, 1), None),
    ((2, 4), ("data", "ep"), (0, 1, 1, 0), None),
    ((4,), ("ep",), (1, 1, 0, 1), "float8_e4m3fn"),
])
def test_decode_with_rank_mask(shape, axes, mask, wire):
    """set_rank_mask on the decode path (ll_dispatch / ll_combine with the mask): a masked rank's
    experts contribute nothing and its own tokens get no routed output; every other token gets exactly
    the unmasked decode of the same layer with the masked ranks' experts zeroed (w_down = 0: their
    rows are +0.0, which ll_combine adds as it adds a masked slot). last_dropped counts the pairs the
    mask sends nowhere (a masked rank's own tokens, and the picks of masked ranks' experts)."""
    mesh = make_mesh(shape, axes)
    ep_size = mesh.shape["ep"]
    rng = np.random.default_rng([21, *mask])
    hidden = 128 if wire else HIDDEN
    layer = make_layer(mesh, seed=int(rng.integers(1000)), hidden=hidden,
                       ep=dict(dispatch_dtype=wire) if wire else None)
    x = fresh_tokens(rng, 3 * mesh.size, hidden=hidden)
    decode = nnx.jit(lambda m, x: m(x, decode=True))
    plain = np.asarray(decode(layer, x))

    active = np.asarray(mask, bool)
    zeroed = nnx.clone(layer)
    experts_on_rank = np.arange(EXPERTS) // (EXPERTS // ep_size)
    zeroed.w_down[...] = jnp.where(jnp.asarray(active[experts_on_rank])[:, None, None],
                                   zeroed.w_down[...], 0.0)
    want = np.array(decode(zeroed, x)).reshape(mesh.size, -1, hidden)    # token shards, rank-major
    shard_rank = np.arange(mesh.size) % ep_size                         # batch axes (data, ep)
    want[~active[shard_rank]] = 0.0                                     # a masked rank's own tokens

    layer.set_rank_mask(mask)
    got = np.asarray(decode(layer, x)).reshape(want.shape)
    assert np.array_equal(got, want), np.abs(got - want).max()
    assert not np.any(got[~active[shard_rank]]) and np.any(got[active[shard_rank]])
    assert not np.array_equal(got.reshape(plain.shape), plain), "the mask changed nothing"

    # what the mask dropped: every pick of a masked rank's tokens, the picks of masked ranks' experts
    tokens = np.asarray(x, np.float32).reshape(mesh.size, -1, hidden)
    routing = gating.route(jnp.asarray(tokens.reshape(-1, hidden)) @ layer.router[...], layer.routing,
                           layer.expert_bias[...])
    idx = np.asarray(routing.topk_idx).reshape(mesh.size, -1, TOPK)
    keep = active[experts_on_rank[idx]] & active[shard_rank][:, None, None]
    nnx.jit(lambda m, x: m(x, decode=True, update_stats=True))(layer, x)
    assert int(layer.last_dropped[...]) == int((~keep).sum()) > 0
    received = np.asarray(layer.last_slot_load[...])   # rows received; last_load: every pick (demand)
    assert received.sum() == keep.sum() and not np.any(received[~active[experts_on_rank]])
    assert int(layer.last_load[...].sum()) == keep.size


# ---------------------------------------------------------------------------------------------------------
# The example LM: key/value cache
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("shape,axes", [((8,), ("ep",)), ((2, 4), ("data", "ep"))])
def test_kv_cache_decode_matches_full_forward(shape, axes):
    """prefill + decode_step (one token per step, attention over the cache) against model(tokens) on
    the growing sequence: with the throughput MoE ops the same logits to float32 rounding and the same
    greedy tokens; with the low-latency ops (the default) logits within the bf16 roundings of the MoE
    layers' wire and outputs (relative ~2^-8 of the MoE output, through the network), teacher-forced
    on the same tokens."""
    mesh = make_mesh(shape, axes)
    cfg = LMConfig(hidden=32, num_heads=2, num_layers=2, ffn_hidden=32, num_experts=16, backend="reference")
    model = MoETransformerLM(cfg, rngs=nnx.Rngs(1), mesh=mesh)
    shard_model(model, mesh)
    batch, prompt_len, steps = 8, 5, 4
    prompts = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab, (batch, prompt_len)), jnp.int32)
    model.init_cache(batch, prompt_len + steps, mesh=mesh)

    full = nnx.jit(lambda m, t: m(t))
    step = nnx.jit(lambda m, t, ll: m.decode_step(t[:, None], low_latency=ll), static_argnums=2)
    prefill_logits = nnx.jit(lambda m, t: m.prefill(t))(model, prompts)
    np.testing.assert_allclose(np.asarray(prefill_logits), np.asarray(full(model, prompts)), rtol=1e-5,
                               atol=1e-5)
    assert int(model.blocks[0].attn.cache_index[...]) == prompt_len

    seq, token, agree = prompts, jnp.argmax(prefill_logits[:, -1], -1), []
    for _ in range(steps):
        seq = jnp.concatenate([seq, token[:, None]], axis=1)
        want = np.asarray(full(model, seq)[:, -1])
        graphdef, state = nnx.split(model)
        twin = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))   # one step on each path from
        #                                                                  the same cache
        low_latency = np.asarray(step(twin, token, True)[:, 0])
        exact = np.asarray(step(model, token, False)[:, 0])
        np.testing.assert_allclose(exact, want, rtol=1e-5, atol=1e-5)
        scale = np.abs(want).max()
        np.testing.assert_allclose(low_latency, want, rtol=0, atol=1e-2 * scale)
        assert np.abs(low_latency - want).max() > 0        # the low-latency ops ran (bf16 roundings)
        agree.append(np.argmax(low_latency, -1) == np.argmax(want, -1))
        token = jnp.argmax(exact, -1)
        np.testing.assert_array_equal(np.asarray(token), np.argmax(want, -1))
    assert int(model.blocks[0].attn.cache_index[...]) == prompt_len + steps
    assert np.mean(agree) >= 0.9, np.mean(agree)
    with pytest.raises(ValueError, match="does not fit the cache"):
        model.prefill(jnp.zeros((batch, prompt_len + steps + 1), jnp.int32))


def test_decode_step_without_a_cache_says_so():
    """decode_step before init_cache names the missing cache, as prefill does (before 2026-12-06:
    "'NoneType' object is not subscriptable"; found by a review), and init_cache takes no dtype (a cache
    of any other dtype than the attention's float32 failed at the first decode step)."""
    cfg = LMConfig(hidden=16, num_heads=2, num_layers=1, ffn_hidden=16, num_experts=4, backend="reference")
    model = MoETransformerLM(cfg, rngs=nnx.Rngs(1), mesh=make_mesh((2,), ("ep",)))
    x = jnp.asarray(np.random.default_rng().standard_normal((2, 1, cfg.hidden)), jnp.float32)
    with pytest.raises(ValueError, match="decode_step: the key/value cache is not initialised; call "
                                         "init_cache first"):
        model.blocks[0].decode_step(x)
    with pytest.raises(TypeError, match="dtype"):
        model.init_cache(2, 4, dtype=jnp.bfloat16)


def test_decode_step_past_the_cache_gives_nan():
    """A decode step past init_cache's max_length gives NaN logits (before 2026-12-05 Flax overwrote the
    cache's last position: wrong logits, no word); the last step that fits is finite."""
    mesh = make_mesh((2,), ("ep",))
    cfg = LMConfig(hidden=16, num_heads=2, num_layers=1, ffn_hidden=16, num_experts=4, backend="reference")
    model = MoETransformerLM(cfg, rngs=nnx.Rngs(1), mesh=mesh)
    shard_model(model, mesh)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab, (2, 3)), jnp.int32)
    model.init_cache(2, 4, mesh=mesh)
    nnx.jit(lambda m, t: m.prefill(t))(model, prompts)
    step = nnx.jit(lambda m, t: m.decode_step(t[:, None], low_latency=False))
    assert np.isfinite(np.asarray(step(model, prompts[:, 0]))).all()     # position 3: the last one
    assert np.isnan(np.asarray(step(model, prompts[:, 1]))).all()        # position 4: past the cache


def random_counts(seed):
    """(counts [local, R], R, T_max, k) that a real low-latency dispatch can give, of random sizes: each
    source token fills at most min(k, local) of these experts."""
    rng = np.random.default_rng(seed)
    local, ep_size, t_max = int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
    k = int(rng.integers(1, local + 2))
    picks = np.zeros((local, ep_size), np.int32)
    for r in range(ep_size):
        for _ in range(int(rng.integers(0, t_max + 1))):
            experts = rng.choice(local, size=int(rng.integers(0, min(k, local) + 1)), replace=False)
            picks[experts, r] += 1
    return picks, ep_size, t_max, k


@pytest.mark.parametrize("seed", range(4))
def test_filled_slots_gathers_every_filled_slot_grouped_by_expert(seed):
    """The decode path computes only the filled slots: filled_slots lists each exactly once, in (expert,
    source rank, position) order, so that counts.sum(1) are the grouped GEMM's group sizes."""
    picks, ep_size, t_max, k = random_counts(seed)
    local = picks.shape[0]
    slot, filled = jax.jit(jax_ep.moe.filled_slots, static_argnums=(1, 2))(
        jnp.asarray(picks), ep_size * t_max, min(k, local))
    slot, filled = np.asarray(slot), np.asarray(filled)
    want = [e * ep_size * t_max + r * t_max + i
            for e in range(local) for r in range(ep_size) for i in range(picks[e, r])]
    assert slot.shape == (min(local * ep_size * t_max, ep_size * t_max * min(k, local)),)
    assert filled.sum() == len(want) and not filled[len(want):].any()
    np.testing.assert_array_equal(slot[:len(want)], want)
    np.testing.assert_array_equal(slot[len(want):], 0)


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3fn"])
def test_decode_with_fp8_weights_matches_the_throughput_path(wire, monkeypatch):
    """layer(x, decode=True, fp8_weights=...) runs the decode experts in FP8 from the cached weights:
    each (token, expert) row is quantised and multiplied as on the throughput path with the same weights,
    so the two paths agree within 4 u S_t (the combines' orders); without them decode stays bf16 (and
    differs). With an FP8 wire both paths give the gate|up GEMM the wire's e4m3 rows as they came."""
    mesh = make_mesh((4,), ("ep",))
    hidden = ffn = 128
    ep = EPOptions(backend="reference", dispatch_dtype=wire, gate_weights="combine")  # as decode: docstring
    layer = MoE(hidden, ffn, RouterConfig(EXPERTS, TOPK, score_func="sigmoid"), rngs=nnx.Rngs(6), mesh=mesh,
                ep=ep, dtype="bfloat16", gemm_dtype="float8_e4m3fn")
    fp8 = nnx.jit(lambda m: m.quantize_weights())(layer)
    rng = np.random.default_rng(8)
    for batch in (mesh.size, 3 * mesh.size):
        x = fresh_tokens(rng, batch, hidden=hidden)
        throughput = nnx.jit(lambda m, x, q: m(x, update_stats=False, fp8_weights=q))(layer, x, fp8)
        decoded = nnx.jit(lambda m, x, q: m(x, decode=True, fp8_weights=q))(layer, x, fp8)
        bf16 = nnx.jit(lambda m, x: m(x, decode=True))(layer, x)
        terms, _ = routed_terms(layer, to_bf16(x))
        bound = 4 * U * np.abs(terms).sum(axis=1) + 1e-6
        assert_within(decoded, np.asarray(throughput, np.float64).reshape(bound.shape), bound, "fp8 decode")
        # FP8's error (e4m3: 3 mantissa bits) is far above the bound: the bf16 decode is another function
        assert np.abs(np.asarray(bf16, np.float64) - np.asarray(decoded, np.float64)).max() > bound.max()
    # the rows the GEMMs quantise themselves: both GEMMs' with a bf16 wire, only the down GEMM's (the
    # activations) with an FP8 wire, whose rows go into the gate|up GEMM as they came
    from jax_ep import gemm_fp8
    quantised = []
    real = gemm_fp8.quantize_gemm_rows
    monkeypatch.setattr(gemm_fp8, "quantize_gemm_rows", lambda x: quantised.append(x.shape) or real(x))
    for decode in (True, False):
        nnx.jit(lambda m, x, q, d=decode: m(x, decode=d, update_stats=False, fp8_weights=q))(layer, x, fp8)
    assert len(quantised) == (2 if wire == "float8_e4m3fn" else 4), quantised
