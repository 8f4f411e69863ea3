"""The arrays the ops exchange. All are per-rank views (inside shard_map over the EP axis).

Shapes: T tokens on this rank, K = num_topk, H = hidden, R = EP size, E = num_experts,
E_local = E / R, C = capacity (receive rows on this rank).
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class Layout(NamedTuple):
    """Where this rank's tokens go (DeepEP's get_dispatch_layout)."""

    num_tokens_per_rank: jax.Array    # [R] int32: tokens of this rank sent to each rank (once per rank)
    num_tokens_per_expert: jax.Array  # [E] int32: tokens of this rank that picked each expert
    is_token_in_rank: jax.Array       # [T, R] bool: token t travels to rank r


class Handle(NamedTuple):
    """What combine (and the backward passes) need from dispatch. Arrays only.

    A received token is named by its slot n = src_rank * T + src_token.
    """

    src_index: jax.Array         # [C] int32: slot n of the token each receive row holds; -1 = empty row
    token_rows: jax.Array        # [R*T, K] int32: receive row of (slot n, top-k slot k); -1 = not routed
                                 # here, -2 = routed here but dropped for lack of capacity
    is_token_in_rank: jax.Array  # [T, R] bool: source side, token t was sent to rank r
    row_weights: jax.Array       # [C] float32: gate weight of each receive row (0 for empty rows)


class Dispatched(NamedTuple):
    """Result of dispatch on one rank: expert-major rows ready for jax.lax.ragged_dot."""

    x: jax.Array                  # [C, H] rows (x's dtype, bfloat16 or float8_e4m3fn)
    scales: jax.Array | None      # [C, ceil(H/128)] float32 for FP8 rows, else None
    group_sizes: jax.Array        # [E_local] int32 rows per local expert, padded to expert_alignment
    expert_counts: jax.Array      # [E_local] int32 rows per local expert actually received (unpadded)
    row_weights: jax.Array        # [C] float32 gate weight per row (same array as handle.row_weights)
    num_dropped: jax.Array        # [] int32 rows this rank dropped for lack of capacity
    handle: Handle
