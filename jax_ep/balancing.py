"""Expert load balancing for MoE training: expert counts, aux-loss-free bias updates and the sequence-wise
aux loss, and `BalancingConfig`, the MoE layer's balancing settings.

All functions are pure and framework-light (arrays in, arrays out): a Flax module keeps the state
(selection bias, per-expert loads) in non-trainable variables and calls these to update it.

Formulas (DeepSeek-V3, arXiv:2412.19437, section 2.1.2), with E routed experts and K = top-k:

* aux-loss-free balancing: after each step, `b_i <- b_i + rate * sign(mean_j(load_j) - load_i)`: experts
  that received fewer tokens than average become more attractive to the selection (`gating.route` adds
  `b` to the scores for selection only).
* sequence-wise balance loss, per sequence of T tokens, averaged over sequences:
      L = alpha * sum_i f_i * P_i
      f_i = E / (K * T) * sum_t 1[expert i in top-k of token t]       (1 for every expert when balanced)
      P_i = 1 / T * sum_t s'_{i,t},  s'_{i,t} = s_{i,t} / sum_j s_{j,t}  (normalised affinity scores)
  Only P carries gradient (f counts discrete choices). A perfectly balanced sequence gives L = alpha.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.errors import EPValueError
from jax_ep.gating import _normalise


@dataclasses.dataclass(frozen=True)
class BalancingConfig:
    """How an MoE layer balances its experts (hashable; both off by default).

    Attributes:
      bias_update_rate: step of the aux-loss-free bias update after each call (`update_bias`; DeepSeek-V3
        uses 1e-3); 0 = no bias balancing.
      aux_loss_alpha: coefficient of the sequence-wise aux loss (`sequence_aux_loss`; DeepSeek-V3 uses
        1e-4); 0 = no aux loss.
    """

    bias_update_rate: float = 0.0
    aux_loss_alpha: float = 0.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            # one type in the hash and the jit cache
            object.__setattr__(self, field.name, _finite_rate(f"BalancingConfig.{field.name}",
                                                              getattr(self, field.name)))


def _finite_rate(what: str, value) -> float:
    """A rate or coefficient given as a number: finite and >= 0, as a Python float. numbers.Real: NumPy's
    float32 / int64 scalars too (float32 was refused as not a number); np.bool_ is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0:
        raise EPValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _checked_rate(what: str, value):
    """``_finite_rate`` of a number given to a function; an array (traced, e.g. a schedule; or NumPy's) as it
    is. A NaN
    rate made every bias NaN (then every token picked experts 0 and 1), a negative one reversed the
    balancing, a NaN alpha made the loss NaN, without a word (found by a fuzzer, 2026-12-06)."""
    return value if isinstance(value, (jax.Array, np.ndarray)) else _finite_rate(what, value)


def _check_token_mask(token_mask) -> None:
    """token_mask is bool (an int mask's bits were and-ed with the slots' validity: [2, 1, 0] counted the
    last token only; a float mask failed in JAX's bitwise_and naming no argument)."""
    if token_mask is not None and token_mask.dtype != jnp.bool_:
        raise EPValueError(f"token_mask must be bool (False for padding tokens), got {token_mask.dtype}")


def _check_num_experts(name: str, array: jax.Array, num_experts: int) -> None:
    if array.shape[-1] != num_experts:
        raise EPValueError(f"{name}.shape[-1]={array.shape[-1]} does not match num_experts={num_experts} "
                           f"({name}.shape={array.shape})")


# ---------------------------------------------------------------------------------------------------------
# Per-step expert loads
# ---------------------------------------------------------------------------------------------------------
def expert_counts(topk_idx: jax.Array, num_experts: int, *, token_mask: jax.Array | None = None,
                  axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Tokens routed to each expert: [E] int32 from topk_idx [..., K]. An id outside [0, E) is an unused
    slot (-1 by convention) and not counted, as dispatch reads it (docs/api.md, "Sanitising"; checked
    mode's dispatch refuses ids other than -1 there).

    token_mask: optional [...] bool, False for padding tokens (not counted).
    axis_name: mesh axis (or axes) to sum over inside shard_map/pmap, so every rank sees the global load.
    """
    if num_experts < 1:
        raise EPValueError(f"num_experts must be positive, got {num_experts}")
    valid = topk_idx >= 0
    if token_mask is not None:
        if token_mask.shape != topk_idx.shape[:-1]:
            raise EPValueError(f"token_mask.shape={token_mask.shape} must equal topk_idx.shape[:-1]="
                               f"{topk_idx.shape[:-1]}")
        _check_token_mask(token_mask)
        valid = valid & token_mask[..., None]
    # Integer scatter-add: exact and order-independent (deterministic), no [T, K, E] one-hot in memory.
    # Invalid slots are sent out of bounds and dropped.
    target = jnp.where(valid, topk_idx, num_experts).reshape(-1)
    counts = jnp.zeros((num_experts,), jnp.int32).at[target].add(1, mode="drop")
    if axis_name is not None:
        counts = jax.lax.psum(counts, axis_name)
    return counts


def gather_expert_counts(local_expert_counts: jax.Array, axis_name: str) -> jax.Array:
    """Global [E] loads from each rank's `Dispatched.expert_counts` [E_local] (inside shard_map).

    Uses the unpadded counts (`group_sizes` includes `expert_alignment` padding and would overstate loads).
    Experts are laid out contiguously per rank, so a tiled all_gather puts them in global order.
    """
    return jax.lax.all_gather(local_expert_counts, axis_name, tiled=True)


def imbalance(load: jax.Array) -> jax.Array:
    """max(load) / mean(load) over the last axis (1 = perfectly balanced); 1 where nothing was routed."""
    load = load.astype(jnp.float32)
    mean = load.mean(axis=-1)
    peak = load.max(axis=-1)
    safe_mean = jnp.where(mean > 0, mean, 1.0)
    return jnp.where(mean > 0, peak / safe_mean, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Aux-loss-free balancing
# ---------------------------------------------------------------------------------------------------------
def update_bias(bias: jax.Array, expert_load: jax.Array, rate: float, active: jax.Array | None = None
                ) -> jax.Array:
    """bias + rate * sign(mean(load) - load): raise the bias of underloaded experts, lower overloaded ones.

    Use the global load (sum over data/EP ranks, e.g. `expert_counts(..., axis_name=...)`) so every rank
    applies the same update. ``active`` (bool [E], optional): the experts the call could reach (e.g. not
    on a masked rank); the others keep their bias and stay out of the mean (their load of 0 is no
    underload: raising their bias would send ever more picks to where they are dropped). Returns
    float32; no gradient flows through it.
    """
    rate = _checked_rate("update_bias: rate", rate)
    if bias.shape != expert_load.shape or bias.ndim != 1:
        raise EPValueError(f"bias.shape={bias.shape} and expert_load.shape={expert_load.shape} must be the "
                           "same [E]")
    if active is not None and active.shape != bias.shape:
        raise EPValueError(f"active.shape={active.shape} must be bias.shape={bias.shape}")
    load = jax.lax.stop_gradient(expert_load).astype(jnp.float32)
    if active is None:
        step = jnp.sign(load.mean() - load)
    else:
        active = active.astype(bool)
        mean = jnp.sum(jnp.where(active, load, 0.0)) / jnp.maximum(jnp.sum(active), 1)
        step = jnp.where(active, jnp.sign(mean - load), 0.0)
    return jax.lax.stop_gradient(bias).astype(jnp.float32) + jnp.float32(rate) * step


# ---------------------------------------------------------------------------------------------------------
# Sequence-wise auxiliary balance loss
# ---------------------------------------------------------------------------------------------------------
def sequence_aux_loss(scores: jax.Array, topk_idx: jax.Array, num_experts: int, alpha: float, *,
                      token_mask: jax.Array | None = None, sequence_length: int | None = None) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (formula in the module docstring), averaged over the
    sequences that hold a token (a sequence of padding only counts in no statistic).

    Args:
      scores: [B, S, E] router scores (softmax or sigmoid, before any bias); [S, E] is one sequence, or
        [T, E] with `sequence_length` = S splits T into T // S sequences.
      topk_idx: [B, S, K] (same leading shape as scores) chosen experts; -1 slots are ignored.
      num_experts: E (checked against scores).
      alpha: the loss coefficient (DeepSeek-V3 uses a very small one, e.g. 1e-4).
      token_mask: optional [B, S] bool; padding tokens (False) count neither in f, P nor T.
      sequence_length: see `scores`.

    Returns:
      scalar float32 loss; differentiable with respect to scores.
    """
    total, sequences = sequence_aux_terms(scores, topk_idx, num_experts, alpha, token_mask=token_mask,
                                          sequence_length=sequence_length)
    return total / jnp.maximum(sequences, 1.0)


def sequence_aux_terms(scores: jax.Array, topk_idx: jax.Array, num_experts: int, alpha: float, *,
                       token_mask: jax.Array | None = None,
                       sequence_length: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(the sum of ``sequence_aux_loss``'s per-sequence losses, the number of sequences that hold a token),
    float32 scalars: what shards of the tokens add up (psum both, then divide) for the loss over all of
    them. Arguments as ``sequence_aux_loss``'s."""
    _check_num_experts("scores", scores, num_experts)
    alpha = _checked_rate("sequence_aux_loss: alpha", alpha)
    if scores.shape[:-1] != topk_idx.shape[:-1]:
        raise EPValueError(
            f"scores.shape={scores.shape} and topk_idx.shape={topk_idx.shape} must agree on the "
            "token axes")
    if token_mask is not None and token_mask.shape != scores.shape[:-1]:
        raise EPValueError(f"token_mask.shape={token_mask.shape} must equal scores.shape[:-1]="
                           f"{scores.shape[:-1]}")
    _check_token_mask(token_mask)
    num_topk = topk_idx.shape[-1]
    if sequence_length is not None:
        if isinstance(sequence_length, bool) or not isinstance(sequence_length, numbers.Integral) \
                or sequence_length < 1:
            raise EPValueError(f"sequence_length must be None or a positive int, got {sequence_length!r}")
        if scores.ndim != 2 or scores.shape[0] % sequence_length:
            raise EPValueError(f"sequence_length={sequence_length} needs scores of shape [T, E] with T a "
                               f"multiple of it, got scores.shape={scores.shape}")
        num_seq = scores.shape[0] // sequence_length
        scores = scores.reshape(num_seq, sequence_length, num_experts)
        topk_idx = topk_idx.reshape(num_seq, sequence_length, num_topk)
        if token_mask is not None:
            token_mask = token_mask.reshape(num_seq, sequence_length)
    if scores.ndim == 2:
        scores, topk_idx = scores[None], topk_idx[None]
        token_mask = None if token_mask is None else token_mask[None]
    if scores.ndim != 3:
        raise EPValueError(f"scores must be [S, E], [B, S, E] or [T, E] with sequence_length, "
                           f"got {scores.shape}")

    scores = scores.astype(jnp.float32)
    mask = (jnp.ones(scores.shape[:-1], jnp.float32) if token_mask is None
            else token_mask.astype(jnp.float32))                                  # [B, S]
    num_tokens = jnp.maximum(mask.sum(axis=-1), 1.0)                              # [B] guards empty sequences
    # padding tokens' scores out before any arithmetic: NaN * 0 is NaN (a NaN in padding made the loss and
    # the router's gradient NaN); a where on the input passes them a zero gradient, not NaN
    scores = jnp.where(mask[..., None] > 0, scores, 0.0)

    # Selections per (sequence, expert) by scatter-add: whole numbers, so the float sum is exact in any
    # order. Unused slots (-1) and padding tokens are sent out of bounds and dropped.
    num_seq = scores.shape[0]
    valid = (topk_idx >= 0) & (mask[..., None] > 0)
    target = jnp.where(valid, topk_idx, num_experts)
    seq_of_slot = jnp.broadcast_to(jnp.arange(num_seq)[:, None, None], target.shape)
    chosen = jnp.zeros((num_seq, num_experts), jnp.float32).at[seq_of_slot, target].add(1.0, mode="drop")
    f = num_experts / (num_topk * num_tokens[:, None]) * chosen                            # [B, E]

    normalised = _normalise(scores)   # the router's normalisation (a row of tiny sigmoid scores sums to 1)
    p = (normalised * mask[..., None]).sum(axis=1) / num_tokens[:, None]                   # [B, E]
    per_sequence = jnp.sum(f * p, axis=-1)                                                 # [B]
    # a sequence of padding only is no sequence: counting it (as 0) scaled the loss down by real / all
    holds = mask.sum(axis=-1) > 0
    return (jnp.float32(alpha) * jnp.sum(jnp.where(holds, per_sequence, 0.0)),
            jnp.sum(holds, dtype=jnp.float32))
