"""Routing (jax_ep.gating) against small NumPy references on random inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import parametrize_slow_tail
from jax.test_util import check_grads

from jax_ep.gating import RouterConfig, Routing, expert_to_rank, route

route_jit = jax.jit(route, static_argnums=1)


# ---------------------------------------------------------------------------------------------------------
# NumPy reference (independent re-statement of the documented rule, per token)
# ---------------------------------------------------------------------------------------------------------
def np_scores(logits, score_func):
    logits = logits.astype(np.float64)
    if score_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-logits))


def top_indices(values, n):
    """Indices of the n largest values, best first, lower index on ties (as lax.top_k)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:n]


def ref_num_nodes(cfg):
    return 1 if cfg.ranks_per_node is None else max(1, cfg.ep_size // cfg.ranks_per_node)


def ref_allowed_experts(selection, cfg):
    """The set of experts one token may choose from: coarsest limit first, then the finer ones."""
    allowed = set(range(cfg.num_experts))
    stages = []
    if cfg.groups_per_token < cfg.num_groups:
        per_group = cfg.num_experts // cfg.num_groups
        stages.append((per_group, cfg.groups_per_token, min(2 if cfg.group_score == "top2_sum" else 1,
                                                            per_group)))
    num_nodes = ref_num_nodes(cfg)
    if cfg.max_nodes_per_token is not None and cfg.max_nodes_per_token < num_nodes:
        per_node = cfg.num_experts // num_nodes
        topn = min(-(-cfg.num_topk // cfg.max_nodes_per_token), per_node)
        stages.append((per_node, cfg.max_nodes_per_token, topn))
    if cfg.max_ranks_per_token is not None and cfg.max_ranks_per_token < cfg.ep_size:
        per_rank = cfg.num_experts // cfg.ep_size
        topn = min(-(-cfg.num_topk // cfg.max_ranks_per_token), per_rank)
        stages.append((per_rank, cfg.max_ranks_per_token, topn))
    for unit_size, keep, topn in sorted(stages, key=lambda s: -s[0]):
        unit_scores = []
        for u in range(cfg.num_experts // unit_size):
            members = range(u * unit_size, (u + 1) * unit_size)
            vals = sorted((selection[e] if e in allowed else -np.inf for e in members), reverse=True)
            unit_scores.append(np.float32(sum(np.float32(v) for v in vals[:topn])))
        kept = top_indices(unit_scores, keep)
        allowed &= {e for u in kept for e in range(u * unit_size, (u + 1) * unit_size)}
    return allowed


def ref_route(scores, cfg, bias=None):
    """Reference selection + weights, given the (float32) scores route() returned."""
    num_tokens = scores.shape[0]
    idx = np.zeros((num_tokens, cfg.num_topk), np.int64)
    weights = np.zeros((num_tokens, cfg.num_topk), np.float64)
    for t in range(num_tokens):
        selection = scores[t] + (0 if bias is None else bias)
        allowed = ref_allowed_experts(selection, cfg)
        masked = [selection[e] if e in allowed else -np.inf for e in range(cfg.num_experts)]
        idx[t] = top_indices(masked, cfg.num_topk)
        w = scores[t, idx[t]].astype(np.float64)
        if cfg.normalize_topk:
            w = w / w.sum()
        weights[t] = w * cfg.routed_scaling_factor
    return idx, weights


def random_logits(rng, num_tokens, num_experts, scale=2.0):
    return jnp.asarray(rng.normal(scale=scale, size=(num_tokens, num_experts)), jnp.float32)


def check_against_reference(logits, cfg, bias=None):
    out = route_jit(logits, cfg, bias)
    assert isinstance(out, Routing)
    assert out.topk_idx.dtype == jnp.int32 and out.topk_weights.dtype == jnp.float32
    assert out.scores.dtype == jnp.float32
    np.testing.assert_allclose(out.scores, np_scores(np.asarray(logits), cfg.score_func),
                               rtol=1e-5, atol=1e-7)
    ref_idx, ref_w = ref_route(np.asarray(out.scores), cfg, None if bias is None else np.asarray(bias))
    np.testing.assert_array_equal(out.topk_idx, ref_idx)
    np.testing.assert_allclose(out.topk_weights, ref_w, rtol=1e-5, atol=1e-7)
    return out


# ---------------------------------------------------------------------------------------------------------
# Scores, normalisation, scaling
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_plain_topk_matches_reference(score_func, normalize):
    rng = np.random.default_rng(10 + 2 * normalize + (score_func == "sigmoid"))
    cfg = RouterConfig(num_experts=12, num_topk=3, score_func=score_func, normalize_topk=normalize,
                       routed_scaling_factor=2.5)
    out = check_against_reference(random_logits(rng, 33, 12), cfg)
    sums = np.asarray(out.topk_weights).sum(-1)
    if normalize:
        np.testing.assert_allclose(sums, 2.5, rtol=1e-5)
    else:
        assert np.all(sums < 2.5 * (3 if score_func == "sigmoid" else 1))


def test_weights_are_chosen_scores_in_selection_order():
    rng = np.random.default_rng(1)
    cfg = RouterConfig(num_experts=8, num_topk=4, normalize_topk=False)
    out = route_jit(random_logits(rng, 16, 8), cfg)
    np.testing.assert_array_equal(out.topk_weights, np.take_along_axis(np.asarray(out.scores),
                                                                       np.asarray(out.topk_idx), -1))
    assert np.all(np.diff(np.asarray(out.topk_weights), axis=-1) <= 0)   # best first
    assert all(len(set(row)) == 4 for row in np.asarray(out.topk_idx).tolist())


def test_ties_prefer_lower_index():
    cfg = RouterConfig(num_experts=8, num_topk=3, num_groups=4, topk_groups=2)
    out = route_jit(jnp.zeros((2, 8), jnp.float32) + jnp.float32(0.3), cfg)
    np.testing.assert_array_equal(out.topk_idx, [[0, 1, 2]] * 2)


def test_leading_dims_and_bf16_logits():
    rng = np.random.default_rng(2)
    cfg = RouterConfig(num_experts=8, num_topk=2, score_func="sigmoid")
    logits = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.bfloat16)
    out = route_jit(logits, cfg)
    assert out.topk_idx.shape == (2, 5, 2) and out.scores.shape == (2, 5, 8)
    flat = route_jit(logits.reshape(10, 8), cfg)
    np.testing.assert_array_equal(out.topk_idx.reshape(10, 2), flat.topk_idx)


# ---------------------------------------------------------------------------------------------------------
# Group-limited routing and the rank cap
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_groups,topk_groups,num_topk", [(4, 2, 4), (8, 3, 6), (16, 4, 4)])
def test_group_limited_matches_reference(num_groups, topk_groups, num_topk):
    rng = np.random.default_rng(100 + num_groups)
    cfg = RouterConfig(num_experts=16, num_topk=num_topk, score_func="sigmoid", num_groups=num_groups,
                       topk_groups=topk_groups, routed_scaling_factor=2.5)
    logits = random_logits(rng, 40, 16)
    out = check_against_reference(logits, cfg)
    # Brute force: the chosen groups are exactly among the top `topk_groups` by top-2 sum.
    per_group = 16 // num_groups
    scores = np.asarray(out.scores).reshape(40, num_groups, per_group)
    group_score = np.sort(scores, -1)[..., ::-1][..., :min(2, per_group)].sum(-1)
    for t in range(40):
        kept = set(np.argsort(-group_score[t], kind="stable")[:topk_groups].tolist())
        assert {int(e) // per_group for e in np.asarray(out.topk_idx[t])} <= kept


def deepseek_gate(logits, bias, num_groups, topk_groups, topk, score_func, route_scale):
    """A transcription of DeepSeek's reference Gate.forward (DeepSeek-V3 repo, inference/model.py): the
    group score is the top-2 sum with a bias, the best score without one; softmax weights are not
    renormalised, sigmoid ones are."""
    scores = np_scores(logits, score_func).astype(np.float32)
    original = scores
    if bias is not None:
        scores = scores + bias
    per_group = scores.reshape(len(scores), num_groups, -1)
    group_scores = per_group.max(-1) if bias is None else np.sort(per_group, -1)[..., -2:].sum(-1)
    kept = np.argsort(-group_scores, -1, kind="stable")[:, :topk_groups]
    mask = np.ones_like(group_scores, bool)
    np.put_along_axis(mask, kept, False, -1)
    scores = np.where(np.repeat(mask, per_group.shape[-1], -1), -np.inf, scores)
    idx = np.argsort(-scores, -1, kind="stable")[:, :topk]
    weights = np.take_along_axis(original, idx, -1)
    if score_func == "sigmoid":
        weights = weights / weights.sum(-1, keepdims=True)
    return idx, weights * route_scale


@pytest.mark.parametrize("with_bias", [True, False])
def test_group_scores_match_deepseeks_gate(with_bias):
    """DeepSeek-V3 (sigmoid, bias: group score "top2_sum") and DeepSeek-V2 (softmax, no bias: "max", the
    reference Gate's rule without a bias; before 2026-12-05 jax_ep had only the first) pick the experts
    DeepSeek's Gate picks, with its weights."""
    rng = np.random.default_rng(31)
    if with_bias:
        cfg = RouterConfig(64, 8, score_func="sigmoid", routed_scaling_factor=2.5, num_groups=8,
                           topk_groups=4)
        bias = rng.normal(scale=0.1, size=64).astype(np.float32)
    else:
        cfg = RouterConfig(64, 6, score_func="softmax", normalize_topk=False, routed_scaling_factor=16.0,
                           num_groups=8, topk_groups=3, group_score="max")
        bias = None
    logits = random_logits(rng, 256, 64)
    out = check_against_reference(logits, cfg, None if bias is None else jnp.asarray(bias))
    idx, weights = deepseek_gate(np.asarray(logits), bias, cfg.num_groups, cfg.topk_groups, cfg.num_topk,
                                 cfg.score_func, cfg.routed_scaling_factor)
    np.testing.assert_array_equal(np.sort(np.asarray(out.topk_idx), -1), np.sort(idx, -1))
    order = np.argsort(np.asarray(out.topk_idx), -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(out.topk_weights), order, -1),
                               np.take_along_axis(weights, np.argsort(idx, -1), -1), rtol=2e-5, atol=1e-6)
    other = dataclasses.replace(cfg, group_score="top2_sum" if cfg.group_score == "max" else "max")
    changed = np.asarray(route_jit(logits, other, None if bias is None else jnp.asarray(bias)).topk_idx)
    assert (np.sort(changed, -1) != np.sort(idx, -1)).any(), "the two group scores pick alike here"


@parametrize_slow_tail("ep_size,max_ranks,num_topk", [(8, 2, 4), (4, 1, 3), (8, 4, 8), (16, 3, 5)])
def test_rank_cap_respected_and_matches_reference(ep_size, max_ranks, num_topk):
    rng = np.random.default_rng(200 + ep_size + max_ranks)
    cfg = RouterConfig(num_experts=32, num_topk=num_topk, ep_size=ep_size, max_ranks_per_token=max_ranks)
    out = check_against_reference(random_logits(rng, 48, 32), cfg)
    ranks = np.asarray(expert_to_rank(out.topk_idx, 32, ep_size))
    assert max(len(set(row)) for row in ranks.tolist()) <= max_ranks
    # Uncapped routing of the same logits does cross more ranks (the cap is doing something).
    free = route_jit(random_logits(np.random.default_rng(200 + ep_size + max_ranks), 48, 32),
                     RouterConfig(num_experts=32, num_topk=num_topk, ep_size=ep_size))
    free_ranks = np.asarray(expert_to_rank(free.topk_idx, 32, ep_size))
    assert max(len(set(row)) for row in free_ranks.tolist()) > max_ranks


@pytest.mark.parametrize("num_groups,topk_groups,ep_size,max_ranks", [
    (4, 2, 8, 3),    # groups coarser than ranks: groups first, then ranks inside kept groups
    (8, 2, 2, 1),    # ranks coarser than groups: ranks first, then groups on the kept rank
    (4, 3, 4, 2),    # same partition
])
def test_group_limit_and_rank_cap_together(num_groups, topk_groups, ep_size, max_ranks):
    rng = np.random.default_rng(300 + num_groups * ep_size)
    cfg = RouterConfig(num_experts=32, num_topk=4, score_func="sigmoid", num_groups=num_groups,
                       topk_groups=topk_groups, ep_size=ep_size, max_ranks_per_token=max_ranks)
    bias = jnp.asarray(rng.normal(scale=0.1, size=32), jnp.float32)
    out = check_against_reference(random_logits(rng, 40, 32), cfg, bias)
    idx = np.asarray(out.topk_idx)
    assert max(len(set((idx // (32 // ep_size)).tolist()[t])) for t in range(40)) <= max_ranks
    assert max(len(set((idx // (32 // num_groups)).tolist()[t])) for t in range(40)) <= topk_groups


# ---------------------------------------------------------------------------------------------------------
# Node-limited routing (DeepSeek-V3): the node cap
# ---------------------------------------------------------------------------------------------------------
def node_of(idx, num_experts, ep_size, ranks_per_node):
    """Node of each chosen expert, from the layout: expert -> EP rank (contiguous) -> node (contiguous)."""
    return (np.asarray(idx) // (num_experts // ep_size)) // ranks_per_node


def ref_node_scores(selection, num_experts, num_nodes, num_topk, max_nodes):
    """DeepSeek-V3's node score: sum of the ceil(K / M) highest selection scores on the node, [T, nodes]."""
    per_node = np.asarray(selection, np.float64).reshape(len(selection), num_nodes, num_experts // num_nodes)
    topn = min(-(-num_topk // max_nodes), per_node.shape[-1])
    return -np.sort(-per_node, axis=-1)[..., :topn].sum(-1)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@parametrize_slow_tail("num_experts,ep_size,ranks_per_node,max_nodes,num_topk", [
    (64, 32, 4, 4, 8),     # DeepSeek-V3 proportions: 8 nodes, at most 4 per token, top-8
    (32, 8, 2, 1, 4),      # one node per token
    (48, 16, 2, 3, 5),     # K not a multiple of M: node score = top-2 sum
    (32, 16, 8, 1, 6),     # 2 nodes of 16 experts, each token on one
])
def test_node_cap_respected_and_picks_top_nodes(score_func, num_experts, ep_size, ranks_per_node, max_nodes,
                                                num_topk):
    seed = 400 + num_experts + ep_size + ranks_per_node + max_nodes + 7 * (score_func == "sigmoid")
    rng = np.random.default_rng(seed)
    cfg = RouterConfig(num_experts=num_experts, num_topk=num_topk, score_func=score_func, ep_size=ep_size,
                       ranks_per_node=ranks_per_node, max_nodes_per_token=max_nodes)
    num_nodes = ep_size // ranks_per_node
    assert cfg.node_limited and cfg.num_nodes == num_nodes and not cfg.rank_limited
    num_tokens = 64
    logits = random_logits(rng, num_tokens, num_experts)
    bias = jnp.asarray(rng.normal(scale=0.05, size=num_experts), jnp.float32)
    out = check_against_reference(logits, cfg, bias)
    nodes = node_of(out.topk_idx, num_experts, ep_size, ranks_per_node)
    assert max(len(set(row)) for row in nodes.tolist()) <= max_nodes
    # The nodes used are among the top-M nodes by the documented node score (selection = scores + bias).
    node_score = ref_node_scores(np.asarray(out.scores) + np.asarray(bias), num_experts, num_nodes, num_topk,
                                 max_nodes)
    for t in range(num_tokens):
        top_nodes = set(np.argsort(-node_score[t], kind="stable")[:max_nodes].tolist())
        assert set(nodes[t].tolist()) <= top_nodes
    # Inside the kept nodes it is plain top-k: the same as masking the other nodes' logits by hand.
    keep = np.zeros((num_tokens, num_nodes), bool)
    np.put_along_axis(keep, np.argsort(-node_score, axis=-1, kind="stable")[:, :max_nodes], True, axis=-1)
    masked = np.where(np.repeat(keep, num_experts // num_nodes, axis=1),
                      np.asarray(out.scores) + np.asarray(bias), -np.inf)
    np.testing.assert_array_equal(out.topk_idx, np.argsort(-masked, axis=-1, kind="stable")[:, :num_topk])
    # Uncapped routing of the same logits does cross more nodes (the cap is doing something).
    free = route_jit(logits, RouterConfig(num_experts=num_experts, num_topk=num_topk, score_func=score_func),
                     bias)
    free_nodes = node_of(free.topk_idx, num_experts, ep_size, ranks_per_node)
    assert max(len(set(row)) for row in free_nodes.tolist()) > max_nodes


@parametrize_slow_tail("ep_size,ranks_per_node,max_nodes", [
    (8, 2, 4),      # cap == number of nodes
    (8, 2, 7),      # cap > number of nodes
    (8, 8, 1),      # one node
    (4, 8, 1),      # the EP group inside one node
    (1, 8, 2),      # ep_size left at 1 (the MoE layer sets it later)
])
def test_node_cap_at_or_above_node_count_is_uncapped_bit_for_bit(ep_size, ranks_per_node, max_nodes):
    rng = np.random.default_rng(500 + ep_size + max_nodes)
    logits = random_logits(rng, 40, 32)
    bias = jnp.asarray(rng.normal(scale=0.1, size=32), jnp.float32)
    for extra in ({}, dict(num_groups=4, topk_groups=2), dict(max_ranks_per_token=3)):
        free_cfg = RouterConfig(num_experts=32, num_topk=4, score_func="sigmoid", ep_size=ep_size, **extra)
        cfg = dataclasses.replace(free_cfg, ranks_per_node=ranks_per_node, max_nodes_per_token=max_nodes)
        assert not cfg.node_limited and cfg._limit_stages() == free_cfg._limit_stages()
        free, capped = route_jit(logits, free_cfg, bias), route_jit(logits, cfg, bias)
        np.testing.assert_array_equal(capped.topk_idx, free.topk_idx)
        np.testing.assert_array_equal(capped.topk_weights, free.topk_weights)
        np.testing.assert_array_equal(capped.scores, free.scores)


@pytest.mark.parametrize("extra", [
    dict(ep_size=16, ranks_per_node=4, max_nodes_per_token=2, max_ranks_per_token=3),  # nodes, then ranks
    dict(ep_size=16, ranks_per_node=4, max_nodes_per_token=3, max_ranks_per_token=2),  # rank cap binds
    dict(ep_size=8, ranks_per_node=1, max_nodes_per_token=3, max_ranks_per_token=2),   # node == rank
    dict(ep_size=8, ranks_per_node=2, max_nodes_per_token=2, num_groups=8, topk_groups=3,
         max_ranks_per_token=3),                                                         # groups = ranks
    dict(ep_size=16, ranks_per_node=2, max_nodes_per_token=3, num_groups=2, topk_groups=1),  # groups first
])
def test_node_cap_with_rank_cap_and_groups(extra):
    rng = np.random.default_rng(600 + sum(v for v in extra.values()))
    cfg = RouterConfig(num_experts=64, num_topk=4, score_func="sigmoid", routed_scaling_factor=2.5, **extra)
    assert cfg.node_limited
    bias = jnp.asarray(rng.normal(scale=0.1, size=64), jnp.float32)
    out = check_against_reference(random_logits(rng, 48, 64), cfg, bias)
    idx = np.asarray(out.topk_idx)
    ep = cfg.ep_size
    nodes = node_of(idx, 64, ep, cfg.ranks_per_node)
    assert max(len(set(row)) for row in nodes.tolist()) <= cfg.max_nodes_per_token
    if cfg.max_ranks_per_token is not None:
        assert max(len(set(row)) for row in (idx // (64 // ep)).tolist()) <= cfg.max_ranks_per_token
    assert max(len(set(row)) for row in (idx // (64 // cfg.num_groups)).tolist()) <= cfg.groups_per_token


# ---------------------------------------------------------------------------------------------------------
# Bias (aux-loss-free balancing) and gradients
# ---------------------------------------------------------------------------------------------------------
def test_bias_changes_selection_not_weights():
    rng = np.random.default_rng(3)
    cfg = RouterConfig(num_experts=8, num_topk=2, score_func="sigmoid", routed_scaling_factor=1.5)
    logits = random_logits(rng, 64, 8)
    bias = jnp.zeros(8, jnp.float32).at[5].set(10.0)     # forces expert 5 into every token's top-2
    out = check_against_reference(logits, cfg, bias)
    assert np.all(np.asarray(out.topk_idx)[:, 0] == 5)
    unbiased = route_jit(logits, cfg)
    assert not np.array_equal(out.topk_idx, unbiased.topk_idx)
    np.testing.assert_array_equal(out.scores, unbiased.scores)      # scores never see the bias
    chosen = np.take_along_axis(np.asarray(out.scores), np.asarray(out.topk_idx), -1)
    np.testing.assert_allclose(out.topk_weights, 1.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_bias_gets_no_gradient():
    rng = np.random.default_rng(4)
    cfg = RouterConfig(num_experts=8, num_topk=2, score_func="sigmoid")
    logits = random_logits(rng, 8, 8)
    bias = jnp.asarray(rng.normal(scale=0.2, size=8), jnp.float32)
    grad = jax.grad(lambda b: route(logits, cfg, b).topk_weights.sum())(bias)
    np.testing.assert_array_equal(grad, np.zeros(8))


@pytest.mark.parametrize("cfg", [
    RouterConfig(num_experts=8, num_topk=2),
    RouterConfig(num_experts=8, num_topk=3, score_func="sigmoid", routed_scaling_factor=2.5, num_groups=4,
                 topk_groups=2, ep_size=4, max_ranks_per_token=2),
    RouterConfig(num_experts=8, num_topk=2, score_func="sigmoid", normalize_topk=False),
    RouterConfig(num_experts=8, num_topk=3, score_func="sigmoid", routed_scaling_factor=2.5, ep_size=4,
                 ranks_per_node=2, max_nodes_per_token=1, max_ranks_per_token=2),
], ids=["softmax", "sigmoid-limited", "sigmoid-raw", "sigmoid-node-cap"])
def test_gradients_flow_to_logits(cfg):
    rng = np.random.default_rng(5)
    logits = random_logits(rng, 6, 8, scale=3.0)   # well separated: the eps steps never flip a choice
    bias = jnp.asarray(rng.normal(scale=0.1, size=8), jnp.float32)
    weights_of = lambda x: route(x, cfg, bias).topk_weights
    check_grads(weights_of, (logits,), order=1, modes=("rev", "fwd"), atol=2e-2, rtol=2e-2)
    grad = jax.grad(lambda x: (weights_of(x) * jnp.arange(1.0, cfg.num_topk + 1)).sum())(logits)
    assert np.all(np.isfinite(grad)) and np.abs(np.asarray(grad)).sum() > 0


# ---------------------------------------------------------------------------------------------------------
# Config validation and helpers
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=0, num_topk=1), "num_experts must be a positive int, got 0"),
    (dict(num_experts=8, num_topk=9), "num_topk=9 exceeds num_experts=8"),
    (dict(num_experts=8, num_topk=2, score_func="relu"), "score_func must be one of"),
    (dict(num_experts=8, num_topk=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(num_experts=8, num_topk=2, num_groups=3), "num_experts=8 is not divisible by num_groups=3"),
    (dict(num_experts=8, num_topk=2, ep_size=3), "num_experts=8 is not divisible by ep_size=3"),
    (dict(num_experts=8, num_topk=2, num_groups=4, topk_groups=5), "topk_groups must be an int in"),
    (dict(num_experts=8, num_topk=2, num_groups=4, group_score="sum"),
     r"group_score must be one of \('top2_sum', 'max'\), got 'sum'"),
    (dict(num_experts=8, num_topk=5, num_groups=4, topk_groups=2), "num_topk=5 exceeds the 4 experts"),
    (dict(num_experts=8, num_topk=3, ep_size=4, max_ranks_per_token=1), "num_topk=3 exceeds the 2 experts"),
    (dict(num_experts=8, num_topk=2, ep_size=4, max_ranks_per_token=0), "max_ranks_per_token must be None"),
    (dict(num_experts=24, num_topk=2, num_groups=4, topk_groups=2, ep_size=6, max_ranks_per_token=2),
     "need nested layouts"),
    (dict(num_experts=16, num_topk=5, num_groups=4, topk_groups=2, ep_size=8, max_ranks_per_token=2),
     "num_topk=5 exceeds the 4 experts"),
    (dict(num_experts=8, num_topk=2, ep_size=4, ranks_per_node=0),
     "ranks_per_node must be None or a positive int, got 0"),
    (dict(num_experts=8, num_topk=2, ep_size=4, ranks_per_node=2, max_nodes_per_token=0),
     "max_nodes_per_token must be None or a positive int, got 0"),
    (dict(num_experts=8, num_topk=2, ep_size=4, ranks_per_node=2, max_nodes_per_token=1.0),
     "max_nodes_per_token must be None or a positive int, got 1.0"),
    (dict(num_experts=8, num_topk=2, ep_size=4, max_nodes_per_token=1),
     "max_nodes_per_token=1 needs ranks_per_node"),
    (dict(num_experts=24, num_topk=2, ep_size=12, ranks_per_node=8, max_nodes_per_token=1),
     "ep_size=12 and ranks_per_node=8 must divide one another"),
    (dict(num_experts=24, num_topk=2, ep_size=3, ranks_per_node=2), "ep_size=3 and ranks_per_node=2"),
    (dict(num_experts=32, num_topk=9, ep_size=8, ranks_per_node=2, max_nodes_per_token=1),
     r"num_topk=9 exceeds the 8 experts a token can still reach with max_nodes_per_token=1 of 4 nodes "
     r"\(ep_size=8, ranks_per_node=2\)"),
    (dict(num_experts=32, num_topk=5, ep_size=8, ranks_per_node=4, max_nodes_per_token=1,
          max_ranks_per_token=1),
     r"num_topk=5 exceeds the 4 experts a token can still reach with max_nodes_per_token=1 of 2 nodes "
     r"\(ep_size=8, ranks_per_node=4\) and max_ranks_per_token=1 of ep_size=8"),
    (dict(num_experts=48, num_topk=2, num_groups=12, topk_groups=6, ep_size=16, ranks_per_node=2,
          max_nodes_per_token=4),
     r"max_nodes_per_token=4 of 8 nodes \(ep_size=16, ranks_per_node=2\) and topk_groups=6 of num_groups=12 "
     r"together need nested layouts: experts per node \(6\) and experts per group \(4\)"),
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_config_defaults_and_hashable():
    cfg = RouterConfig(num_experts=8, num_topk=2, num_groups=4)
    assert cfg.topk_groups is None and cfg.groups_per_token == 4
    assert not cfg.group_limited and not cfg.rank_limited
    assert cfg == RouterConfig(num_experts=8, num_topk=2, num_groups=4, topk_groups=None)
    assert hash(cfg) == hash(RouterConfig(num_experts=8, num_topk=2, num_groups=4))
    assert not RouterConfig(num_experts=8, num_topk=2, num_groups=4, topk_groups=4).group_limited
    assert not RouterConfig(num_experts=8, num_topk=2, ep_size=2, max_ranks_per_token=4).rank_limited
    assert cfg.ranks_per_node is None and cfg.max_nodes_per_token is None and cfg.num_nodes == 1
    node_cfg = RouterConfig(num_experts=256, num_topk=8, ep_size=64, ranks_per_node=8, max_nodes_per_token=4)
    assert (node_cfg.num_nodes, node_cfg.experts_per_node, node_cfg.node_score_topn) == (8, 32, 2)
    assert node_cfg.node_limited and node_cfg.max_selectable_experts == 128
    assert hash(node_cfg) == hash(dataclasses.replace(node_cfg))
    assert RouterConfig(num_experts=8, num_topk=2, ranks_per_node=8, max_nodes_per_token=2).num_nodes == 1


def test_route_shape_errors():
    cfg = RouterConfig(num_experts=8, num_topk=2)
    with pytest.raises(ValueError, match="logits.shape\\[-1\\]=7"):
        route(jnp.ones((3, 7)), cfg)
    with pytest.raises(ValueError, match="bias must have shape"):
        route(jnp.ones((3, 8)), cfg, jnp.ones(7))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\), got \(7,\)"):   # a list: named too
        route(jnp.ones((3, 8)), cfg, [0.0] * 7)
    np.testing.assert_array_equal(route(jnp.ones((3, 8)), cfg, [0.0] * 7 + [1.0]).topk_idx[:, 0], [7, 7, 7])


@pytest.mark.parametrize("limits", [{}, dict(num_groups=4, topk_groups=2)], ids=["plain", "groups"])
def test_a_nan_logit_is_chosen_and_reaches_the_weights(limits):
    """A NaN logit is picked (as torch.topk ranks NaN first) and its NaN reaches the token's weights
    (found by a review, 2026-12-05: sigmoid's NaN is negative, lax.top_k ranked it last, the expert was
    never chosen and the NaN was dropped silently; softmax's NaN fills the whole row, so it always
    reached the weights)."""
    score_func = "sigmoid"
    cfg = RouterConfig(num_experts=8, num_topk=2, score_func=score_func, **limits)
    logits = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))), (4, 8))
    logits = logits.at[1, 5].set(jnp.nan)
    r = route(logits, cfg)
    assert np.isnan(np.asarray(r.topk_weights[1])).any() and 5 in np.asarray(r.topk_idx[1])
    others = np.asarray(r.topk_weights)[[0, 2, 3]]
    assert np.isfinite(others).all()


def test_expert_to_rank_keeps_unused_slots():
    idx = jnp.array([[0, 7, -1], [3, 4, 5]], jnp.int32)
    np.testing.assert_array_equal(expert_to_rank(idx, 8, 4), [[0, 3, -1], [1, 2, 2]])


def test_replacing_num_groups_keeps_the_default_of_no_group_limit():
    """topk_groups None stays None (groups_per_token resolves it): dataclasses.replace with another
    num_groups routes as a fresh config (before 2026-12-05 the old default, 1, was written in and
    limited every token to one group silently)."""
    base = RouterConfig(num_experts=64, num_topk=8, score_func="sigmoid")
    replaced = dataclasses.replace(base, num_groups=8)
    fresh = RouterConfig(num_experts=64, num_topk=8, score_func="sigmoid", num_groups=8)
    assert replaced == fresh and replaced.groups_per_token == 8 and not replaced.group_limited
    logits = jax.random.normal(jax.random.key(1), (16, 64))
    idx = np.asarray(route(logits, replaced).topk_idx)
    np.testing.assert_array_equal(idx, np.asarray(route(logits, fresh).topk_idx))
    assert max(len(set(row)) for row in (idx // 8).tolist()) > 1
    limited = dataclasses.replace(fresh, topk_groups=2)
    assert limited.groups_per_token == 2 and limited.group_limited


def test_a_nan_logit_beside_a_minus_inf_bias_in_its_group_is_still_chosen():
    """A group holding a NaN logit (+inf selection) and a -inf bias scored +inf + -inf = NaN, which
    lax.top_k ranks last: the group was dropped and the NaN silently never reached the weights (found by a
    review, 2026-12-05). The NaN group ranks first, as DeepSeek's torch.topk ranks it."""
    cfg = RouterConfig(8, 2, "sigmoid", num_groups=4, topk_groups=2)
    logits = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))), (3, 8))
    logits = logits.at[:, 0].set(jnp.nan)
    bias = jnp.zeros(8).at[1].set(-jnp.inf)   # expert 1, in expert 0's group, disabled
    r = route(logits, cfg, bias)
    idx = np.asarray(r.topk_idx)
    assert (idx[:, 0] == 0).all() and (idx != 1).all(), idx
    assert np.isnan(np.asarray(r.topk_weights)).any(axis=1).all()


def test_normalised_weights_of_tiny_sigmoid_scores_sum_to_one():
    """routing.md step 7: w / sum_k w, as DeepSeek-V3's Gate. An epsilon added to the sum (1e-20) made rows
    of tiny sigmoid scores sum to less than 1 (K=1 at logits ~-46: the weight 0.63, a router gradient of
    0.23; K=8 at ~-48: 0.55; found by a fuzzer, 2026-12-06). Scores that all underflow stay 0."""
    rng = np.random.default_rng()
    for k, level in ((1, -46.0), (1, -60.0), (8, -48.0), (8, -40.0)):
        cfg = RouterConfig(8, k, "sigmoid")
        logits = jnp.asarray(level + rng.uniform(0.0, 2.0, size=(4, 8)), jnp.float32)
        w = np.asarray(route(logits, cfg).topk_weights)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
        if k == 1:   # every weight 1: no gradient for the router from the task loss
            g = jax.grad(lambda x, cfg=cfg: route(x, cfg).topk_weights.sum())(logits)
            assert not np.asarray(g).any(), g
    # scores that all underflow: weights 0, and a finite (zero) router gradient
    cfg = RouterConfig(8, 2, "sigmoid")
    under = jnp.full((2, 8), -200.0, jnp.float32)
    assert not np.asarray(route(under, cfg).topk_weights).any()
    g = np.asarray(jax.grad(lambda x: route(x, cfg).topk_weights.sum())(under))
    assert np.isfinite(g).all() and not g.any(), g


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_router_gradient_is_finite_and_right_when_the_chosen_scores_underflow(score_func):
    """Normalising K chosen sigmoid scores whose sum is below ~1e-19 (logits under ~-47) gave an inf or
    NaN gradient: JAX's rule for the division squares the sum, which flushes to 0 (found by a review,
    2026-12-05: logits ~-50 gave [-inf, -inf], ~-88 NaN; one such token made 64 of the 256 router-weight
    gradient entries non-finite). Checked against float64 finite differences of the documented formula."""
    rng = np.random.default_rng()
    cfg = RouterConfig(8, 2, score_func)
    coef = rng.uniform(0.5, 2.0, size=(2,))
    # (-80, not -90: sigmoid below ~-87 is subnormal, which XLA:CPU flushes to 0, so float32 has no
    # normalised weights to differentiate there; they are 0, test_normalised_weights_of_tiny_...)
    for level in (-50.0, -80.0):
        x = np.full((1, 8), level) + rng.uniform(0.0, 3.0, size=(1, 8))
        if score_func == "softmax":   # softmax's scores never underflow together: a spread row instead
            x = rng.normal(size=(1, 8)) * 30.0
        x32 = jnp.asarray(x, jnp.float32)
        g = np.asarray(jax.grad(lambda x: (route(x, cfg).topk_weights * coef).sum())(x32))
        assert np.isfinite(g).all(), (level, g)
        idx = np.asarray(route(x32, cfg).topk_idx)[0]

        def ref(x64, idx=idx):
            s = np_scores(x64, score_func)[0, idx]
            return ((s / s.sum()) * coef).sum()
        fd = np.zeros(8)
        for e in range(8):
            h = 1e-4
            p, m = x.copy(), x.copy()
            p[0, e] += h
            m[0, e] -= h
            fd[e] = (ref(p) - ref(m)) / (2 * h)
        np.testing.assert_allclose(g[0], fd, rtol=2e-3, atol=1e-6)

    # one outlier token among random ones: every router-weight gradient entry finite, and the others'
    # gradient the same as without it
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 8)) * 0.1, jnp.float32)
    x_out = x.at[3].set(-jnp.sign(w.sum(1)) * 400.0)
    weigh = jnp.arange(1.0, 3.0)
    mask = jnp.ones(16).at[3].set(0.0)

    def loss(w, x, mask):
        return ((route(x @ w, cfg).topk_weights @ weigh) * mask).sum()
    g_out = np.asarray(jax.grad(loss)(w, x_out, mask))
    assert np.isfinite(g_out).all()
    np.testing.assert_allclose(g_out, np.asarray(jax.grad(loss)(w, x, mask)), rtol=1e-5, atol=1e-7)


def test_router_config_takes_numpy_scalars_as_python_numbers():
    """NumPy scalars (a config read from an array, a checkpoint) were refused with a message that
    contradicted itself ("must be a positive finite number, got np.float32(2.5)"; found by a review,
    2026-12-05). They are stored as Python numbers: the same hash and jit cache entry."""
    cfg = RouterConfig(np.int64(8), np.int32(2), "sigmoid", np.bool_(True), np.float32(2.5), np.int64(4),
                       np.int64(2))
    plain = RouterConfig(8, 2, "sigmoid", True, 2.5, 4, 2)
    assert cfg == plain and hash(cfg) == hash(plain)
    assert type(cfg.num_experts) is int and type(cfg.routed_scaling_factor) is float
    assert type(cfg.normalize_topk) is bool and type(cfg.topk_groups) is int
    with pytest.raises(ValueError, match=r"num_topk must be a positive int, got np.float64\(2.0\)"):
        RouterConfig(8, np.float64(2.0))
    with pytest.raises(ValueError, match="routed_scaling_factor must be a positive finite number"):
        RouterConfig(8, 2, routed_scaling_factor=np.bool_(True))


def test_route_and_expert_to_rank_name_bad_shapes_and_sizes():
    """A scalar logits array raised a bare IndexError; expert_to_rank with ep_size 0 a ZeroDivisionError,
    and with -1 it silently marked expert 7 unused (found by a review, 2026-12-05)."""
    with pytest.raises(ValueError, match=r"logits must be \[\.\.\., E=8\], got a scalar"):
        route(jnp.zeros(()), RouterConfig(8, 2))
    idx = jnp.array([[0, 7, -1]], jnp.int32)
    for ep_size in (0, -1, 2.0):
        with pytest.raises(ValueError, match=f"ep_size must be a positive int, got {ep_size!r}"):
            expert_to_rank(idx, 8, ep_size)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        expert_to_rank(idx, 0, 1)
