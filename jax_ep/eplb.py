"""Expert-parallel load balancer (EPLB): replicate hot experts and place the replicas on ranks.

A *placement* maps `num_ranks * slots_per_rank` physical expert slots (slot s lives on rank
s // slots_per_rank) to logical experts. With more slots than experts, the extra slots hold redundant
copies (replicas) of heavily loaded experts, and routing sends each token to one replica of the expert it
chose (`apply_placement`), so a hot expert's tokens are split across ranks.

The planner (host-side NumPy, deterministic) follows DeepSeek's EPLB:

1. replication: each extra slot goes to the expert with the largest load per replica (ties: fewer
   replicas, then lower expert id); this minimises the largest per-replica load;
2. packing: replicas (each carrying load / replica_count) go onto ranks with equal slot counts by
   greedy longest-processing-time (heaviest first, to the least-loaded rank with a free slot), then
   pairwise swaps out of the heaviest rank while they lower it;
3. hierarchical mode (`num_nodes > 1`): contiguous expert groups are first packed onto nodes (equal
   group count per node, balancing group loads), replicas are made within each node, then packed onto
   the node's ranks; so a token's traffic for a group stays inside one node.

The contiguous identity placement (expert e on rank e // (E / num_ranks), extra slots holding replicas
of the rank's own experts) is also a candidate and wins ties, so the planner never does worse than no
rebalancing and never moves experts when that gains nothing (e.g. equal loads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.errors import EPValueError

# Relative improvement below which a swap (or a non-identity plan) is not worth it; keeps float rounding
# from causing endless swaps or gratuitous expert moves.
_REL_TOL = 1e-9
_MAX_SWAP_ROUNDS = 10_000


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Physical expert slots for E logical experts on `num_ranks` ranks of `slots_per_rank` slots each.

    A pytree (arrays are leaves, the two sizes are static), so it can be passed into a jitted function.
    """

    physical_to_logical: np.ndarray  # [num_ranks * slots_per_rank] int32: logical expert of each slot
    replica_counts: np.ndarray       # [E] int32: slots holding each expert (>= 1)
    logical_to_physical: np.ndarray  # [E, max_replicas] int32: the expert's slots, ascending, -1 padded
    num_ranks: int = dataclasses.field(metadata=dict(static=True))
    slots_per_rank: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return self.replica_counts.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank


# ---------------------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------------------
def check_placement(placement: Placement, owner: str = "placement") -> None:
    """A placement's tables agree (on the host, where they are concrete: a jitted function's traced
    placement is skipped): physical_to_logical [num_ranks * slots_per_rank] ids in [0, E), every expert
    in at least one slot, replica_counts its bincount, logical_to_physical each expert's slots ascending,
    -1 padded. An EPValueError names the table and the value otherwise."""
    tables = (placement.physical_to_logical, placement.replica_counts, placement.logical_to_physical)
    if any(isinstance(t, jax.core.Tracer) for t in tables):
        return
    p2l, counts, l2p = (np.asarray(t) for t in tables)
    names = ("physical_to_logical", "replica_counts", "logical_to_physical")
    for name, table in zip(names, (p2l, counts, l2p), strict=True):
        if not np.issubdtype(table.dtype, np.integer):
            raise EPValueError(f"{owner}.{name} must hold integers, got dtype {table.dtype}")
    experts, slots = counts.shape[0] if counts.ndim == 1 else -1, placement.num_slots
    if counts.ndim != 1 or not experts:
        raise EPValueError(f"{owner}.replica_counts must be a non-empty 1-D array [E], got shape "
                           f"{counts.shape}")
    if p2l.shape != (slots,):
        raise EPValueError(f"{owner}.physical_to_logical must have shape [{slots}] (num_ranks="
                           f"{placement.num_ranks} x slots_per_rank={placement.slots_per_rank}), got "
                           f"{p2l.shape}")
    bad = (p2l < 0) | (p2l >= experts)
    if bad.any():
        raise EPValueError(f"{owner}.physical_to_logical holds ids outside [0, {experts}): "
                           f"{p2l[bad][:4].tolist()} at slots {np.flatnonzero(bad)[:4].tolist()}")
    held = np.bincount(p2l, minlength=experts)
    if not held.all():
        raise EPValueError(f"{owner}: experts {np.flatnonzero(held == 0)[:8].tolist()} have no slot "
                           "(every expert needs at least one replica)")
    if not np.array_equal(counts, held):
        raise EPValueError(f"{owner}.replica_counts {counts[:8].tolist()}... is not the slots per expert of "
                           f"physical_to_logical {held[:8].tolist()}...")
    if l2p.ndim != 2 or l2p.shape[0] != experts or l2p.shape[1] < held.max():
        raise EPValueError(f"{owner}.logical_to_physical must have shape [{experts}, >= {held.max()}] (the "
                           f"most replicas of an expert), got {l2p.shape}")
    want = _placement_from_slots(p2l, experts, placement.num_ranks, placement.slots_per_rank,
                                 l2p.shape[1]).logical_to_physical
    wrong = np.flatnonzero((l2p != want).any(axis=1))
    if wrong.size:
        e = int(wrong[0])
        raise EPValueError(f"{owner}.logical_to_physical[{e}] is {l2p[e].tolist()}, expert {e}'s slots of "
                           f"physical_to_logical are {want[e].tolist()} (ascending, -1 padded)")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise EPValueError(f"{name} must be a positive int, got {value!r}")


