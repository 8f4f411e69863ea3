"""Expert replication planner (jax_ep.eplb): crafted optima, properties over random loads, apply_placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.eplb import (
    Placement,
    apply_placement,
    balanced_packing,
    identity_placement,
    physical_to_rank,
    plan_placement,
    rank_loads,
    replicate_experts,
)
from jax_ep.errors import EPValueError


def check_consistent(placement, num_experts, num_ranks, slots_per_rank):
    """Structural invariants every placement must satisfy."""
    p2l = np.asarray(placement.physical_to_logical)
    counts = np.asarray(placement.replica_counts)
    table = np.asarray(placement.logical_to_physical)
    assert p2l.shape == (num_ranks * slots_per_rank,) and p2l.dtype == np.int32
    assert counts.shape == (num_experts,) and counts.dtype == np.int32
    assert np.all((p2l >= 0) & (p2l < num_experts))                     # every slot filled, valid expert
    assert np.all(counts >= 1)                                           # every expert placed
    assert counts.sum() == num_ranks * slots_per_rank
    np.testing.assert_array_equal(counts, np.bincount(p2l, minlength=num_experts))
    for expert in range(num_experts):
        slots = table[expert][table[expert] >= 0]
        assert len(slots) == counts[expert] and np.all(table[expert][counts[expert]:] == -1)
        assert np.all(np.diff(slots) > 0) and np.all(p2l[slots] == expert)


# ---------------------------------------------------------------------------------------------------------
# Crafted cases with known answers
# ---------------------------------------------------------------------------------------------------------
def test_one_hot_expert_gets_replicas_on_every_rank():
    loads = np.array([10.0, 1, 1, 1, 1, 1, 1, 1])
    placement = plan_placement(loads, num_ranks=4, slots_per_rank=3)
    check_consistent(placement, 8, 4, 3)
    # Replication is optimal (largest per-replica load 2 with 4 extra slots: 10/5); then 12 slots of loads
    # {2 x5, 1 x7}, 3 per rank: some rank holds two 2s plus one more item, so max 5 is optimal.
    np.testing.assert_array_equal(placement.replica_counts, [5, 1, 1, 1, 1, 1, 1, 1])
    assert rank_loads(placement, loads).max() == 5.0
    assert rank_loads(identity_placement(8, 4, 3, loads), loads).max() == 11.0
    assert set(np.asarray(physical_to_rank(placement.logical_to_physical[0, :5], placement)).tolist()) == \
        {0, 1, 2, 3}


def test_equal_loads_keep_the_identity_layout():
    loads = np.full(16, 7.0)
    placement = plan_placement(loads, num_ranks=4, slots_per_rank=4)
    np.testing.assert_array_equal(placement.physical_to_logical, np.arange(16))
    np.testing.assert_array_equal(placement.logical_to_physical[:, 0], np.arange(16))
    redundant = plan_placement(loads, num_ranks=4, slots_per_rank=5)
    check_consistent(redundant, 16, 4, 5)
    np.testing.assert_allclose(rank_loads(redundant, loads), 28.0)        # perfectly balanced


def test_lpt_trap_is_fixed_by_swaps():
    # Plain LPT packs {5,3,3} | {4,4,1} (max 11); the optimum is {5,4,1} | {4,3,3} = 10 | 10.
    item_loads = np.array([5.0, 4, 4, 3, 3, 1])
    packs = balanced_packing(item_loads, 2)
    assert np.bincount(packs).tolist() == [3, 3]
    assert max(item_loads[packs == p].sum() for p in range(2)) == 10.0


def test_replicate_experts_spreads_ties_round_robin():
    np.testing.assert_array_equal(replicate_experts(np.zeros(4), 7), [2, 2, 2, 1])
    # 9 -> 4.5 -> 3 per replica; then 3, 3, 3 tie and the expert with fewer replicas (1) wins.
    np.testing.assert_array_equal(replicate_experts(np.array([9.0, 3, 3]), 6), [3, 2, 1])


# ---------------------------------------------------------------------------------------------------------
# Properties over random loads
# ---------------------------------------------------------------------------------------------------------
CASES = [  # (num_experts, num_ranks, slots_per_rank)
    (8, 2, 4), (8, 4, 3), (16, 4, 6), (32, 8, 5), (64, 8, 9), (12, 4, 3), (10, 4, 3),
]


@pytest.mark.parametrize("num_experts,num_ranks,slots_per_rank", CASES)
def test_random_loads_properties(num_experts, num_ranks, slots_per_rank):
    rng = np.random.default_rng(1000 + num_experts * num_ranks + slots_per_rank)
    for trial in range(6):
        # Zipf-like skew: a few hot experts, as real routers produce.
        loads = rng.pareto(1.5, size=num_experts) * 100 + rng.integers(0, 5)
        if trial == 0:
            loads[rng.integers(num_experts)] = 0.0
        placement = plan_placement(loads, num_ranks, slots_per_rank)
        check_consistent(placement, num_experts, num_ranks, slots_per_rank)
        per_rank = rank_loads(placement, loads)
        np.testing.assert_allclose(per_rank.sum(), loads.sum())
        counts = np.asarray(placement.replica_counts)
        lower_bound = max(loads.sum() / num_ranks, (loads / counts).max())
        assert per_rank.max() >= lower_bound * (1 - 1e-9)
        if num_experts % num_ranks == 0:
            identity_max = rank_loads(identity_placement(num_experts, num_ranks), loads).max()
            assert per_rank.max() <= identity_max * (1 + 1e-9)
        again = plan_placement(loads.copy(), num_ranks, slots_per_rank)
        np.testing.assert_array_equal(again.physical_to_logical, placement.physical_to_logical)
        np.testing.assert_array_equal(again.logical_to_physical, placement.logical_to_physical)


def test_replication_helps_on_skewed_loads():
    rng = np.random.default_rng(11)
    loads = rng.pareto(1.0, size=32) * 100
    plain = rank_loads(identity_placement(32, 8), loads).max()
    no_extra = rank_loads(plan_placement(loads, 8, 4), loads).max()
    with_extra = rank_loads(plan_placement(loads, 8, 6), loads).max()
    assert with_extra <= no_extra <= plain
    assert with_extra < 0.8 * plain


def test_max_replicas_fixes_the_table_width_and_the_plan_stays_within_it():
    """A width below the free plan's replica count plans within it (before 2026-12-05 an EPValueError:
    the docs' fixed-width re-plan failed as soon as the loads got hotter than at the first plan)."""
    loads = np.array([50.0, 1, 1, 1])
    placement = plan_placement(loads, 2, 4, max_replicas=6)
    assert placement.logical_to_physical.shape == (4, 6)
    check_consistent(placement, 4, 2, 4)
    assert placement.replica_counts.tolist() == [5, 1, 1, 1]    # the free plan: 5 replicas of the hot one
    for narrow in (2, 3, 4):
        capped = plan_placement(loads, 2, 4, max_replicas=narrow)
        check_consistent(capped, 4, 2, 4)
        assert capped.logical_to_physical.shape == (4, narrow)
        assert capped.replica_counts.max() <= narrow
        assert rank_loads(capped, loads).max() < rank_loads(identity_placement(4, 2, 4, loads, narrow),
                                                             loads).max() or narrow == 2
    with pytest.raises(ValueError, match=r"max_replicas=1 is too small: 4 experts with at most 1 replicas "
                                         r"each fill 4 of the 8 slots; pass at least 2"):
        plan_placement(loads, 2, 4, max_replicas=1)
    with pytest.raises(ValueError, match="max_replicas must be a positive int, got 0"):
        plan_placement(loads, 2, 4, max_replicas=0)


