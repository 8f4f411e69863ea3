"""Times jax_ep.swiglu's Pallas kernels (forward, backward) over block tilings against XLA's SwiGLU at
the MoE layer's per-rank expert buffers, on one GPU; prints a table and writes JSON records.

    python tools/tune_swiglu.py [--shapes deepseek_ep2,mid_ep2] [--tilings 64x256x4,32x128x4] [--out FILE]

A shape is (C, F, live rows): the dispatch buffer's rows at the layer's default capacity, the ffn
width, and the rows that hold tokens (uniform routing). XLA computes every row; the kernels the row
blocks below the live rows. The best tiling by forward + backward is printed last; jax_ep.swiglu.TILING
is what the layer uses. ``--tilings`` (rows x cols x warps) limits the sweep: every tiling compiles two
Triton kernels, ~8 s each on the GPU machine (the 24 tilings of 2026-11-30, half of them a two-output
backward since removed, overran 400 s at 3 shapes).
"""

import argparse
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.layer import best_of  # noqa: E402
from jax_ep.swiglu import Tiling, kernel_unfit, swiglu  # noqa: E402

# per rank at EP2, 4096 tokens per rank (benchmarks.layer's shapes): capacity rows, F, live rows
SHAPES = {"deepseek_ep2": (73600, 2048, 36864), "mid_ep2": (49152, 1408, 25600),
          "deepseek_ep4": (135104, 2048, 36864)}


def time_one(m, f, live, backend, tiling=None):
    rng = np.random.default_rng(0)
    gu = jnp.asarray(rng.standard_normal((m, 2 * f)), jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)
    n = jnp.int32(live)
    kw = dict(backend=backend) if tiling is None else dict(backend=backend, tiling=tiling)
    fwd = jax.jit(lambda a, n: swiglu(a, n, **kw))
    bwd = jax.jit(lambda a, n, d: jax.vjp(lambda a: swiglu(a, n, **kw), a)[1](d)[0])
    return (best_of(fwd, gu, n, iters=20, repeats=5), best_of(bwd, gu, n, dh, iters=20, repeats=5))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="deepseek_ep2,mid_ep2")
    parser.add_argument("--tilings", default=None, help="e.g. 64x256x4,32x128x4 (default: 12)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tilings:
        tilings = [Tiling(*map(int, t.split("x")))
                   for t in args.tilings.split(",")]
    else:
        tilings = [Tiling(rows, cols, warps) for rows, cols, warps in
                   itertools.product((32, 64), (128, 256, 512), (4, 8))]
    records = []
    for name in args.shapes.split(","):
        m, f, live = SHAPES[name]
        xf, xb = time_one(m, f, live, "xla")
        records.append(dict(shape=name, backend="xla", fwd_us=1e6 * xf, bwd_us=1e6 * xb))
        print(f"{name} (C={m}, F={f}, live={live}) xla: fwd {1e6 * xf:.1f} us, bwd {1e6 * xb:.1f} us",
              flush=True)
        for t in tilings:
            if kernel_unfit((m, 2 * f), t):
                continue
            try:
                pf, pb = time_one(m, f, live, "pallas", t)
            except Exception as e:  # noqa: BLE001 - a tiling Triton refuses is a result
                print(f"  {t}: {type(e).__name__}: {str(e)[:160]}")
                continue
            finally:
                write(args.out, records)
            records.append(dict(shape=name, backend="pallas", tiling=t.__dict__, fwd_us=1e6 * pf,
                                bwd_us=1e6 * pb))
            print(f"  {t}: fwd {1e6 * pf:.1f} us, bwd {1e6 * pb:.1f} us", flush=True)
        best = min((r for r in records if r["shape"] == name and r["backend"] == "pallas"),
                   key=lambda r: r["fwd_us"] + r["bwd_us"])
        print(f"best {name}: {best['tiling']} fwd {best['fwd_us']:.1f} bwd {best['bwd_us']:.1f} us "
              f"(xla {1e6 * xf:.1f} / {1e6 * xb:.1f})", flush=True)
    write(args.out, records)


def write(out, records):
    """The records so far (a run cut by its time limit keeps what it timed)."""
    if out:
        pathlib.Path(out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, records=records),
                                                indent=1))


if __name__ == "__main__":
    main()