def _as_loads(loads, name: str = "loads") -> np.ndarray:
    try:
        loads = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise EPValueError(f"{name} must be numbers, got {type(loads).__name__}: {e}") from e
    if loads.ndim != 1 or loads.size == 0:
        raise EPValueError(f"{name} must be a non-empty 1-D array [num_experts], got shape {loads.shape}")
    bad = np.flatnonzero(~np.isfinite(loads) | (loads < 0))
    if bad.size:
        raise EPValueError(f"{name} must be finite and non-negative, got {loads[bad[:4]].tolist()} at "
                           f"{bad[:4].tolist()}" + (f" ({bad.size} entries)" if bad.size > 4 else ""))
    return loads


# ---------------------------------------------------------------------------------------------------------
# Building blocks (host-side, NumPy)
# ---------------------------------------------------------------------------------------------------------
def _width_fills(num_experts: int, num_slots: int, max_replicas: int | None) -> bool:
    """Whether num_experts with at most max_replicas replicas each (None: no cap) can fill num_slots."""
    return max_replicas is None or num_experts * max_replicas >= num_slots


def replicate_experts(loads: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica count per expert ([E] int64, sum = num_slots): each extra slot to the largest load per replica
    among the experts below `max_replicas` replicas (no cap by default).

    Ties go to the expert with fewer replicas, then the lower id (so equal or zero loads spread round-robin).
    """
    loads = _as_loads(loads)
    _check_positive_int("num_slots", num_slots)
    if num_slots < loads.size:
        raise EPValueError(f"num_slots={num_slots} is smaller than the {loads.size} experts to place")
    if max_replicas is not None:
        _check_positive_int("max_replicas", max_replicas)
        if not _width_fills(loads.size, num_slots, max_replicas):
            raise EPValueError(f"max_replicas={max_replicas} is too small: {loads.size} experts with at most "
                               f"{max_replicas} replicas each fill {loads.size * max_replicas} of the "
                               f"{num_slots} slots; pass at least {-(-num_slots // loads.size)}")
    counts = np.ones(loads.size, dtype=np.int64)
    for _ in range(num_slots - loads.size):
        per_replica = loads / counts
        if max_replicas is not None:
            per_replica = np.where(counts < max_replicas, per_replica, -np.inf)
        best = per_replica == per_replica.max()
        fewest = np.where(best, counts, np.iinfo(np.int64).max)
        counts[int(np.argmin(fewest))] += 1   # argmin returns the lowest index among equals
    return counts


def balanced_packing(item_loads: np.ndarray, num_packs: int) -> np.ndarray:
    """Assigns items to `num_packs` packs of exactly len(items) / num_packs items, balancing pack loads.

    Greedy longest-processing-time (heaviest item first, to the least-loaded pack with room, lower index on
    ties), then swaps between the heaviest pack and another while the swap lowers the heavier of the two.
    Returns pack index per item ([n] int64).
    """
    item_loads = _as_loads(item_loads, "item_loads")
    _check_positive_int("num_packs", num_packs)
    num_items = item_loads.size
    if num_items % num_packs:
        raise EPValueError(f"{num_items} items cannot be split evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    pack_of = np.empty(num_items, dtype=np.int64)
    pack_load = np.zeros(num_packs)
    pack_size = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-item_loads, kind="stable"):
        open_load = np.where(pack_size < per_pack, pack_load, np.inf)
        pack = int(np.argmin(open_load))
        pack_of[item] = pack
        pack_load[pack] += item_loads[item]
        pack_size[pack] += 1
    if num_packs > 1 and per_pack > 0:
        _improve_by_swaps(item_loads, pack_of, pack_load)
    return pack_of


def _improve_by_swaps(item_loads: np.ndarray, pack_of: np.ndarray, pack_load: np.ndarray) -> None:
    """In place: swap an item of the heaviest pack with a lighter item elsewhere while that lowers the max
    of the two packs. Each accepted swap strictly lowers the sum of squared pack loads, so this terminates."""
    tol = _REL_TOL * max(float(item_loads.sum()), 1e-300)
    for _ in range(_MAX_SWAP_ROUNDS):
        heavy = int(np.argmax(pack_load))
        inside = np.flatnonzero(pack_of == heavy)
        outside = np.flatnonzero(pack_of != heavy)
        delta = item_loads[inside][:, None] - item_loads[outside][None, :]     # load moved off `heavy`
        other_load = pack_load[pack_of[outside]][None, :]
        new_max = np.maximum(pack_load[heavy] - delta, other_load + delta)
        useful = (delta > tol) & (new_max < pack_load[heavy] - tol)
        if not useful.any():
            return
        new_max = np.where(useful, new_max, np.inf)
        # The first best swap (argmin order): deterministic.
        a, b = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        item_a, item_b = inside[a], outside[b]
        other = int(pack_of[item_b])
        pack_of[item_a], pack_of[item_b] = other, heavy
        pack_load[heavy] -= delta[a, b]
        pack_load[other] += delta[a, b]


def _placement_from_slots(physical_to_logical: np.ndarray, num_experts: int, num_ranks: int,
                          slots_per_rank: int, max_replicas: int | None) -> Placement:
    physical_to_logical = np.asarray(physical_to_logical, dtype=np.int32)
    counts = np.bincount(physical_to_logical, minlength=num_experts).astype(np.int32)
    width = int(counts.max())
    if max_replicas is not None:
        if max_replicas < width:
            raise EPValueError(f"max_replicas={max_replicas} is smaller than the {width} replicas this plan "
                               "gives one expert")
        width = max_replicas
    table = np.full((num_experts, width), -1, dtype=np.int32)
    order = np.argsort(physical_to_logical, kind="stable")       # slots grouped by expert, ascending
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    replica_rank = np.arange(order.size) - np.repeat(starts, counts)
    table[physical_to_logical[order], replica_rank] = order
    return Placement(physical_to_logical, counts, table, int(num_ranks), int(slots_per_rank))


def _sort_within_ranks(physical_to_logical: np.ndarray, slots_per_rank: int) -> np.ndarray:
    """Orders each rank's slots by logical id: load is unchanged and the layout is canonical (and equals
    the identity layout when nothing moved)."""
    return np.sort(physical_to_logical.reshape(-1, slots_per_rank), axis=1).reshape(-1)


# ---------------------------------------------------------------------------------------------------------
# Planners
# ---------------------------------------------------------------------------------------------------------
def identity_placement(num_experts: int, num_ranks: int, slots_per_rank: int | None = None,
                       loads=None, max_replicas: int | None = None) -> Placement:
    """Contiguous layout: expert e on rank e // (E / num_ranks), as without EPLB.

    Extra slots (slots_per_rank > E / num_ranks) hold replicas of the rank's *own* experts (chosen by load
    per replica when `loads` is given), so every rank's load equals the plain contiguous layout's.
    """
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("num_ranks", num_ranks)
    if num_experts % num_ranks:
        raise EPValueError(f"identity placement needs num_experts={num_experts} divisible by "
                           f"num_ranks={num_ranks}")
    native = num_experts // num_ranks
    slots_per_rank = native if slots_per_rank is None else slots_per_rank
    _check_positive_int("slots_per_rank", slots_per_rank)
    if slots_per_rank < native:
        raise EPValueError(f"slots_per_rank={slots_per_rank} is below the {native} experts per rank")
    loads = np.ones(num_experts) if loads is None else _as_loads(loads)
    if loads.size != num_experts:
        raise EPValueError(f"loads has {loads.size} entries, expected num_experts={num_experts}")
    slots = []
    for rank in range(num_ranks):
        own = np.arange(rank * native, (rank + 1) * native)
        counts = replicate_experts(loads[own], slots_per_rank, max_replicas)
        slots.append(np.repeat(own, counts))
    return _placement_from_slots(np.concatenate(slots), num_experts, num_ranks, slots_per_rank, max_replicas)


def plan_placement(loads, num_ranks: int, slots_per_rank: int, *, num_nodes: int = 1,
                   num_groups: int | None = None, max_replicas: int | None = None) -> Placement:
    """Replicates and places experts to balance the per-rank load.

    Args:
      loads: [E] non-negative per-expert loads (e.g. `MoE.total_load` or token counts).
      num_ranks: EP ranks (R).
      slots_per_rank: physical expert slots per rank (S); R * S >= E. R * S - E replicas are created.
      num_nodes: > 1 selects the hierarchical policy: R ranks form num_nodes equal nodes.
      num_groups: contiguous expert groups for the hierarchical policy, needed with num_nodes > 1 (e.g.
        the router's RouterConfig.num_groups); a multiple of num_nodes. Each node receives
        num_groups / num_nodes whole groups.
      max_replicas: fixed width of `logical_to_physical` (keeps jitted shapes stable across re-plans);
        default the largest replica count of this plan. The plan gives no expert more replicas than this
        (hotter loads re-plan within the width); EPValueError where the node's experts with this many
        replicas each cannot fill its slots.

    Returns:
      the Placement; deterministic for equal inputs.
    """
    loads = _as_loads(loads)
    num_experts = loads.size
    _check_positive_int("num_ranks", num_ranks)
    _check_positive_int("slots_per_rank", slots_per_rank)
    _check_positive_int("num_nodes", num_nodes)
    if max_replicas is not None:
        _check_positive_int("max_replicas", max_replicas)
    if num_ranks * slots_per_rank < num_experts:
        raise EPValueError(f"num_ranks * slots_per_rank = {num_ranks} * {slots_per_rank} slots cannot hold "
                           f"{num_experts} experts")
    if num_ranks % num_nodes:
        raise EPValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
    if num_groups is None:
        if num_nodes > 1:   # as DeepSeek's EPLB: no default that silently stops balancing between nodes
            raise EPValueError(f"plan_placement: num_nodes={num_nodes} needs num_groups (e.g. the router's "
                               "RouterConfig.num_groups, a multiple of num_nodes): with one group per node "
                               "each node keeps a fixed block of experts and no load moves between nodes")
        num_groups = 1
    _check_positive_int("num_groups", num_groups)
    if num_experts % num_groups:
        raise EPValueError(f"num_experts={num_experts} is not divisible by num_groups={num_groups}")
    if num_groups % num_nodes:
        raise EPValueError(f"num_groups={num_groups} is not a multiple of num_nodes={num_nodes}")
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = ranks_per_node * slots_per_rank
    experts_per_node = num_experts // num_nodes
    if slots_per_node < experts_per_node:
        raise EPValueError(f"each node has {slots_per_node} slots ({ranks_per_node} ranks * slots_per_rank="
                           f"{slots_per_rank}) for its {experts_per_node} experts")

    # Step 1: whole groups onto nodes (a no-op with one node).
    group_size = num_experts // num_groups
    group_loads = loads.reshape(num_groups, group_size).sum(axis=1)
    node_of_group = balanced_packing(group_loads, num_nodes)

    physical_to_logical = np.empty(num_ranks * slots_per_rank, dtype=np.int64)
    for node in range(num_nodes):
        node_groups = np.flatnonzero(node_of_group == node)                  # ascending group ids
        experts = (node_groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        # Step 2: replicas within the node.
        counts = replicate_experts(loads[experts], slots_per_node, max_replicas)
        replica_expert = np.repeat(experts, counts)
        replica_load = np.repeat(loads[experts] / counts, counts)
        # Step 3: replicas onto the node's ranks, equal slot counts.
        rank_in_node = balanced_packing(replica_load, ranks_per_node)
        for local_rank in range(ranks_per_node):
            rank = node * ranks_per_node + local_rank
            physical_to_logical[rank * slots_per_rank:(rank + 1) * slots_per_rank] = \
                replica_expert[rank_in_node == local_rank]
    planned = _placement_from_slots(_sort_within_ranks(physical_to_logical, slots_per_rank), num_experts,
                                    num_ranks, slots_per_rank, max_replicas)
    # The contiguous layout is valid in both modes (groups and nodes are contiguous): keep it unless the
    # plan is strictly better, so re-planning balanced loads never moves weights around. Under a width
    # its rank's own experts may not fill the rank's extra slots: then the plan.
    native = num_experts // num_ranks
    if num_experts % num_ranks or not _width_fills(native, slots_per_rank, max_replicas):
        return planned
    identity = identity_placement(num_experts, num_ranks, slots_per_rank, loads, max_replicas)
    tol = _REL_TOL * max(float(loads.sum()), 1e-300)
    return identity if rank_loads(planned, loads).max() >= rank_loads(identity, loads).max() - tol \
        else planned


# ---------------------------------------------------------------------------------------------------------
# Using a placement
# ---------------------------------------------------------------------------------------------------------
def rank_loads(placement: Placement, loads) -> np.ndarray:
    """[num_ranks] load of each rank when every expert's load is split evenly over its replicas."""
    loads = _as_loads(loads)
    counts = np.asarray(placement.replica_counts)
    if loads.size != counts.size:
        raise EPValueError(f"loads has {loads.size} entries, the placement has {counts.size} experts")
    slot_expert = np.asarray(placement.physical_to_logical)
    slot_loads = loads[slot_expert] / counts[slot_expert]
    return slot_loads.reshape(placement.num_ranks, placement.slots_per_rank).sum(axis=1)


def apply_placement(topk_idx: jax.Array, placement: Placement,
                    token_ids: jax.Array | None = None, slot_active: jax.Array | None = None) -> jax.Array:
    """Maps logical expert ids to physical slots: [..., K] int32. Works under jit.

    Token t sends its pick of expert e to replica (token_ids[t] mod replica_counts[e]) of e, so an expert's
    tokens are split evenly over its replicas. token_ids defaults to the row index over the leading axes
    (arange over the flattened tokens); pass global ids (e.g. rank * T + arange(T)) for a spread that does
    not repeat on every rank. Physical slot s lives on rank s // slots_per_rank.

    slot_active: optional [num_slots] bool (e.g. a rank mask repeated over each rank's slots): picks go
    only to an expert's active replicas, split evenly over them; an expert with none keeps the split over
    all (those picks are dropped by the exchange, as without replicas).

    Ids that name no expert stay invalid, so dispatch treats them as it does without a placement (unused
    slots; an error in checked mode): a negative id is passed through, an id >= E becomes num_slots.
    """
    topk_idx = jnp.asarray(topk_idx)
    token_shape = topk_idx.shape[:-1]
    if token_ids is None:
        token_ids = jnp.arange(int(np.prod(token_shape)), dtype=jnp.int32).reshape(token_shape)
    token_ids = jnp.asarray(token_ids)
    if token_ids.shape != token_shape:
        raise EPValueError(f"token_ids.shape={token_ids.shape} must equal topk_idx.shape[:-1]={token_shape}")
    counts = jnp.asarray(placement.replica_counts, jnp.int32)
    table = jnp.asarray(placement.logical_to_physical, jnp.int32)
    num_experts, num_slots = table.shape[0], placement.num_slots
    if slot_active is not None:
        slot_active = jnp.asarray(slot_active)
        if slot_active.shape != (num_slots,):
            raise EPValueError(f"slot_active.shape={slot_active.shape} must be (num_slots,)=({num_slots},)")
        live = (table >= 0) & (slot_active[jnp.maximum(table, 0)] != 0)
        # each expert's active replicas first (stable: ascending slots); with none the row is unchanged
        table = jnp.take_along_axis(table, jnp.argsort(~live, axis=1, stable=True), axis=1)
        live_counts = live.sum(axis=1, dtype=jnp.int32)
        counts = jnp.where(live_counts > 0, live_counts, counts)
    unused = (topk_idx < 0) | (topk_idx >= num_experts)
    logical = jnp.where(unused, 0, topk_idx)
    replica = jnp.remainder(token_ids[..., None].astype(jnp.int32), counts[logical])
    physical = table[logical, replica]
    return jnp.where(unused, jnp.where(topk_idx < 0, topk_idx, num_slots), physical).astype(jnp.int32)


def physical_to_rank(physical_idx: jax.Array, placement: Placement) -> jax.Array:
    """EP rank of each physical slot id; -1 for an id that names no slot (< 0 or >= num_slots)."""
    invalid = (physical_idx < 0) | (physical_idx >= placement.num_slots)
    return jnp.where(invalid, -1, physical_idx // placement.slots_per_rank).astype(jnp.int32)
