"""A small decoder-only language model with MoE FFN layers (used by examples/demo.py, examples/train_moe.py,
examples/decode_moe.py and the tests; import it with examples/ on sys.path, as those scripts have).

Training: ``model(tokens)`` on whole sequences. Decoding (greedy or sampled, one token per step):
``model.init_cache(batch, max_length)``, then ``model.prefill(prompts)`` (one forward over the prompts
that fills each attention layer's key/value cache) and ``model.decode_step(tokens[:, None])`` per new
token (attention over the cache, Flax's ``MultiHeadAttention`` decode mode; the MoE layers on jax_ep's
low-latency ops)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import remat
from jax_ep.balancing import BalancingConfig
from jax_ep.gating import RouterConfig
from jax_ep.moe import EPOptions, MoE


@dataclasses.dataclass(frozen=True)
class LMConfig:
    # the transformer
    vocab: int = 256            # bytes
    hidden: int = 64
    num_heads: int = 4
    num_layers: int = 2
    # each block's MoE FFN: expert sizes, then its RouterConfig, BalancingConfig and EPOptions
    ffn_hidden: int = 128
    shared_ffn_hidden: int = 0
    moe_dtype: str | None = None  # compute dtype of the routed experts (None: the model's float32)
    num_experts: int = 16
    num_topk: int = 2
    score_func: str = "softmax"
    num_groups: int = 1
    topk_groups: int | None = None
    bias_update_rate: float = 0.0
    aux_loss_alpha: float = 0.0
    backend: str = "auto"
    dispatch_dtype: str | None = None
    # each block rematerialised in the backward (nnx.remat), keeping dispatch's results
    # (jax_ep.remat.policy(): the rerun holds no exchange), its MoE without EPOptions.dy_in_place (whose
    # buffer, the down GEMM's output, the rerun would compute again)
    remat: bool = False


class Block(nnx.Module):
    def __init__(self, cfg: LMConfig, mesh: Mesh | None, axis_name: str, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.hidden, decode=False, use_bias=False,
                                           rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        routing = RouterConfig(cfg.num_experts, cfg.num_topk, score_func=cfg.score_func,
                               num_groups=cfg.num_groups, topk_groups=cfg.topk_groups)
        self.moe = MoE(cfg.hidden, cfg.ffn_hidden, routing, rngs=rngs, mesh=mesh, axis_name=axis_name,
                       ep=EPOptions(backend=cfg.backend, dispatch_dtype=cfg.dispatch_dtype,
                                    dy_in_place=not cfg.remat),
                       balancing=BalancingConfig(cfg.bias_update_rate, cfg.aux_loss_alpha),
                       shared_ffn_hidden=cfg.shared_ffn_hidden, dtype=cfg.moe_dtype)

    def __call__(self, x, mask):
        x = x + self.attn(self.attn_norm(x), mask=mask)
        return x + self.moe(self.ffn_norm(x))

    def prefill(self, x, mask):
        """The forward of ``__call__`` on a whole prompt [B, S, H], writing its keys and values to the
        cache (positions 0..S-1; the next decode step is position S). The MoE layer runs the throughput
        ops and records no statistics (inference)."""
        h = self.attn_norm(x)
        attn = self.attn
        if attn.cached_key is None:
            raise ValueError("prefill: the key/value cache is not initialised; call init_cache first")
        if h.shape[1] > attn.cached_key.shape[1]:
            raise ValueError(f"prefill: a prompt of {h.shape[1]} tokens does not fit the cache's "
                             f"max_length {attn.cached_key.shape[1]}")
        for cache, proj in ((attn.cached_key, attn.key), (attn.cached_value, attn.value)):
            cache[...] = lax.dynamic_update_slice(cache[...], proj(h).astype(cache[...].dtype), (0, 0, 0, 0))
        attn.cache_index[...] = jnp.array(h.shape[1], jnp.int32)
        x = x + attn(h, mask=mask)
        return x + self.moe(self.ffn_norm(x), update_stats=False)

    def decode_step(self, x, *, low_latency: bool = True):
        """One new token per sequence, x [B, 1, H]: attention over the cache (which it extends by this
        position), then the MoE layer on the low-latency ops (``low_latency=False``: the throughput ops).
        Past the cache's max_length the result is NaN: Flax would overwrite its last position and give
        wrong values without a word."""
        if self.attn.cached_key is None:
            raise ValueError("decode_step: the key/value cache is not initialised; call init_cache first")
        full = self.attn.cache_index[...] >= self.attn.cached_key.shape[1]
        x = x + self.attn(self.attn_norm(x), decode=True)
        x = x + self.moe(self.ffn_norm(x), decode=low_latency, update_stats=False)
        return jnp.where(full, jnp.nan, x)


class MoETransformerLM(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None, axis_name: str = "ep"):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, mesh, axis_name, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            if self.cfg.remat:
                x = nnx.remat(lambda block, x, mask: block(x, mask), policy=remat.policy())(block, x, mask)
            else:
                x = block(x, mask)
        return self.embed.attend(self.norm(x))

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    # ---- decoding with a key/value cache ----------------------------------------------------------
    def init_cache(self, batch: int, max_length: int, *, mesh: Mesh | None = None) -> None:
        """An empty key/value cache [batch, max_length, heads, head_dim] in every attention layer (Flax's
        ``MultiHeadAttention.init_cache``, float32 as the attention computes: its decode mode writes its
        keys as they are, so a cache of another dtype failed at the first decode step, and the dtype
        argument this took until 2026-12-06 is gone), split over every axis of ``mesh`` along the batch, as
        the tokens are (None: where JAX puts it)."""
        for block in self.blocks:
            block.attn.init_cache((batch, max_length, self.cfg.hidden), jnp.float32)
            if mesh is not None:
                attn = block.attn
                batch_split = NamedSharding(mesh, P(tuple(mesh.axis_names)))
                for cache in (attn.cached_key, attn.cached_value):
                    cache[...] = jax.device_put(cache[...], batch_split)
                attn.cache_index[...] = jax.device_put(attn.cache_index[...], NamedSharding(mesh, P()))

    def prefill(self, tokens: jax.Array) -> jax.Array:
        """Logits [B, S, vocab] of the prompts tokens [B, S] (as ``__call__``), filling the key/value cache
        with them: the next ``decode_step`` is position S. Needs ``init_cache`` first."""
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block.prefill(x, mask)
        return self.embed.attend(self.norm(x))

    def decode_step(self, tokens: jax.Array, *, low_latency: bool = True) -> jax.Array:
        """Logits [B, 1, vocab] of one new token per sequence, tokens [B, 1], at the cache's position (then
        one further). The MoE layers run jax_ep's low-latency ops (``low_latency=False``: the throughput
        ops, as in training: the same logits as ``__call__`` on the whole sequence, to float32 rounding).
        NaN once the cache's max_length positions are used up (``init_cache``)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block.decode_step(x, low_latency=low_latency)
        return self.embed.attend(self.norm(x))

    def aux_loss(self) -> jax.Array:
        return sum(layer.aux_loss for layer in self.moe_layers())


