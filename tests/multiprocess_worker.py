"""Worker of tests/test_multiprocess.py: the Flax MoE layer's forward pass and gradients on a mesh over
every device of every process (``python -m jax_ep.launch --nproc 2 --local-devices-per-process 2``) or of
this one process (``JAX_NUM_CPU_DEVICES=4``). Process 0 writes every result, gathered to the host, to
``--out`` (.npz).

    python tests/multiprocess_worker.py --out RESULT.npz --seed SEED --devices 4
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import jax_ep.distributed

START = time.perf_counter()
if jax_ep.distributed.launched_by():
    jax_ep.distributed.initialize(initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep.balancing import BalancingConfig  # noqa: E402
from jax_ep.gating import RouterConfig  # noqa: E402
from jax_ep.moe import EPOptions, MoE  # noqa: E402

HIDDEN, FFN, SHARED, EXPERTS, TOPK, BATCH, SEQ = 16, 24, 8, 8, 2, 8, 4


def global_array(value: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """A global array of ``value`` (the same on every process) with the sharding ``spec``."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True, help="expected number of devices (global)")
    args = parser.parse_args(argv)

    devices = jax.devices()
    if len(devices) != args.devices:
        sys.exit(f"worker: {len(devices)} devices ({devices}), expected {args.devices}")
    mesh = Mesh(np.array(devices), ("ep",))
    layer = MoE(HIDDEN, FFN, RouterConfig(EXPERTS, TOPK, score_func="sigmoid", num_groups=4, topk_groups=2),
                rngs=nnx.Rngs(args.seed), mesh=mesh, ep=EPOptions(backend="auto"), shared_ffn_hidden=SHARED,
                balancing=BalancingConfig(bias_update_rate=1e-2, aux_loss_alpha=1e-2))
    # every process made the same values (same seed); the layer placed them as global arrays (experts
    # over "ep", the rest replicated)
    assert all(v.sharding.device_set == set(devices) for v in jax.tree.leaves(nnx.state(layer)))

    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)
    cotangent = rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)
    x, cotangent = (global_array(v, mesh, P("ep")) for v in (x, cotangent))

    @nnx.jit
    def step(layer, x, cotangent):
        def loss(layer, x):
            out = layer(x)
            return jnp.sum(out * cotangent) + layer.aux_loss, out

        (value, out), (grads, grad_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return value, out, grads, grad_x

    ready = time.perf_counter()
    value, out, grads, grad_x = step(layer, x, cotangent)
    results = {"loss": value, "out": out, "grad_x": grad_x, "grads": nnx.to_pure_dict(grads),
               "state": nnx.to_pure_dict(nnx.state(layer))}   # parameters and statistics after the call
    results = multihost_utils.process_allgather(results, tiled=True)   # numpy, the same on every process
    done = time.perf_counter()
    flat = {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(results)[0]}
    if jax.process_index() == 0:
        np.savez(args.out, **flat)
    print(f"worker: process {jax.process_index()} of {jax.process_count()}, {len(devices)} devices, "
          f"start {ready - START:.1f} s, compile+run {done - ready:.1f} s", flush=True)


if __name__ == "__main__":
    main()
