"""Load balancing helpers (jax_ep.balancing) against hand computations and NumPy references."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_ep.balancing import (
    BalancingConfig,
    expert_counts,
    gather_expert_counts,
    imbalance,
    sequence_aux_loss,
    update_bias,
)
from jax_ep.errors import EPValueError
from jax_ep.gating import RouterConfig, route


def random_topk(rng, shape, num_experts, num_topk, unused_fraction=0.0):
    """Distinct experts per token, some slots -1."""
    idx = np.argsort(rng.random(shape + (num_experts,)), axis=-1)[..., :num_topk]
    idx = np.where(rng.random(idx.shape) < unused_fraction, -1, idx)
    return idx.astype(np.int32)


# ---------------------------------------------------------------------------------------------------------
# Counts and statistics
# ---------------------------------------------------------------------------------------------------------
def test_expert_counts_matches_bincount_and_skips_unused_and_padding():
    rng = np.random.default_rng(0)
    idx = random_topk(rng, (3, 20), 10, 4, unused_fraction=0.2)
    mask = rng.random((3, 20)) < 0.7
    counts = jax.jit(expert_counts, static_argnums=1)(jnp.asarray(idx), 10, token_mask=jnp.asarray(mask))
    valid = idx[mask]
    np.testing.assert_array_equal(counts, np.bincount(valid[valid >= 0], minlength=10))
    assert counts.dtype == jnp.int32
    unmasked = expert_counts(jnp.asarray(idx), 10)
    np.testing.assert_array_equal(unmasked, np.bincount(idx[idx >= 0], minlength=10))


def test_expert_counts_sums_over_an_axis():
    rng = np.random.default_rng(1)
    idx = random_topk(rng, (4, 16), 8, 2)           # 4 "ranks" of 16 tokens
    per_rank = jax.vmap(functools.partial(expert_counts, num_experts=8, axis_name="ep"), axis_name="ep")
    out = per_rank(jnp.asarray(idx))
    for rank in range(4):
        np.testing.assert_array_equal(out[rank], np.bincount(idx.reshape(-1), minlength=8))


def test_gather_expert_counts_puts_local_experts_in_global_order():
    # 4 ranks, E_local = 3
    local = jnp.asarray(np.random.default_rng(2).integers(0, 50, size=(4, 3)), jnp.int32)
    out = jax.vmap(lambda c: gather_expert_counts(c, "ep"), axis_name="ep")(local)
    for rank in range(4):
        np.testing.assert_array_equal(out[rank], np.asarray(local).reshape(-1))


def test_imbalance_is_max_over_mean_and_guards_empty():
    assert float(imbalance(jnp.array([1.0, 1.0, 1.0, 1.0]))) == 1.0
    assert float(imbalance(jnp.array([4, 0, 0, 0], jnp.int32))) == 4.0
    assert float(imbalance(jnp.zeros(6))) == 1.0
    rng = np.random.default_rng(3)
    loads = rng.integers(0, 100, size=(5, 7)).astype(np.float32)
    np.testing.assert_allclose(imbalance(jnp.asarray(loads)), loads.max(-1) / loads.mean(-1), rtol=1e-6)


def test_balancing_config_validates():
    assert BalancingConfig() == BalancingConfig(0.0, 0) and hash(BalancingConfig(1e-3, 1e-4))
    for field, bad in (("bias_update_rate", -1e-3), ("aux_loss_alpha", float("nan")),
                       ("bias_update_rate", True), ("aux_loss_alpha", "0.1"), ("bias_update_rate", None)):
        with pytest.raises(ValueError, match=f"BalancingConfig.{field} must be a finite number >= 0"):
            BalancingConfig(**{field: bad})


# ---------------------------------------------------------------------------------------------------------
# Aux-loss-free bias
# ---------------------------------------------------------------------------------------------------------
def test_update_bias_direction():
    rng = np.random.default_rng(5)
    bias = jnp.asarray(rng.normal(size=6), jnp.float32)
    load = jnp.array([10, 30, 20, 20, 0, 40], jnp.int32)      # mean 20
    new = update_bias(bias, load, 0.01)
    np.testing.assert_allclose(np.asarray(new) - np.asarray(bias), [0.01, -0.01, 0, 0, 0.01, -0.01],
                               atol=1e-7)
    assert new.dtype == jnp.float32
    with pytest.raises(ValueError, match="must be the same"):
        update_bias(bias, jnp.ones(5), 0.01)
    # experts out of reach (a masked rank's) keep their bias and stay out of the mean (active mean 25)
    active = jnp.array([True, True, True, True, False, True])
    new = update_bias(bias, load, 0.01, active)
    np.testing.assert_allclose(np.asarray(new) - np.asarray(bias), [0.01, -0.01, 0.01, 0.01, 0, -0.01],
                               atol=1e-7)


def test_rates_given_as_numbers_are_checked():
    """update_bias's rate and the aux loss's alpha, as numbers, are finite and >= 0 as BalancingConfig's
    (a NaN rate made every bias NaN, then every token picked experts 0 and 1; a negative one reversed the
    balancing; a NaN alpha made the loss NaN; found by a fuzzer, 2026-12-06). A traced rate is taken."""
    rng = np.random.default_rng()
    bias = jnp.asarray(rng.normal(size=4), jnp.float32)
    load = jnp.array([10, 0, 5, 5], jnp.int32)
    for bad in (float("nan"), -0.1, np.float32("inf"), True):
        with pytest.raises(EPValueError, match=rf"update_bias: rate must be a finite number >= 0, got "
                                               rf"{re.escape(repr(bad))}"):
            update_bias(bias, load, bad)
    scores = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32))
    idx = jnp.asarray(rng.integers(0, 4, size=(2, 3, 1)), jnp.int32)
    with pytest.raises(EPValueError, match=r"sequence_aux_loss: alpha must be a finite number >= 0, got nan"):
        sequence_aux_loss(scores, idx, 4, float("nan"))
    stepped = jax.jit(update_bias)(bias, load, jnp.float32(0.25))
    np.testing.assert_allclose(np.asarray(stepped - bias), [-0.25, 0.25, 0.0, 0.0], atol=1e-6)
    np.testing.assert_array_equal(update_bias(bias, load, np.asarray(0.25)), stepped)   # a NumPy array


def test_bias_updates_balance_a_skewed_router():
    """Closed loop: route with the bias, count, update. The popular experts lose their pull."""
    rng = np.random.default_rng(6)
    cfg = RouterConfig(num_experts=8, num_topk=2, score_func="sigmoid")
    skew = jnp.linspace(1.5, -1.5, 8)                       # expert 0 popular, expert 7 shunned
    logits = jnp.asarray(rng.normal(size=(40, 256, 8)), jnp.float32) + skew

    @jax.jit
    def run(bias):
        def step(bias, batch):
            counts = expert_counts(route(batch, cfg, bias).topk_idx, 8)
            return update_bias(bias, counts, 0.02), imbalance(counts)
        return jax.lax.scan(step, bias, logits)

    final_bias, history = run(jnp.zeros(8, jnp.float32))
    assert float(history[0]) > 2.0
    assert float(history[-10:].mean()) < 1.5           # started near 3
    assert np.all(np.diff(np.asarray(final_bias)) > 0)     # bias rises toward the shunned experts


# ---------------------------------------------------------------------------------------------------------
# Sequence-wise aux loss
# ---------------------------------------------------------------------------------------------------------
def np_sequence_aux_loss(scores, idx, num_experts, alpha, mask=None):
    losses = []
    for b in range(scores.shape[0]):
        keep = np.ones(scores.shape[1], bool) if mask is None else mask[b]
        num_tokens = max(keep.sum(), 1)
        chosen = np.zeros(num_experts)
        for t in np.flatnonzero(keep):
            for e in set(idx[b, t].tolist()) - {-1}:
                chosen[e] += 1
        f = num_experts / (idx.shape[-1] * num_tokens) * chosen
        p = (scores[b, keep] / scores[b, keep].sum(-1, keepdims=True)).sum(0) / num_tokens
        if keep.any():   # a sequence of padding only counts in no statistic
            losses.append(alpha * (f * p).sum())
    return np.mean(losses) if losses else 0.0


def test_aux_loss_hand_computed():
    # One sequence, T=2 tokens, E=4, K=1. Token 0 -> expert 0, token 1 -> expert 0.
    scores = jnp.array([[0.4, 0.2, 0.2, 0.2], [0.1, 0.3, 0.3, 0.3]])  # rows already sum to 1
    idx = jnp.array([[0], [0]], jnp.int32)
    # f = [4/(1*2)*2, 0, 0, 0] = [4, 0, 0, 0]; P_0 = (0.4 + 0.1)/2 = 0.25; L = alpha * 4 * 0.25 = alpha
    np.testing.assert_allclose(sequence_aux_loss(scores, idx, 4, alpha=0.5), 0.5, rtol=1e-6)
    # Unnormalised sigmoid-like scores are normalised per token first: same loss.
    np.testing.assert_allclose(sequence_aux_loss(3 * scores, idx, 4, alpha=0.5), 0.5, rtol=1e-6)
    # Balanced choice with uniform scores gives exactly alpha.
    balanced = sequence_aux_loss(jnp.full((4, 4), 0.25), jnp.array([[0], [1], [2], [3]]), 4, alpha=0.1)
    np.testing.assert_allclose(balanced, 0.1, rtol=1e-6)


def test_aux_loss_matches_reference_with_batch_mask_and_unused_slots():
    rng = np.random.default_rng(7)
    scores = rng.random((3, 12, 8)).astype(np.float32) + 0.05
    idx = random_topk(rng, (3, 12), 8, 3, unused_fraction=0.15)
    mask = rng.random((3, 12)) < 0.8
    mask[2] = False                                          # an all-padding sequence contributes 0
    got = jax.jit(sequence_aux_loss, static_argnums=(2, 3))(jnp.asarray(scores), jnp.asarray(idx), 8, 1e-2,
                                                            token_mask=jnp.asarray(mask))
    np.testing.assert_allclose(got, np_sequence_aux_loss(scores, idx, 8, 1e-2, mask), rtol=1e-5)
    flat = sequence_aux_loss(jnp.asarray(scores).reshape(36, 8), jnp.asarray(idx).reshape(36, 3), 8, 1e-2,
                             token_mask=jnp.asarray(mask).reshape(36), sequence_length=12)
    np.testing.assert_allclose(flat, got, rtol=1e-6)


def test_aux_loss_gradient_reaches_scores():
    rng = np.random.default_rng(8)
    scores = jnp.asarray(rng.random((2, 6, 5)) + 0.1, jnp.float32)
    idx = jnp.asarray(random_topk(rng, (2, 6), 5, 2))
    loss = lambda s: sequence_aux_loss(s, idx, 5, 1.0)
    check_grads(loss, (scores,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    assert np.abs(np.asarray(jax.grad(loss)(scores))).sum() > 0


def test_aux_loss_errors():
    with pytest.raises(ValueError, match="scores.shape\\[-1\\]=4 does not match num_experts=5"):
        sequence_aux_loss(jnp.ones((3, 4)), jnp.zeros((3, 1), jnp.int32), 5, 1.0)
    with pytest.raises(ValueError, match="sequence_length=4"):
        sequence_aux_loss(jnp.ones((6, 4)), jnp.zeros((6, 1), jnp.int32), 4, 1.0, sequence_length=4)
    with pytest.raises(ValueError, match="must agree on the token axes"):
        sequence_aux_loss(jnp.ones((6, 4)), jnp.zeros((5, 1), jnp.int32), 4, 1.0)
    for bad in (0, -5, 2.0, True):
        with pytest.raises(ValueError, match=f"sequence_length must be None or a positive int, got {bad!r}"):
            sequence_aux_loss(jnp.ones((6, 4)), jnp.zeros((6, 1), jnp.int32), 4, 1.0, sequence_length=bad)


def test_sequences_of_padding_only_leave_the_aux_loss_unchanged():
    """A sequence with no real token counted as a sequence of loss 0: padding a batch with empty
    sequences scaled the loss and its gradient down by real / all (docs/api.md: padding counts in no
    statistic)."""
    rng = np.random.default_rng(31)
    scores = jax.nn.softmax(jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32))
    idx = jax.lax.top_k(scores, 2)[1]
    mask = jnp.asarray(rng.random((4, 6)) < 0.7).at[:, 0].set(True)
    real = sequence_aux_loss(scores, idx, 8, 1e-2, token_mask=mask)
    padded = sequence_aux_loss(jnp.concatenate([scores, scores]), jnp.concatenate([idx, idx]), 8, 1e-2,
                               token_mask=jnp.concatenate([mask, jnp.zeros_like(mask)]))
    np.testing.assert_allclose(padded, real, rtol=1e-6)
    np.testing.assert_allclose(real, np_sequence_aux_loss(np.asarray(scores), np.asarray(idx), 8, 1e-2,
                                                          np.asarray(mask)), rtol=1e-5)
    assert float(sequence_aux_loss(scores, idx, 8, 1e-2, token_mask=jnp.zeros_like(mask))) == 0.0


def test_nan_in_padding_tokens_leaves_the_aux_loss_and_its_gradient_finite():
    """Padding is in no statistic: NaN scores in padding tokens (uninitialised rows) made the loss NaN,
    NaN * 0 in the masked mean, and the gradient NaN (found by a review, 2026-12-05). Same loss and
    gradient as with finite padding."""
    rng = np.random.default_rng()
    scores = jax.nn.softmax(jnp.asarray(rng.standard_normal((3, 7, 8)), jnp.float32))
    idx = jax.lax.top_k(scores, 2)[1]
    mask = jnp.asarray(rng.random((3, 7)) < 0.6).at[:, 0].set(True).at[:, -1].set(False)
    poisoned = jnp.where(mask[..., None], scores, jnp.nan)
    loss = lambda s: sequence_aux_loss(s, idx, 8, 1e-2, token_mask=mask)   # noqa: E731
    np.testing.assert_allclose(loss(poisoned), loss(scores), rtol=1e-6)
    g_poisoned, g = np.asarray(jax.grad(loss)(poisoned)), np.asarray(jax.grad(loss)(scores))
    assert np.isfinite(g_poisoned).all()
    np.testing.assert_allclose(g_poisoned, g, rtol=1e-6, atol=1e-9)
    assert (g[~np.asarray(mask)] == 0).all() and np.abs(g).sum() > 0


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_a_token_mask_that_is_not_bool_is_refused_naming_it(dtype):
    """An int mask [2, 1, 0] was and-ed bit by bit with the slots' validity (it counted the last token
    only); a float mask failed in JAX's bitwise_and naming no argument."""
    idx = jnp.zeros((3, 1), jnp.int32)
    mask = jnp.asarray([2, 1, 0], dtype)
    with pytest.raises(EPValueError, match=f"token_mask must be bool .*got {jnp.dtype(dtype)}"):
        expert_counts(idx, 4, token_mask=mask)
    with pytest.raises(EPValueError, match=f"token_mask must be bool .*got {jnp.dtype(dtype)}"):
        sequence_aux_loss(jnp.ones((3, 4)), idx, 4, 1.0, token_mask=mask)


def test_balancing_config_takes_numpy_scalars():
    """np.float32(1e-3) was refused as 'not a finite number'; every real number is stored as a float."""
    config = BalancingConfig(bias_update_rate=np.float32(1e-3), aux_loss_alpha=np.int64(0))
    assert type(config.bias_update_rate) is float and config.aux_loss_alpha == 0.0
    assert config == BalancingConfig(bias_update_rate=float(np.float32(1e-3)))
    for bad in (np.bool_(True), np.float32("nan"), -1):
        with pytest.raises(EPValueError, match="bias_update_rate must be a finite number >= 0"):
            BalancingConfig(bias_update_rate=bad)