def test_a_hotter_replan_fits_the_first_plans_width():
    """The docs' workflow: plan once, keep its width for re-plans (no recompile). An expert that gets 30x
    hotter re-plans within the width, within 5% of the best such a plan can do."""
    rng = np.random.default_rng(68)
    loads = rng.lognormal(0, 2.0, 256)
    width = int(plan_placement(loads, 32, 9).replica_counts.max())     # 7
    hotter = loads.copy()
    hotter[17] *= 30
    assert int(plan_placement(hotter, 32, 9).replica_counts.max()) > width      # the free plan is wider
    replan = plan_placement(hotter, 32, 9, max_replicas=width)
    check_consistent(replan, 256, 32, 9)
    assert replan.logical_to_physical.shape == (256, width)
    per_rank = rank_loads(replan, hotter)
    floor = max(per_rank.mean(), hotter.max() / width)     # no plan within the width does better
    assert per_rank.max() < 1.05 * floor, (per_rank.max(), floor)


@pytest.mark.parametrize("loads, identity", [([5, 0, 0, 0, 10, 10, 10, 10], False),
                                             ([6, 0, 0, 0, 2, 2, 2, 0], True)])
def test_max_replicas_applies_to_the_layout_returned(loads, identity):
    """The width is checked on the layout plan_placement returns, not on the candidate it drops (before
    2026-12-05 a width that fit the result raised where the other candidate was wider: the contiguous
    layout of the first loads needs 5 replicas, the better plan 3; the plan of the second needs 6, the
    contiguous layout it keeps 5)."""
    loads = np.asarray(loads, float)
    free = plan_placement(loads, 2, 8)
    assert np.array_equal(free.physical_to_logical, identity_placement(8, 2, 8, loads).physical_to_logical) \
        == identity
    width = free.logical_to_physical.shape[1]
    for max_replicas in (width, width + 2):
        fixed = plan_placement(loads, 2, 8, max_replicas=max_replicas)
        assert fixed.logical_to_physical.shape == (8, max_replicas)
        np.testing.assert_array_equal(fixed.physical_to_logical, free.physical_to_logical)
        check_consistent(fixed, 8, 2, 8)


