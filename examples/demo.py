"""Train a tiny MoE language model with expert parallelism on whatever devices exist (`make demo`).

    python examples/demo.py [--steps 40] [--backend auto]
    python -m jax_ep.launch --nproc 2 --local-devices-per-process 4 examples/demo.py [...]

Without a GPU it runs on 8 virtual CPU devices. Prints the loss, tokens/s and the share of the step
time spent in dispatch/combine, after the backend each op resolved to (``--backend auto``: the CUDA
kernel or the pure-JAX reference, per op). Started as several processes (python -m jax_ep.launch,
SLURM, mpirun), it runs on every process's devices and process 0 prints.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    HelpFormatter,
    LMConfig,
    batches,
    build_training,
    corpus_bytes,
    gpu_moe_dtype,
    require_at_least,
    require_finite,
    say,
    timed_steps,
    warm_median,
)

import jax_ep.distributed
from jax_ep.balancing import imbalance
from jax_ep.config import EPConfig
from jax_ep.devices import use_virtual_cpu_devices
from jax_ep.ops import OPS, combine, dispatch

# The ops a training step runs: the forward ops and the backward ones (combine's backward broadcasts
# into y's buffer, as communication_time's layer runs it; dispatch's backward combines and gathers the
# weights' gradients with slot_values).
STEP_OPS = ("layout", "dispatch", "combine", "broadcast_in_place", "slot_values")


def median_time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def communication_time(mesh: Mesh, cfg: LMConfig, tokens_per_rank: int, backend: str) -> float:
    """Seconds for one training step's dispatch+combine, forward and backward, in every MoE layer.

    Tokens are split over every mesh axis (e.g. data x ep) and dispatched over the "ep" axis.
    """
    return median_time(*communication_program(mesh, cfg, tokens_per_rank, backend))


def communication_program(mesh: Mesh, cfg: LMConfig, tokens_per_rank: int, backend: str):
    """(the jitted exchanges of communication_time, its inputs)."""
    axes = tuple(mesh.axis_names)
    ep = EPConfig(num_experts=cfg.num_experts, num_topk=cfg.num_topk, hidden=cfg.hidden,
                  max_tokens_per_rank=tokens_per_rank, backend=backend,
                  dispatch_dtype=cfg.dispatch_dtype)

    def one_layer(x, idx, w):
        # as the MoE layer runs it by default: the gate weights applied to the rows in the experts
        # (their gradient through slot_values), combine unweighted (its backward a broadcast into y's
        # buffer)
        d = dispatch(x, idx, w, ep)
        y = (d.x.astype(jnp.float32) * d.handle.row_weights[:, None]).astype(x.dtype)
        return combine(y, d.handle, ep, weighted=False, empty_rows_zero=True)

    def all_layers(x, idx, w):
        # chained, each layer with a routing of its own, as in the model: identical independent calls
        # would be merged by XLA into one layer's exchange (before 2026-12-05 every layer was timed as one)
        for layer in range(cfg.num_layers):
            x = one_layer(x, idx[layer], w[layer])
        return jax.lax.psum(jnp.sum(x ** 2), axes)

    grad = jax.jit(jax.shard_map(jax.grad(all_layers, argnums=(0, 2)), mesh=mesh,
                                 in_specs=(P(axes), P(None, axes), P(None, axes)),
                                 out_specs=(P(axes), P(None, axes))))
    rng = np.random.default_rng(0)
    n, layers = tokens_per_rank * mesh.size, cfg.num_layers
    x = rng.standard_normal((n, cfg.hidden)).astype(np.float32)
    idx = np.argsort(rng.random((layers, n, cfg.num_experts)), axis=2)[..., :cfg.num_topk].astype(np.int32)
    w = rng.random((layers, n, cfg.num_topk)).astype(np.float32)
    return grad, x, idx, w


def resolved_backends(cfg: EPConfig, ep_size: int, dtype=None) -> dict[str, str]:
    """{op: "reference" | "cuda" | "unavailable: <reason>"}: what ``cfg.backend`` runs for each op of a
    training step at cfg's sizes on this machine (the choice jax_ep makes when the op is traced)."""
    out = {}
    for op in STEP_OPS:
        try:
            module = OPS[op].implementation(cfg, ep_size, dtype).__module__
        except (ImportError, RuntimeError, NotImplementedError, ValueError) as e:
            out[op] = f"unavailable: {e}"
            continue
        out[op] = {"jax_ep.reference": "reference", "jax_ep.cuda_backend": "cuda"}.get(module, module)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (global)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                        help="EPConfig.backend of the EP ops")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    args = parser.parse_args(argv)
    require_at_least(parser, args, ("steps",), minimum=2)   # the demo compares the first loss with the last
    require_at_least(parser, args, ("batch", "seq"))
    require_finite(parser, args, ("lr",), positive=True)

    if jax_ep.distributed.launched_by():   # one of several processes: join them (jax.distributed)
        jax_ep.distributed.initialize()
    use_virtual_cpu_devices()
    devices = jax.devices()                 # every process's devices
    mesh = Mesh(np.array(devices), ("ep",))
    if args.batch % len(devices):
        parser.error(f"--batch {args.batch} must be a multiple of the device count {len(devices)}")
    cfg = LMConfig(num_experts=2 * len(devices), backend=args.backend, bias_update_rate=1e-3,
                   moe_dtype=gpu_moe_dtype())
    say(f"jax_ep demo: {len(devices)} x {devices[0].platform} devices, EP size {len(devices)}, "
        f"{cfg.num_experts} experts, top-{cfg.num_topk}, {cfg.num_layers} MoE layers, "
        f"backend={args.backend}")

    tokens_per_rank = args.batch * args.seq // len(devices)
    ops_cfg = EPConfig(num_experts=cfg.num_experts, num_topk=cfg.num_topk, hidden=cfg.hidden,
                       max_tokens_per_rank=tokens_per_rank, backend=args.backend,
                       dispatch_dtype=cfg.dispatch_dtype)
    say(f"backend {args.backend} resolved per op: " + ", ".join(
        f"{op} -> {impl}" for op, impl in resolved_backends(ops_cfg, len(devices), cfg.moe_dtype).items()))

    model, optimizer, train_step = build_training(cfg, mesh, args.lr)

    data = batches(corpus_bytes(), args.batch, args.seq)
    batch_sharding = NamedSharding(mesh, P("ep"))
    losses, step_times = [], []
    for step, loss, seconds in timed_steps(train_step, model, optimizer, data, batch_sharding, args.steps):
        losses.append(loss)
        step_times.append(seconds)
        if step % 10 == 0 or step == args.steps - 1:
            per_layer = imbalance(jnp.stack([m.last_load[...] for m in model.moe_layers()]))
            say(f"step {step:4d}  loss {loss:.3f}  expert imbalance (max/mean) "
                + " ".join(f"{float(v):.2f}" for v in per_layer))

    step_time = warm_median(step_times)
    tokens = args.batch * args.seq
    comm = communication_time(mesh, cfg, tokens // len(devices), args.backend)
    say(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; "
        f"{tokens / step_time:,.0f} tokens/s; step {1e3 * step_time:.1f} ms")
    say(f"dispatch+combine (fwd+bwd, {cfg.num_layers} layers): {1e3 * comm:.1f} ms = "
        f"{100 * comm / step_time:.0f}% of the step time")
    if not losses[-1] < losses[0]:
        raise SystemExit("jax_ep demo: the loss did not fall")


if __name__ == "__main__":
    main()
