"""The Flax MoE layer: equals a dense single-device computation, from jit and from inside shard_map,
on 1-D and 2-D (data x ep) meshes, with gradients; trains with falling loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ep import gating
from jax_ep.models import LMConfig, MoETransformerLM, next_token_loss
from jax_ep.moe import MoE

HIDDEN, FFN, EXPERTS, TOPK = 16, 24, 8, 2


def dense_moe(layer: MoE, x):
    """The same layer without EP: every token runs its chosen experts on one device."""
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ layer.router[...]
    rcfg = gating.RouterConfig(EXPERTS, TOPK, **layer.router_options)
    routing = gating.route(logits, rcfg, layer.expert_bias[...])
    gate = jnp.einsum("th,ehf->tef", tokens, layer.w_gate[...])
    up = jnp.einsum("th,ehf->tef", tokens, layer.w_up[...])
    y = jnp.einsum("tef,efh->teh", jax.nn.silu(gate) * up, layer.w_down[...])    # [T, E, H]
    picked = jnp.take_along_axis(y, routing.topk_idx[:, :, None], axis=1)      # [T, K, H]
    out = jnp.sum(picked * routing.topk_weights[:, :, None], axis=1)
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.reshape(x.shape)


def make_layer(mesh, seed=0, **kw):
    return MoE(HIDDEN, FFN, EXPERTS, TOPK, rngs=nnx.Rngs(seed), mesh=mesh, backend="reference", **kw)


def random_tokens(seed, batch=8, seq=4):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, seq, HIDDEN)), jnp.float32)


@pytest.mark.parametrize("shape,axes", [((4,), ("ep",)), ((8,), ("ep",)), ((2, 4), ("data", "ep"))])
@pytest.mark.parametrize("shared", [0, 8])
def test_layer_matches_dense(shape, axes, shared):
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)
    layer = make_layer(mesh, shared_ffn_hidden=shared, score_func="sigmoid", num_groups=4, topk_groups=2)
    x = random_tokens(1)
    out = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_moe(layer, x)), rtol=2e-5, atol=2e-5)
    assert int(layer.last_load[...].sum()) == x.shape[0] * x.shape[1] * TOPK
    assert int(layer.last_dropped[...]) == 0


@pytest.mark.parametrize("shape,axes", [((4,), ("ep",)), ((2, 4), ("data", "ep"))])
def test_gradients_match_dense(shape, axes):
    """Expert weights are sharded over ep and replicated over data: their gradients (and the router's)
    must equal the single-device gradients."""
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)
    layer = make_layer(mesh, seed=3)
    x = random_tokens(2)
    target = random_tokens(3)

    def loss_ep(m):
        return jnp.mean((m(x) - target) ** 2)

    def loss_dense(m):
        return jnp.mean((dense_moe(m, x) - target) ** 2)

    g_ep = nnx.jit(nnx.grad(loss_ep))(layer)
    g_dense = nnx.grad(loss_dense)(layer)
    for name in ("router", "w_gate", "w_up", "w_down"):
        a, b = np.asarray(g_ep[name][...]), np.asarray(g_dense[name][...])
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


def test_inside_user_shard_map():
    """mesh=None: the layer runs on this rank's tokens and expert shard inside the caller's shard_map."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    global_layer = make_layer(mesh, seed=5)
    per_rank_layer = make_layer(None, seed=5)
    x = random_tokens(4).reshape(-1, HIDDEN)
    graphdef, params, rest = nnx.split(per_rank_layer, nnx.Param, ...)
    specs = jax.tree.map(lambda _: P(), params)
    for name in ("w_gate", "w_up", "w_down"):
        specs[name] = P("ep")

    def body(params, x):
        layer = nnx.merge(graphdef, params, rest)
        return layer(x, update_stats=False)

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))(params, x)
    expected = nnx.jit(lambda m, x: m(x))(global_layer, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_wrong_expert_shard_inside_shard_map_is_an_error():
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    layer = make_layer(None)
    graphdef, state = nnx.split(layer)
    x = random_tokens(6).reshape(-1, HIDDEN)

    def body(state, x):  # experts not sharded: every rank sees all 8
        return nnx.merge(graphdef, state)(x, update_stats=False)

    with pytest.raises(ValueError, match="holds 8 experts"):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("ep")), out_specs=P("ep")))(state, x)


def test_bias_balancing_and_aux_loss_state():
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    layer = make_layer(mesh, bias_update_rate=0.01, aux_loss_alpha=0.1)
    x = random_tokens(7)
    nnx.jit(lambda m, x: m(x))(layer, x)
    load = np.asarray(layer.last_load[...])
    bias = np.asarray(layer.expert_bias[...])
    np.testing.assert_allclose(bias, 0.01 * np.sign(load.mean() - load))
    assert float(layer.aux_loss) > 0
    np.testing.assert_allclose(np.asarray(layer.total_load[...]), load)


def test_tiny_lm_trains():
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    cfg = LMConfig(hidden=32, num_heads=2, num_layers=1, ffn_hidden=32, num_experts=8, backend="reference")
    model = MoETransformerLM(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 16, (8, 17)), jnp.int32)  # 16 symbols

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, batch)) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses
