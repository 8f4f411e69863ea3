"""Time dispatch and combine on the available devices, for every backend present.

    python -m jax_ep.bench [--preset auto|small|deepseek|sparse] [--tokens 128,4096] [--out bench.json]

Backends: ``reference`` (pure JAX, dense lax.all_to_all), ``ragged`` (MaxText-style
lax.ragged_all_to_all, where the platform implements it), ``cuda`` (jax_ep's kernels, where built).
Each time is the median over repeats of a jitted loop of ``--iters`` calls, divided by the calls.

Bytes: ``logical`` counts one copy of each token's row per destination rank (self included) — what the
op delivers; ``wire`` counts only the copies that leave the rank (what must cross NVLink). Both are
per rank. ``pct_of_peak`` compares wire GB/s with a device-to-device copy measured at the start of the
same run (GPUs only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep import baselines, reference  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402
from jax_ep.ops import backend_for, combine, dispatch  # noqa: E402

PRESETS = {
    # name: (tokens per rank, hidden, top-k, experts)
    "small": [(256, 512, 4, 32)],
    "deepseek": [(4096, 7168, 8, 256)],
    "sparse": [(4096, 7168, 2, 8)],
}
BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}


def _routing(rng, n, experts, topk):
    idx = np.argsort(rng.random((n, experts)), axis=1)[:, :topk].astype(np.int32)
    w = rng.random((n, topk)).astype(np.float32)
    return idx, w / w.sum(1, keepdims=True)


def _time_loop(fn, args, iters: int, repeats: int) -> float:
    """Median seconds per call of fn(*args) inside a jitted loop.

    The loop carries fn's output, and each call's inputs pass an optimisation barrier together with
    the previous output and the loop counter: every call is computed in full (nothing is hoisted,
    nothing is dead) and the calls run one after another."""
    out_shape = jax.eval_shape(fn, *args)

    def looped(*a):
        def body(i, prev):
            ai, _, _ = lax.optimization_barrier((a, i, prev))
            return fn(*ai)
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        return lax.fori_loop(0, iters, body, init)

    run = jax.jit(looped)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def measure_copy_peak(devices, nbytes: int = 1 << 30) -> float | None:
    """GB/s of a device-to-device copy between the first two GPUs (None on CPU or one device)."""
    if len(devices) < 2 or devices[0].platform != "gpu":
        return None
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), devices[0])
    jax.block_until_ready(jax.device_put(x, devices[1]))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(x, devices[1]))
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


def _backends(requested: list[str], platform: str) -> list[str]:
    usable = []
    for name in requested:
        if name == "ragged" and platform == "cpu":
            print("skip ragged: lax.ragged_all_to_all is not implemented on XLA:CPU")
            continue
        if name == "cuda":
            from jax_ep import runtime
            ok, why = runtime.available()
            if not ok:
                print(f"skip cuda: {why}")
                continue
        usable.append(name)
    return usable


def bench_shape(mesh, backend, dtype, tokens, hidden, topk, experts, iters, repeats, rng):
    ep_size = mesh.size
    n = tokens * ep_size
    x = jax.device_put(rng.standard_normal((n, hidden)).astype(np.float32).astype(jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    idx, w = _routing(rng, n, experts, topk)
    spec = P("ep")
    records = []
    if backend == "ragged":
        disp = lambda x, i, w: baselines.ragged_dispatch(x, i, w, experts, "ep")  # noqa: E731
        d_fn = jax.shard_map(lambda x, i, w: disp(x, i, w)[0], mesh=mesh, in_specs=spec, out_specs=spec)
        t_dispatch = _time_loop(d_fn, (x, idx, w), iters, repeats)

        def round_trip(x, i, w):
            rows, _, handle = disp(x, i, w)
            return baselines.ragged_combine(rows, handle, "ep")
        rt = jax.shard_map(round_trip, mesh=mesh, in_specs=spec, out_specs=spec)
        t_combine = _time_loop(rt, (x, idx, w), iters, repeats) - t_dispatch
        num_sms = None
    else:
        cfg = EPConfig(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                       backend=backend, dispatch_dtype=dtype)
        d_fn = jax.shard_map(lambda x, i, w: dispatch(x, i, w, cfg).x, mesh=mesh, in_specs=spec,
                             out_specs=spec)
        t_dispatch = _time_loop(d_fn, (x, idx, w), iters, repeats)
        # combine is timed alone on a dispatched handle and bf16 expert outputs
        bf16_cfg = cfg.replace(dispatch_dtype="bfloat16")
        make = jax.jit(jax.shard_map(lambda x, i, w: dispatch(x, i, w, bf16_cfg)[::6], mesh=mesh,
                                     in_specs=spec, out_specs=spec))
        rows, handle = make(x, idx, w)  # Dispatched fields 0 and 6: x and handle
        c_fn = jax.shard_map(lambda y, h: combine(y, h, bf16_cfg), mesh=mesh, in_specs=spec, out_specs=spec)
        t_combine = _time_loop(c_fn, (rows, handle), iters, repeats)
        num_sms = cfg.num_sms if backend_for(cfg, "dispatch").__module__.endswith("cuda_backend") else None
    # bytes, from the routing actually used (host-side layout of every rank)
    per_rank_layout = [np.asarray(reference.layout(jnp.asarray(idx[r * tokens:(r + 1) * tokens]),
                                                   experts, ep_size).num_tokens_per_rank)
                       for r in range(ep_size)]
    pairs = np.mean([lay.sum() for lay in per_rank_layout])
    remote = np.mean([lay.sum() - lay[r] for r, lay in enumerate(per_rank_layout)])
    row_bytes = {"dispatch": hidden * BYTES[dtype] + (4 * hidden // 128 if dtype != "bfloat16" else 0),
                 "combine": hidden * 2}
    for op, seconds in (("dispatch", t_dispatch), ("combine", t_combine)):
        records.append(dict(op=op, backend=backend, dtype=dtype if op == "dispatch" else "bfloat16",
                            tokens_per_rank=tokens, hidden=hidden, topk=topk, num_experts=experts,
                            ep_size=ep_size, us=1e6 * seconds,
                            logical_gbps=pairs * row_bytes[op] / seconds / 1e9,
                            wire_gbps=remote * row_bytes[op] / seconds / 1e9, num_sms=num_sms))
    return records


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auto", choices=["auto", *PRESETS])
    parser.add_argument("--tokens", default=None, help="comma-separated tokens per rank (overrides preset)")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--backends", default="reference,ragged,cuda")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args(argv)

    devices = jax.devices()
    platform = devices[0].platform
    mesh = Mesh(np.array(devices), ("ep",))
    preset = args.preset if args.preset != "auto" else ("small" if platform == "cpu" else "deepseek")
    shapes = PRESETS[preset] if args.preset != "auto" or platform == "cpu" else (
        PRESETS["deepseek"] + PRESETS["sparse"])
    if args.tokens:
        base = shapes[0]
        shapes = [(int(t), base[1], base[2], base[3]) for t in args.tokens.split(",")]
    shapes = [(t, args.hidden or h, args.topk or k, args.experts or e) for t, h, k, e in shapes]
    peak = measure_copy_peak(devices)
    device_name = f"{len(devices)}x {devices[0].device_kind}"
    today = datetime.date.today().isoformat()
    print(f"jax_ep bench: {device_name}, preset {preset}, peer-copy peak "
          f"{'n/a' if peak is None else f'{peak:.0f} GB/s'}")
    rng = np.random.default_rng(0)
    records = []
    for backend in _backends(args.backends.split(","), platform):
        for dtype in args.dtypes.split(","):
            if backend == "ragged" and dtype != "bfloat16":
                continue
            for tokens, hidden, topk, experts in shapes:
                try:
                    recs = bench_shape(mesh, backend, dtype, tokens, hidden, topk, experts,
                                       args.iters, args.repeats, rng)
                except Exception as e:  # one failing backend must not hide the others' numbers
                    print(f"FAILED {backend} {dtype} T={tokens}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                for r in recs:
                    r.update(device=device_name, date=today, peer_copy_gbps=peak,
                             pct_of_peak=None if peak is None else 100 * r["wire_gbps"] / peak)
                records.extend(recs)
    header = f"{'op':9}{'backend':11}{'dtype':15}{'T/rank':>7}{'H':>6}{'K':>3}{'E':>5}{'EP':>4}" \
             f"{'us':>11}{'logical GB/s':>14}{'wire GB/s':>11}{'% peak':>8}"
    print(header)
    for r in records:
        pct = "" if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.0f}"
        print(f"{r['op']:9}{r['backend']:11}{r['dtype']:15}{r['tokens_per_rank']:>7}{r['hidden']:>6}"
              f"{r['topk']:>3}{r['num_experts']:>5}{r['ep_size']:>4}{r['us']:>11.1f}"
              f"{r['logical_gbps']:>14.1f}{r['wire_gbps']:>11.1f}{pct:>8}")
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {len(records)} records to {args.out}")
    return records


if __name__ == "__main__":
    main()