def next_token_loss(model: MoETransformerLM, batch: jax.Array) -> jax.Array:
    logits = model(batch[:, :-1])
    labels = batch[:, 1:]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), labels[..., None], -1)
    return jnp.mean(ce) + model.aux_loss()


def say(*args, **kwargs) -> None:
    """print, on process 0 only (a script started as several processes by python -m jax_ep.launch)."""
    if jax.process_index() == 0:
        print(*args, **kwargs, flush=True)


def shard_model(module: nnx.Module, mesh: Mesh) -> None:
    """Place every variable by its sharding metadata (experts over the EP axis, the rest replicated)."""
    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))


def gpu_moe_dtype() -> str | None:
    """bfloat16 experts on GPUs (the Hopper grouped GEMM takes bf16/fp16), the model's float32 elsewhere."""
    return "bfloat16" if jax.default_backend() == "gpu" else None


def build_training(cfg: LMConfig, mesh: Mesh, lr: float, seed: int = 0):
    """A sharded model, its AdamW optimizer and a jitted train step ``step(model, optimizer, batch)``."""
    model = MoETransformerLM(cfg, rngs=nnx.Rngs(seed), mesh=mesh)
    shard_model(model, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    shard_model(optimizer, mesh)  # its step count too: otherwise step 2 recompiles for a new sharding

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, train_step


def timed_steps(train_step, model, optimizer, data, sharding: NamedSharding, steps: int):
    """Runs ``steps`` train steps on the batches of ``data`` (put with ``sharding``); yields (step, loss,
    seconds) for each, the seconds from the call of the step to its loss on the host."""
    for step in range(steps):
        batch = jax.device_put(next(data), sharding)
        start = time.perf_counter()
        loss = float(train_step(model, optimizer, batch))
        yield step, loss, time.perf_counter() - start


def warm_median(step_times: list[float]) -> float:
    """The median of the second half of the step times: the step time once compiled."""
    return float(np.median(step_times[len(step_times) // 2:]))


def corpus_bytes() -> np.ndarray:
    """Training text that ships with every Python: the source of a few standard-library modules."""
    import json
    import textwrap
    import typing

    text = "".join(pathlib.Path(m.__file__).read_text() for m in (textwrap, json.decoder, typing))
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int = 0):
    """Endless random windows of seq_len + 1 bytes."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, batch)
        yield np.stack([data[s:s + seq_len + 1] for s in starts])


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The examples' --help: the module docstring as written, each option with its default."""


def require_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, names,
                     minimum: int = 1) -> None:
    """A usage error (exit 2) naming the first of the options ``names`` (attribute names) below minimum."""
    for name in names:
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(args, name)}")


def require_finite(parser: argparse.ArgumentParser, args: argparse.Namespace, names, *,
                   positive: bool) -> None:
    """A usage error naming the first of the float options ``names`` that is not finite and > 0
    (``positive``) or >= 0: a NaN learning rate trained to NaN losses and exited 0."""
    for name in names:
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number {'>' if positive else '>='} 0, "
                         f"got {value}")
