"""Top-k routing (gating) for MoE layers: scores, bias-based balancing, group/node/rank-limited selection.

`route` turns router logits into the `(topk_idx, topk_weights)` pair that `jax_ep.dispatch` consumes.
It follows DeepSeek-V3:

* scores = softmax(logits) or sigmoid(logits), in float32;
* the experts are *selected* on `scores + bias` (the bias of auxiliary-loss-free balancing, see
  `jax_ep.balancing.update_bias`), but the *weights* are the unbiased scores of the chosen experts;
* group-limited routing: the experts form `num_groups` contiguous groups; each token keeps only the
  `topk_groups` groups with the highest group score (`group_score`: the sum of the group's top-2
  selection scores, DeepSeek-V3, or the best one, DeepSeek-V2's rule and DeepSeek's reference `Gate`
  without a bias);
* node cap (DeepSeek-V3's node-limited routing): EP rank r lives on node r // ranks_per_node; each token
  keeps only the `max_nodes_per_token` nodes with the highest node score (sum of the node's
  top-ceil(K / max_nodes_per_token) selection scores), so a token crosses the inter-node network to at
  most that many nodes;
* rank cap (the same rule one level down, per EP rank): expert e lives on rank e // (num_experts // ep_size);
  each token keeps only the `max_ranks_per_token` ranks with the highest rank score (sum of the rank's
  top-ceil(K / max_ranks_per_token) selection scores), so a token travels to at most that many ranks and
  dispatch traffic per token is bounded;
* weights are optionally renormalised over the K chosen experts, then multiplied by
  `routed_scaling_factor`.

Everything is pure JAX: `route` works under `jit`, `vmap` and `shard_map`, and differentiates with respect
to the logits through the weights (the selection itself is piecewise constant).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.config import _is_int, check_option
from jax_ep.errors import EPValueError

SCORE_FUNCS = ("softmax", "sigmoid")
# A group's score: DeepSeek-V3 sums its two best experts (robust to one outlier expert); DeepSeek-V2 (and
# DeepSeek's reference Gate when it has no bias) takes the best one.
GROUP_SCORES = {"top2_sum": 2, "max": 1}


# One limit of `route`: keep the `units_kept` best of `num_units` contiguous units of `unit_size` experts,
# a unit scored by the sum of its `score_topn` best selection scores. `unit` ("group", "node", "rank") and
# `fields` (the config fields that set it) are for error messages.
class _Limit(NamedTuple):
    unit: str
    num_units: int
    units_kept: int
    unit_size: int
    score_topn: int
    fields: str


class Routing(NamedTuple):
    """Result of `route` for T tokens, E experts, K = num_topk."""

    topk_idx: jax.Array      # [T, K] int32 chosen experts, best first (by selection score)
    topk_weights: jax.Array  # [T, K] float32 gate weights of the chosen experts (bias never included)
    scores: jax.Array        # [T, E] float32 softmax/sigmoid scores (no bias); feed to the aux loss


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Static routing configuration (hashable, so it can be a jit static argument).

    Attributes:
      num_experts: E, routed experts across the whole EP group.
      num_topk: K, experts each token picks.
      score_func: "softmax" (over all E experts) or "sigmoid" (independent per expert, DeepSeek-V3).
      normalize_topk: renormalise the K chosen scores to sum to 1 before scaling.
      routed_scaling_factor: multiplies the final weights (DeepSeek-V3 uses 2.5 with sigmoid scores).
      num_groups: G contiguous expert groups for group-limited routing (1 = no groups).
      topk_groups: groups each token may use; None (default): every group, no limit (`groups_per_token`).
      max_ranks_per_token: EP ranks one token may reach (None = no cap; a value >= ep_size is no cap).
      ep_size: EP ranks the experts are spread over, contiguously (expert e on rank e // (E // ep_size));
        only the rank and node caps use it. The MoE layer sets it to its EP size.
      ranks_per_node: EP ranks per node (node n holds EP ranks n * ranks_per_node ... + ranks_per_node - 1),
        a property of the cluster: `jax.local_device_count()` with one process driving a node's GPUs, the
        number of processes per node with one process per GPU. ep_size and ranks_per_node must divide one
        another (an EP group smaller than a node is one node). None: not known (one node); only the node
        cap uses it.
      max_nodes_per_token: nodes one token may reach (DeepSeek-V3's node-limited routing; None = no cap;
        a value >= the number of nodes, ep_size / ranks_per_node, is no cap). Needs ranks_per_node.
      group_score: how a group is scored for `topk_groups`: "top2_sum" (default, DeepSeek-V3: the sum of
        its two best selection scores) or "max" (DeepSeek-V2: its best one).
    """

    num_experts: int
    num_topk: int
    score_func: str = "softmax"
    normalize_topk: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int | None = None
    max_ranks_per_token: int | None = None
    ep_size: int = 1
    ranks_per_node: int | None = None
    max_nodes_per_token: int | None = None
    group_score: str = "top2_sum"   # last: added 2026-12-05, positional arguments keep their meaning

    def __post_init__(self):
        for name in ("num_experts", "num_topk", "num_groups", "ep_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise EPValueError(f"RouterConfig.{name} must be a positive int, got {value!r}")
        if self.score_func not in SCORE_FUNCS:
            raise EPValueError(
                f"RouterConfig.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if not isinstance(self.normalize_topk, (bool, np.bool_)):
            raise EPValueError(f"RouterConfig.normalize_topk must be a bool, got {self.normalize_topk!r}")
        factor = self.routed_scaling_factor
        if isinstance(factor, (bool, np.bool_)) or not isinstance(factor, numbers.Real) \
                or not math.isfinite(factor) or factor <= 0:
            raise EPValueError(f"RouterConfig.routed_scaling_factor must be a positive finite number, "
                               f"got {factor!r}")
        if self.num_topk > self.num_experts:
            raise EPValueError(
                f"RouterConfig.num_topk={self.num_topk} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_groups:
            raise EPValueError(f"RouterConfig.num_experts={self.num_experts} is not divisible by "
                               f"num_groups={self.num_groups}")
        if self.num_experts % self.ep_size:
            raise EPValueError(f"RouterConfig.num_experts={self.num_experts} is not divisible by "
                               f"ep_size={self.ep_size}")
        # None stays None (groups_per_token resolves it): written in here, dataclasses.replace with another
        # num_groups would keep the old value and limit the groups silently
        if self.topk_groups is not None and (not _is_int(self.topk_groups)
                                             or not 1 <= self.topk_groups <= self.num_groups):
            raise EPValueError(
                f"RouterConfig.topk_groups must be an int in [1, num_groups={self.num_groups}], "
                f"got {self.topk_groups!r}")
        if self.group_score not in GROUP_SCORES:
            raise EPValueError(f"RouterConfig.group_score must be one of {tuple(GROUP_SCORES)}, got "
                               f"{self.group_score!r}")
        for name in ("max_ranks_per_token", "ranks_per_node", "max_nodes_per_token"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise EPValueError(f"RouterConfig.{name} must be None or a positive int, got {value!r}")
        if self.max_nodes_per_token is not None and self.ranks_per_node is None:
            raise EPValueError(f"RouterConfig.max_nodes_per_token={self.max_nodes_per_token} needs "
                               "ranks_per_node (EP ranks per node, e.g. jax.local_device_count())")
        if self.ranks_per_node is not None and (self.ep_size % self.ranks_per_node
                                                and self.ranks_per_node % self.ep_size):
            raise EPValueError(
                f"RouterConfig: ep_size={self.ep_size} and ranks_per_node={self.ranks_per_node} "
                "must divide one another (the EP group spans whole nodes, or lies in one node)")
        limits = self._limit_stages()
        for coarse_i, coarse in enumerate(limits):
            for fine in limits[coarse_i + 1:]:
                if coarse.unit_size % fine.unit_size:
                    # Nested partitions let a finer limit see only whole units (all or none of a unit's
                    # experts available), which is what makes the feasibility check below exact.
                    raise EPValueError(
                        f"RouterConfig: {coarse.fields} and {fine.fields} together need nested layouts: "
                        f"experts per {coarse.unit} ({coarse.unit_size}) and experts per {fine.unit} "
                        f"({fine.unit_size}) must divide one another")
        available = self.max_selectable_experts
        if self.num_topk > available:
            raise EPValueError(
                f"RouterConfig.num_topk={self.num_topk} exceeds the {available} experts a token can still "
                f"reach with {' and '.join(limit.fields for limit in limits)}")
        # valid: NumPy numbers stored as Python ones (one type in the hash and the jit cache)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, np.generic):
                object.__setattr__(self, field.name, value.item())

    # ---- derived sizes ----
    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_nodes(self) -> int:
        """Nodes the EP group spans: ep_size / ranks_per_node (1 if it fits in one node or is not known)."""
        if self.ranks_per_node is None:
            return 1
        return max(1, self.ep_size // self.ranks_per_node)

    @property
    def experts_per_node(self) -> int:
        return self.num_experts // self.num_nodes

    @property
    def groups_per_token(self) -> int:
        """The groups each token may use: ``topk_groups``, or every group where it is None."""
        return self.num_groups if self.topk_groups is None else self.topk_groups

    @property
    def group_limited(self) -> bool:
        return self.groups_per_token < self.num_groups

    @property
    def rank_limited(self) -> bool:
        return self.max_ranks_per_token is not None and self.max_ranks_per_token < self.ep_size

    @property
    def node_limited(self) -> bool:
        return self.max_nodes_per_token is not None and self.max_nodes_per_token < self.num_nodes

    def _cap_score_topn(self, cap: int, unit_size: int) -> int:
        """DeepSeek-V3's node score: a unit's ceil(K / cap) best selection scores are summed."""
        return min(-(-self.num_topk // cap), unit_size)

    @property
    def rank_score_topn(self) -> int:
        """Experts per rank whose selection scores sum to the rank score: ceil(K / max_ranks_per_token)."""
        if not self.rank_limited:
            return 0
        return self._cap_score_topn(self.max_ranks_per_token, self.experts_per_rank)

    @property
    def node_score_topn(self) -> int:
        """Experts per node whose selection scores sum to the node score: ceil(K / max_nodes_per_token)."""
        if not self.node_limited:
            return 0
        return self._cap_score_topn(self.max_nodes_per_token, self.experts_per_node)

    @property
    def max_selectable_experts(self) -> int:
        """The fewest experts left to choose from after the group, node and rank limits, over all tokens."""
        available = self.num_experts
        for limit in self._limit_stages():
            # nested layouts: the experts still available form whole units of this limit
            available = min(limit.units_kept, available // limit.unit_size) * limit.unit_size
        return available

    def _limit_stages(self) -> list[_Limit]:
        """The active limits, coarsest unit first (one code path for groups, nodes and ranks)."""
        stages = []
        if self.group_limited:
            stages.append(_Limit("group", self.num_groups, self.groups_per_token, self.experts_per_group,
                                 min(GROUP_SCORES[self.group_score], self.experts_per_group),
                                 f"topk_groups={self.topk_groups} of num_groups={self.num_groups}"))
        if self.node_limited:
            stages.append(_Limit("node", self.num_nodes, self.max_nodes_per_token, self.experts_per_node,
                                 self.node_score_topn,
                                 f"max_nodes_per_token={self.max_nodes_per_token} of {self.num_nodes} nodes "
                                 f"(ep_size={self.ep_size}, ranks_per_node={self.ranks_per_node})"))
        if self.rank_limited:
            stages.append(_Limit("rank", self.ep_size, self.max_ranks_per_token, self.experts_per_rank,
                                 self.rank_score_topn,
                                 f"max_ranks_per_token={self.max_ranks_per_token} of ep_size={self.ep_size}"))
        # Coarse first (stable: group, node, rank on equal sizes): then every fine unit is either wholly
        # inside or wholly outside the kept coarse units.
        stages.sort(key=lambda stage: -stage.unit_size)
        return stages


def expert_scores(logits: jax.Array, score_func: str) -> jax.Array:
    """softmax or sigmoid of `logits` over the last axis, in float32."""
    logits = logits.astype(jnp.float32)
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise EPValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")


def _keep_top_units(selection: jax.Array, num_units: int, units_kept: int, score_topn: int) -> jax.Array:
    """Masks (to -inf) every expert outside the `units_kept` best contiguous units of each row.

    A unit's score is the sum of its `score_topn` best selection scores; already-masked experts count as
    -inf, so a unit with a masked expert among its top-n ranks last (the stages are ordered so that this
    only happens to wholly masked units). Ties keep the lower unit index, as `lax.top_k`.
    """
    num_tokens, num_experts = selection.shape
    per_unit = selection.reshape(num_tokens, num_units, num_experts // num_units)
    unit_scores = jax.lax.top_k(per_unit, score_topn)[0].sum(axis=-1)          # [T, U]
    # +inf (a NaN logit) beside a -inf bias sums to NaN, which lax.top_k ranks last: the NaN went unpicked
    unit_scores = jnp.where(jnp.isnan(unit_scores), jnp.inf, unit_scores)
    _, kept_units = jax.lax.top_k(unit_scores, units_kept)                      # [T, kept]
    unit_mask = jnp.any(kept_units[:, :, None] == jnp.arange(num_units), axis=1)  # [T, U]
    expert_mask = jnp.repeat(unit_mask, num_experts // num_units, axis=1)       # [T, E]
    return jnp.where(expert_mask, selection, -jnp.inf)


def _nonzero_sum(weights: jax.Array) -> jax.Array:
    """The sum over the last axis, 1 where it is 0 (scores that all underflow stay 0). An epsilon added to
    it (1e-20 until 2026-12-06) made rows of tiny sigmoid scores sum to less than 1: K=1 at logits ~-46
    gave the weight 0.63 and the router a gradient (found by a fuzzer against DeepSeek's Gate)."""
    total = weights.sum(axis=-1, keepdims=True)
    return jnp.where(total > 0, total, 1.0)


@jax.custom_jvp
def _normalise(weights: jax.Array) -> jax.Array:
    """weights / their sum over the last axis (rows that sum to 0 stay 0), as DeepSeek-V3's Gate."""
    return weights / _nonzero_sum(weights)


@_normalise.defjvp
def _normalise_jvp(primals, tangents):
    # JAX's own rule for the division squares the sum: below ~1e-19 (sigmoid of K logits under ~-47) that
    # underflows to 0 and the router's gradient became inf or NaN. (dw - out * sum(dw)) / sum is the same
    # derivative with the sum to the first power only.
    (weights,), (dweights,) = primals, tangents
    total = _nonzero_sum(weights)
    out = weights / total
    return out, (dweights - out * dweights.sum(axis=-1, keepdims=True)) / total


def route(logits: jax.Array, cfg: RouterConfig, bias: jax.Array | None = None) -> Routing:
    """Picks K experts per token and their gate weights.

    Args:
      logits: [T, E] (or [..., E]) router logits, any float dtype.
      cfg: the static routing configuration.
      bias: optional [E] per-expert selection bias (aux-loss-free balancing). It shifts which experts are
        chosen, never the weights, and receives no gradient.

    Returns:
      Routing(topk_idx [..., K] int32, topk_weights [..., K] float32, scores [..., E] float32).
    """
    if np.ndim(logits) < 1:
        raise EPValueError(f"logits must be [..., E={cfg.num_experts}], got a scalar "
                           f"(shape {np.shape(logits)})")
    if logits.shape[-1] != cfg.num_experts:
        raise EPValueError(f"logits.shape[-1]={logits.shape[-1]} does not match "
                           f"RouterConfig.num_experts={cfg.num_experts} (logits.shape={logits.shape})")
    if bias is not None and np.shape(bias) != (cfg.num_experts,):
        raise EPValueError(f"bias must have shape ({cfg.num_experts},), got {np.shape(bias)}")
    lead_shape = logits.shape[:-1]
    scores = expert_scores(logits.reshape(-1, cfg.num_experts), cfg.score_func)   # [T, E]

    # Selection is piecewise constant in the logits: keep it out of the gradient on purpose.
    selection = jax.lax.stop_gradient(scores)
    if bias is not None:
        selection = selection + jax.lax.stop_gradient(jnp.asarray(bias, jnp.float32))
    # a NaN score ranks first (as torch.topk ranks it; lax.top_k ranks sigmoid's negative NaN last, so
    # a NaN logit went unpicked and the NaN never reached the output): chosen, its weight NaN
    selection = jnp.where(jnp.isnan(selection), jnp.inf, selection)
    for limit in cfg._limit_stages():
        selection = _keep_top_units(selection, limit.num_units, limit.units_kept, limit.score_topn)
    _, topk_idx = jax.lax.top_k(selection, cfg.num_topk)                       # [T, K]

    weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if cfg.normalize_topk:
        weights = _normalise(weights)
    weights = weights * jnp.float32(cfg.routed_scaling_factor)

    k = cfg.num_topk
    return Routing(topk_idx.astype(jnp.int32).reshape(*lead_shape, k),
                   weights.astype(jnp.float32).reshape(*lead_shape, k),
                   scores.reshape(*lead_shape, cfg.num_experts))


def expert_to_rank(topk_idx: jax.Array, num_experts: int, ep_size: int) -> jax.Array:
    """EP rank of each chosen expert under the contiguous layout; -1 (unused slot) stays -1."""
    num_experts = check_option("expert_to_rank:", "num_experts", num_experts, "int")
    ep_size = check_option("expert_to_rank:", "ep_size", ep_size, "int")
    if num_experts % ep_size:
        raise EPValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    ranks = topk_idx // (num_experts // ep_size)
    return jnp.where(topk_idx < 0, -1, ranks).astype(jnp.int32)