# ---------------------------------------------------------------------------------------------------------
# Hierarchical policy
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts,num_groups,num_nodes,num_ranks,slots_per_rank", [
    (16, 4, 2, 8, 3), (32, 8, 2, 4, 10), (24, 6, 3, 6, 5),
])
def test_hierarchical_keeps_groups_inside_nodes(num_experts, num_groups, num_nodes, num_ranks,
                                                slots_per_rank):
    rng = np.random.default_rng(num_experts + num_groups)
    group_size = num_experts // num_groups
    slots_per_node = num_ranks // num_nodes * slots_per_rank
    for _ in range(4):
        loads = rng.pareto(1.2, size=num_experts) * 10
        placement = plan_placement(loads, num_ranks, slots_per_rank, num_nodes=num_nodes,
                                   num_groups=num_groups)
        check_consistent(placement, num_experts, num_ranks, slots_per_rank)
        node_experts = np.asarray(placement.physical_to_logical).reshape(num_nodes, slots_per_node)
        node_of_group = {}
        for node in range(num_nodes):
            for group in set((node_experts[node] // group_size).tolist()):
                assert node_of_group.setdefault(group, node) == node      # a group lives on one node only
                members = set(range(group * group_size, (group + 1) * group_size))
                assert members <= set(node_experts[node].tolist())        # ... with all its experts
        assert sorted(node_of_group) == list(range(num_groups))
        assert all(list(node_of_group.values()).count(n) == num_groups // num_nodes for n in range(num_nodes))
        identity_max = rank_loads(identity_placement(num_experts, num_ranks), loads).max()
        assert rank_loads(placement, loads).max() <= identity_max * (1 + 1e-9)


def test_hierarchical_balances_nodes():
    # Groups of 2 experts with loads 8, 1, 1, 8 (per group): nodes get {g0, g1} and {g2, g3}... or better,
    # {g0, g3} vs {g1, g2} would be 16 vs 2. The planner must pair a heavy group with a light one.
    loads = np.array([4.0, 4, 0.5, 0.5, 0.5, 0.5, 4, 4])
    placement = plan_placement(loads, num_ranks=4, slots_per_rank=2, num_nodes=2, num_groups=4)
    per_node = rank_loads(placement, loads).reshape(2, 2).sum(1)
    np.testing.assert_allclose(per_node, [9.0, 9.0])


# ---------------------------------------------------------------------------------------------------------
# apply_placement
# ---------------------------------------------------------------------------------------------------------
def test_apply_placement_maps_into_replicas_and_spreads_tokens():
    rng = np.random.default_rng(12)
    loads = rng.pareto(1.0, size=16) * 50
    placement = plan_placement(loads, num_ranks=4, slots_per_rank=6)
    idx = np.argsort(rng.random((300, 16)), axis=-1)[:, :4].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    physical = np.asarray(jax.jit(apply_placement)(jnp.asarray(idx), placement))
    assert physical.dtype == np.int32
    np.testing.assert_array_equal(physical < 0, idx < 0)
    used = idx >= 0
    np.testing.assert_array_equal(np.asarray(placement.physical_to_logical)[physical[used]], idx[used])
    # Every replica of every expert receives tokens, evenly (token index mod replica count).
    counts = np.asarray(placement.replica_counts)
    per_slot = np.bincount(physical[used], minlength=24)
    for expert in range(16):
        slots = np.asarray(placement.logical_to_physical[expert, :counts[expert]])
        received = per_slot[slots]
        assert received.sum() == np.sum(idx == expert)
        if received.sum() >= 3 * counts[expert]:
            assert received.min() > 0 and received.max() - received.min() <= 0.5 * received.mean()


def test_apply_placement_hot_expert_split_exactly():
    placement = plan_placement(np.array([10.0, 1, 1, 1, 1, 1, 1, 1]), 4, 3)
    idx = jnp.zeros((20, 1), jnp.int32)                     # all 20 tokens pick the hot expert
    physical = np.asarray(apply_placement(idx, placement))
    assert np.bincount(physical[:, 0], minlength=12)[placement.logical_to_physical[0, :5]].tolist() == [4] * 5
    # Global token ids shift the replica choice.
    shifted = apply_placement(idx, placement, token_ids=jnp.arange(20, dtype=jnp.int32) + 1)
    np.testing.assert_array_equal(np.asarray(shifted)[:-1], physical[1:])


def test_apply_placement_with_leading_dims_and_traced_placement():
    placement = plan_placement(np.array([5.0, 1, 1, 3]), 2, 3)
    idx = jnp.array([[[0, 1], [3, -1]], [[0, 3], [2, 0]]], jnp.int32)
    out = jax.jit(lambda i, p: apply_placement(i, p))(idx, placement)
    assert out.shape == (2, 2, 2)
    p2l = np.asarray(placement.physical_to_logical)
    got = np.asarray(out)
    np.testing.assert_array_equal(np.where(got >= 0, p2l[np.maximum(got, 0)], -1), np.asarray(idx))
    leaves = jax.tree_util.tree_leaves(placement)
    assert len(leaves) == 3 and isinstance(placement, Placement)


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,message", [
    ((np.ones(8), 4, 1), {}, "4 \\* 1 slots cannot hold 8 experts"),
    ((np.ones(8), 0, 2), {}, "num_ranks must be a positive int, got 0"),
    ((np.ones(8), 4, 2), dict(num_nodes=3), "num_ranks=4 is not divisible by num_nodes=3"),
    ((np.ones(8), 4, 2), dict(num_nodes=2, num_groups=3), "num_experts=8 is not divisible by num_groups=3"),
    ((np.ones(8), 4, 2), dict(num_nodes=4, num_groups=2), "num_groups=2 is not a multiple of num_nodes=4"),
    ((np.array([1.0, -1, 1, 1]), 2, 2), {}, r"loads must be finite and non-negative, got \[-1.0\] at \[1\]"),
    ((np.array([1.0, 1, np.nan, 1]), 2, 2), {}, r"non-negative, got \[nan\] at \[2\]"),
    ((["a", "b"], 2, 1), {}, "loads must be numbers, got list"),
    ((np.ones((2, 4)), 2, 2), {}, "loads must be a non-empty 1-D array"),
    # no default that stops balancing between nodes (one fixed block of experts per node)
    ((np.ones(8), 4, 2), dict(num_nodes=2), "num_nodes=2 needs num_groups"),
])
def test_plan_errors(args, kwargs, message):
    with pytest.raises(EPValueError, match=message):
        plan_placement(*args, **kwargs)


@pytest.mark.parametrize("call,message", [
    (lambda: balanced_packing(np.ones(4), 0), "num_packs must be a positive int, got 0"),
    (lambda: balanced_packing(np.ones((2, 2)), 2), "item_loads must be a non-empty 1-D array"),
    (lambda: balanced_packing(np.array([1.0, np.nan]), 1), r"item_loads must be finite and non-negative"),
    (lambda: replicate_experts(np.ones(4), 5.0), "num_slots must be a positive int, got 5.0"),
    (lambda: replicate_experts(np.ones(4), 9, max_replicas=2), r"max_replicas=2 is too small.*at least 3"),
])
def test_building_block_errors_name_the_argument(call, message):
    """Before 2026-12-05: ZeroDivisionError, IndexError, TypeError, and NaN loads packed silently."""
    with pytest.raises(EPValueError, match=message):
        call()


def test_replicate_experts_respects_max_replicas():
    np.testing.assert_array_equal(replicate_experts(np.array([100.0, 1, 1]), 7, max_replicas=3), [3, 2, 2])
    np.testing.assert_array_equal(replicate_experts(np.array([100.0, 1, 1]), 7), [5, 1, 1])


def test_apply_placement_keeps_ids_that_name_no_expert_invalid():
    """An id >= E stays an id dispatch drops (or reports in checked mode), as without a placement: before
    2026-12-05 JAX's clamped gather made it a pick of expert E - 1. Negative ids pass through."""
    placement = plan_placement(np.array([5.0, 1, 1, 3]), 2, 3)
    idx = jnp.array([[0, 4], [3, 7], [-1, -3]], jnp.int32)
    got = np.asarray(apply_placement(idx, placement))
    assert got[:, 1].tolist() == [6, 6, -3] and got[2, 0] == -1     # 6 = num_slots: no slot
    assert np.asarray(placement.physical_to_logical)[got[:2, 0]].tolist() == [0, 3]
    ranks = np.asarray(physical_to_rank(jnp.asarray(got), placement))
    assert ranks.tolist() == [[got[0, 0] // 3, -1], [got[1, 0] // 3, -1], [-1, -1]]


def test_apply_placement_sends_picks_only_to_active_replicas():
    """slot_active (a rank mask over the slots): an expert's picks are split over its active replicas;
    an expert with none keeps its split (the exchange drops those picks). Before 2026-12-05 the layer sent
    1/c of a c-replica expert's picks to a masked rank's replica, where they were dropped."""
    placement = plan_placement(np.array([40.0, 1, 1, 1, 1, 1, 1, 1]), 4, 3)     # expert 0: 5 replicas
    p2l = np.asarray(placement.physical_to_logical)
    slot_active = np.repeat([True, True, True, False], 3)
    idx = jnp.asarray(np.repeat(np.arange(8), 40)[:, None], jnp.int32)
    got = np.asarray(jax.jit(apply_placement)(idx, placement, None, jnp.asarray(slot_active)))[:, 0]
    np.testing.assert_array_equal(p2l[got], np.asarray(idx)[:, 0])              # still the picked expert
    for expert in range(8):
        slots = got[np.asarray(idx)[:, 0] == expert]
        live = [s for s in placement.logical_to_physical[expert] if s >= 0 and slot_active[s]]
        if live:
            assert set(slots.tolist()) == set(live)                             # active replicas only,
            assert np.ptp(np.bincount(slots, minlength=12)[live]) <= 1          # evenly
        else:
            np.testing.assert_array_equal(got[np.asarray(idx)[:, 0] == expert],
                                          np.asarray(apply_placement(idx, placement))[np.asarray(idx)[:, 0]
                                                                                        == expert, 0])
    assert any(not slot_active[s] for s in placement.logical_to_physical[0] if s >= 0)   # the case arises
    with pytest.raises(EPValueError, match=r"slot_active.shape=\(4,\) must be \(num_slots,\)=\(12,\)"):
        apply_placement(idx, placement, slot_active=jnp.ones(4, bool))


def test_apply_placement_token_ids_shape_error():
    placement = plan_placement(np.ones(4), 2, 2)
    with pytest.raises(ValueError, match="token_ids.shape=\\(3,\\) must equal"):
        apply_placement(jnp.zeros((4, 2), jnp.int32), placement, token_ids=jnp.arange(3))
