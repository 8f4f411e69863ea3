"""Flax NNX Mixture-of-Experts layer on jax_ep's dispatch/combine.

Router (linear -> softmax/sigmoid -> top-k, optional DeepSeek-V3 group-limited selection and
auxiliary-loss-free balancing bias), experts as stacked SwiGLU weights sharded along the EP axis and
run with ``jax.lax.ragged_dot`` on the expert-major rows, optional shared expert.

Two ways to call it:
  * ``MoE(..., mesh=mesh)``: from a plain ``jax.jit`` model with global arrays; the layer enters
    ``shard_map`` itself (tokens sharded over the batch axes, experts over the EP axis).
  * ``MoE(..., mesh=None)``: from inside your own ``shard_map`` body (per-rank view); the expert
    weights you pass in must be this rank's shard (``num_experts / ep_size`` experts).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ep import balancing, gating
from jax_ep.config import EPConfig
from jax_ep.ops import combine, dispatch
from jax_ep.reference import dequantize_fp8


class ExpertBias(nnx.Variable):
    """Per-expert selection bias of auxiliary-loss-free balancing (not trained by gradients)."""


class ExpertLoad(nnx.Variable):
    """Load statistics: tokens per expert in the last step and accumulated over steps."""


class MoEStats(NamedTuple):
    expert_load: jax.Array   # [E] int32 rows each expert received this call (all ranks)
    num_dropped: jax.Array   # [] int32 rows dropped for lack of capacity (all ranks)
    aux_loss: jax.Array      # [] float32 sequence-wise auxiliary loss (0 when disabled)


class MoE(nnx.Module):
    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, num_topk: int, *,
                 rngs: nnx.Rngs, mesh: Mesh | None = None, axis_name: str = "ep",
                 batch_axes: tuple[str, ...] | None = None,
                 score_func: str = "softmax", num_groups: int = 1, topk_groups: int | None = None,
                 max_ranks_per_token: int | None = None, routed_scaling_factor: float = 1.0,
                 normalize_topk: bool = True, shared_ffn_hidden: int = 0,
                 capacity: int | None = None, expert_alignment: int = 1,
                 dispatch_dtype: str | None = None, num_sms: int = 24, backend: str = "auto",
                 checked: bool = False, bias_update_rate: float = 0.0, aux_loss_alpha: float = 0.0,
                 param_dtype=jnp.float32):
        if mesh is not None and axis_name not in mesh.axis_names:
            raise ValueError(f"MoE: axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.num_experts, self.num_topk = num_experts, num_topk
        self.mesh, self.axis_name = mesh, axis_name
        # tokens are split over every mesh axis by default (data x ep); experts over the EP axis only
        self.batch_axes = tuple(batch_axes) if batch_axes is not None else (
            tuple(mesh.axis_names) if mesh is not None else (axis_name,))
        self.router_options = dict(score_func=score_func, num_groups=num_groups, topk_groups=topk_groups,
                                   max_ranks_per_token=max_ranks_per_token,
                                   routed_scaling_factor=routed_scaling_factor,
                                   normalize_topk=normalize_topk)
        gating.RouterConfig(num_experts, num_topk, **self.router_options)  # validate early
        self.ep_options = dict(capacity=capacity, expert_alignment=expert_alignment,
                               dispatch_dtype=dispatch_dtype, num_sms=num_sms, backend=backend,
                               checked=checked)
        self.bias_update_rate, self.aux_loss_alpha = bias_update_rate, aux_loss_alpha

        init = nnx.initializers.lecun_normal()
        expert_spec = (axis_name, None, None)
        self.router = nnx.Param(init(rngs.params(), (hidden, num_experts), param_dtype))
        self.w_gate = nnx.Param(init(rngs.params(), (num_experts, hidden, ffn_hidden), param_dtype),
                                out_sharding=expert_spec, eager_sharding=False)
        self.w_up = nnx.Param(init(rngs.params(), (num_experts, hidden, ffn_hidden), param_dtype),
                              out_sharding=expert_spec, eager_sharding=False)
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, ffn_hidden, hidden), param_dtype),
                                out_sharding=expert_spec, eager_sharding=False)
        self.shared = nnx.data(SwiGLU(hidden, shared_ffn_hidden, rngs=rngs, param_dtype=param_dtype)
                               if shared_ffn_hidden else None)
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32))
        self.last_load = ExpertLoad(jnp.zeros((num_experts,), jnp.int32))
        self.total_load = ExpertLoad(jnp.zeros((num_experts,), jnp.float32))
        self.last_dropped = ExpertLoad(jnp.zeros((), jnp.int32))
        self.last_aux_loss = ExpertLoad(jnp.zeros((), jnp.float32))

    # ---------------------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, update_stats: bool = True) -> jax.Array:
        """x: [..., hidden] (global if the layer has a mesh, this rank's tokens otherwise)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE: x has hidden size {x.shape[-1]}, the layer expects {self.hidden}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, self.hidden)
        seq_len = lead[-1] if len(lead) >= 2 else None  # None: this rank's tokens are one sequence
        params = (self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...],
                  self.expert_bias[...])
        if self.mesh is None:
            out, stats = self._per_rank(tokens, *params, seq_len=seq_len)
            stats = MoEStats(*stats)
        else:
            batch = P(self.batch_axes)
            experts = P(self.axis_name)
            body = jax.shard_map(
                lambda *a: self._per_rank(*a, seq_len=seq_len), mesh=self.mesh,
                in_specs=(batch, P(), experts, experts, experts, P()),
                out_specs=(batch, (P(), P(), P())))
            out, stats = body(tokens, *params)
            stats = MoEStats(*stats)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if update_stats:
            self._record(stats)
        return out.reshape(*lead, self.hidden)

    @property
    def aux_loss(self) -> jax.Array:
        """Sequence-wise auxiliary balance loss of the last call (0 unless aux_loss_alpha > 0).
        Add it to the training loss to use it instead of (or with) bias balancing."""
        return self.last_aux_loss[...]

    def _record(self, stats: MoEStats) -> None:
        self.last_load[...] = stats.expert_load
        self.total_load[...] = self.total_load[...] + stats.expert_load.astype(jnp.float32)
        self.last_dropped[...] = stats.num_dropped
        self.last_aux_loss[...] = stats.aux_loss
        if self.bias_update_rate:
            self.expert_bias[...] = balancing.update_bias(
                self.expert_bias[...], stats.expert_load.astype(jnp.float32), self.bias_update_rate)

    def _per_rank(self, x, router, w_gate, w_up, w_down, bias, *, seq_len):
        ep_size = lax.axis_size(self.axis_name)
        local_experts = self.num_experts // ep_size
        if w_gate.shape[0] != local_experts:
            raise ValueError(f"MoE: this rank holds {w_gate.shape[0]} experts but num_experts / ep_size = "
                             f"{local_experts}; inside your own shard_map pass expert weights with "
                             f"PartitionSpec({self.axis_name!r})")
        cfg = EPConfig(num_experts=self.num_experts, num_topk=self.num_topk, hidden=self.hidden,
                       max_tokens_per_rank=x.shape[0], axis_name=self.axis_name, **self.ep_options)
        router_cfg = gating.RouterConfig(self.num_experts, self.num_topk, ep_size=ep_size,
                                         **self.router_options)
        logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
        routing = gating.route(logits, router_cfg, lax.stop_gradient(bias))

        d = dispatch(x, routing.topk_idx, routing.topk_weights, cfg)
        rows = d.x if d.scales is None else dequantize_fp8(d.x, d.scales, x.dtype)
        rows = rows.astype(x.dtype)
        gate = lax.ragged_dot(rows, w_gate.astype(x.dtype), d.group_sizes)
        up = lax.ragged_dot(rows, w_up.astype(x.dtype), d.group_sizes)
        y = lax.ragged_dot(jax.nn.silu(gate) * up, w_down.astype(x.dtype), d.group_sizes)
        out = combine(y.astype(x.dtype), d.handle, cfg)

        # statistics: every rank's counts placed at its experts, summed over all token shards
        rank = lax.axis_index(self.axis_name)
        my_experts = rank * local_experts + jnp.arange(local_experts)
        placed = jnp.zeros((self.num_experts,), jnp.int32).at[my_experts].set(d.expert_counts)
        load = lax.psum(placed, self.batch_axes)
        dropped = lax.psum(d.num_dropped, self.batch_axes)
        aux = jnp.zeros((), jnp.float32)
        if self.aux_loss_alpha:
            aux = balancing.sequence_aux_loss(routing.scores, routing.topk_idx, self.num_experts,
                                              self.aux_loss_alpha, sequence_length=seq_len)
            aux = lax.pmean(aux, self.batch_axes)
        return out, (load, dropped, aux)


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN (the shared expert)."""

    def __init__(self, hidden: int, ffn_hidden: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        init = nnx.initializers.lecun_normal()
        self.w_gate = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (hidden, ffn_hidden), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (ffn_hidden, hidden), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(x @ self.w_gate[...].astype(x.dtype)) * (x @ self.w_up[...].astype(x.dtype))
        return h @ self.w_down[...].astype(x.dtype)
