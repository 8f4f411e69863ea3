"""What the FP8 grouped GEMM's time is made of: the table's kernel (gemm_mgpu.ragged_dot_fp8, the
DeepSeek-V3 layer's shapes, forward and input gradient) timed beside variants of its K step, patched into
gemm_mgpu while the variant is traced, in the same run on one Hopper GPU:

    table          the kernel as the table runs it (its DeepSeek-V3 forms are lagged: each K step's block
                   sum promoted while the next step's WGMMAs run, two steps per loop iteration)
    plain          the table's form without the lag: each block sum promoted after its own wait (what
                   the variants below patch; the same results as table, bit for bit)
    reuse_acc      plain, the block sum accumulating into the previous step's block-sum registers instead
                   of a zeroed accumulator (wrong results: timing only; what zeroing the accumulator costs)
    no_promotion   one running WGMMA accumulator across K and no scales, as the bf16 kernel (wrong
                   results: timing only; the kernel's bound without the promotion)
    lagged         the table's lag (gemm_mgpu.ragged_dot_fp8(lagged=True)) with one K step per loop
                   iteration instead of two (bit for bit as table; 7-20% slower than plain on the H200: the
                   carried block sum is copied out of the accumulator's registers each step)

    python tools/fp8_bounds.py [--shapes gate_up,down,mid_gate_up,mid_down] [--passes forward,dx]
                               [--variants table,plain,reuse_acc,no_promotion,lagged]
                               [--dense] [--out JSON] [--lower-only]

``--dense`` also times a dense dot of the gate|up and down shapes in bf16 and in e4m3 (XLA), the matrix
ceilings of the same run. ``--lower-only`` lowers each variant for CUDA without running it (any machine).
The variants apply to the K-ring forms (gemm_fp8.fp8_kernel_form's ring element), which the table holds
for every DeepSeek-V3 FP8 pass.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gemm_ncu import operands  # noqa: E402
from tune_gemm import SHAPES as TUNED_SHAPES  # noqa: E402

from benchmarks.layer import best_of  # noqa: E402
from jax_ep import gemm_mgpu as mg  # noqa: E402
from jax_ep.gemm import tuned_entry  # noqa: E402
from jax_ep.gemm_fp8 import grouped_matmul_fp8, quantize_gemm_rows, quantize_weight_blocks_both  # noqa: E402

# (M incl. capacity padding, real rows, K, N, G, alignment): tools/tune_gemm.py's layer shapes
SHAPES = dict(zip(("gate_up", "down", "mid_gate_up", "mid_down"), TUNED_SHAPES["layers"], strict=True))
VARIANTS = ("table", "plain", "reuse_acc", "no_promotion", "lagged")
EXACT = ("table", "plain", "lagged")      # the variants that compute the kernel's results


def _operands(a, b, block):
    """What the patched _fp8_block_sum hands on instead of a block sum: the K step's operands."""
    return a, b, block


def _mma_into(acc, operands):
    """acc + the K step's a . b^T, through a WGMMA accumulator initialised with acc."""
    a, b, block = operands
    bn = b.shape[0] if block is None else block[1]

    def mma(acc_ref):
        mine = b if block is None else b.at[pl.ds(block[0] * bn, bn)]
        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(mine, (1, 0)))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


@contextlib.contextmanager
def variant(name: str):
    """gemm_mgpu with the K step of ``name`` (see the module docstring) while the body is traced."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")
    patched = ("_fp8_block_sum", "_promote", "_acc_zeros", "_write_tile", "_k_ring")
    saved = {n: getattr(mg, n) for n in patched}
    promote, zeros, write, ring = (saved[n] for n in patched[1:])
    if name in ("reuse_acc", "no_promotion"):
        mg._fp8_block_sum = _operands
    if name == "reuse_acc":
        def promote_reusing(carry, operands, scale):
            total, part = carry
            part = _mma_into(part, operands)
            return promote(total, part, scale), part
        mg._acc_zeros = lambda bm, bn: (zeros(bm, bn), zeros(bm, bn))
        mg._promote = promote_reusing
        mg._write_tile = lambda o, v: write(o, v[0] if isinstance(v, tuple) else v)
    elif name == "no_promotion":
        mg._promote = lambda total, operands, scale: _mma_into(total, operands)
    elif name == "lagged":    # the product's lag, its K loop one step per iteration
        mg._k_ring = lambda *args, **kwargs: ring(*args, **{**kwargs, "pairs": False})
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(mg, n, value)


def lag(form, lagged: int = 1) -> tuple:
    """The FP8 kernel form with (1) or without (0) the lag (gemm_fp8.fp8_kernel_form's 7th element)."""
    return (*form[:6], *(0,) * (6 - len(form[:6])), lagged)


def run(shapes, passes, variants, *, lower_only: bool = False, small: bool = False) -> list[dict]:
    """One record per (shape, pass, variant): ms and TFLOP/s on the real rows (exact variants: the
    largest difference from the table's output); ``lower_only``: lowered for CUDA, not run."""
    records = []
    for name in shapes:
        m, real, k, n, g, align = SHAPES[name]
        if small:
            m, real, g = 2048, 1024, 4
        x, w, dy, gs = operands(m, real, k, n, g, align)
        xq, xs = quantize_gemm_rows(x)
        dyq, dys = quantize_gemm_rows(dy)
        wq, wq_t, ws = jax.jit(quantize_weight_blocks_both)(w)
        rows = int(np.sum(np.asarray(gs)))
        for p in passes:
            # the table's key is the [G, K, N] weight's (K, N) for both passes (gemm_fp8.grouped_matmul_fp8)
            table_form = tuned_entry("dx_fp8" if p == "dx" else "forward_fp8", m, k, n, g)
            args = (xq, xs, wq, wq_t, ws, gs) if p == "forward" else (dyq, dys, wq, ws, gs)
            reference = None
            for v in variants:
                # table: as the table holds it; lagged: the lag; the others patch the form without it
                form = (table_form if v == "table" or table_form is None
                        else lag(table_form, int(v == "lagged")))

                def fn(*args, p=p, form=form):
                    """Defined per variant: jit caches a trace per function object, and the variant is
                    patched in only while it is traced."""
                    if p == "forward":
                        xq, xs, wq, wq_t, ws, gs = args
                        return grouped_matmul_fp8(xq, xs, wq, ws, gs, wq_t=wq_t, backend="mosaic_gpu",
                                                  kernel=form)
                    dyq, dys, wq, ws, gs = args
                    return grouped_matmul_fp8(dyq, dys, wq, ws, gs, transpose_w=True, backend="mosaic_gpu",
                                              kernel=form)

                rec = dict(op="fp8_bounds", shape=name, pass_name=p, variant=v, form=form, m=m, rows=real,
                           k=k, n=n, g=g, device=jax.devices()[0].device_kind, jax=jax.__version__,
                           date=datetime.date.today().isoformat())
                try:
                    with variant(v):
                        lowered = jax.jit(fn).trace(*args).lower(
                            lowering_platforms=("cuda",) if lower_only else None)
                        compiled = None if lower_only else lowered.compile()
                    if lower_only:
                        rec["lowered_sha1"] = hashlib.sha1(lowered.as_text().encode()).hexdigest()
                    else:
                        t = best_of(compiled, *args, iters=10, repeats=3)
                        rec.update(ms=t * 1e3, tflops=2 * real * k * n / t / 1e12)
                        if v in EXACT:
                            out = np.asarray(compiled(*args)[:rows].astype(jnp.float32))
                            reference = out if reference is None else reference
                            rec["max_abs_diff_vs_table"] = float(np.max(np.abs(out - reference)))
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(rec), flush=True)
                records.append(rec)
    return records


def dense(dtypes=(jnp.bfloat16, jnp.float8_e4m3fn)) -> list[dict]:
    """A dense dot of 32768 rows at the gate|up and down shapes per dtype (XLA): the same run's ceiling."""
    records = []
    for m, k, n in ((32768, 7168, 4096), (32768, 2048, 7168)):
        a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
        for dt in dtypes:
            dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
            t = best_of(dot, a.astype(dt), b.astype(dt), iters=10, repeats=3)
            records.append(dict(op="dense_dot", dtype=jnp.dtype(dt).name, m=m, k=k, n=n, ms=t * 1e3,
                                tflops=2 * m * k * n / t / 1e12, device=jax.devices()[0].device_kind))
            print(json.dumps(records[-1]), flush=True)
    return records


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="gate_up,down")
    parser.add_argument("--passes", default="forward,dx")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dense", action="store_true", help="also time dense bf16 / e4m3 dots")
    parser.add_argument("--out", default=None, help="write the records here (JSON)")
    parser.add_argument("--lower-only", action="store_true", help="lower for CUDA, do not run")
    parser.add_argument("--small", action="store_true", help="a few hundred rows per shape (lowering checks)")
    args = parser.parse_args(argv)
    for flag, given, known in (("--shapes", args.shapes, SHAPES),
                               ("--passes", args.passes, ("forward", "dx")),
                               ("--variants", args.variants, VARIANTS)):
        unknown = [s for s in given.split(",") if s not in known]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    records = run(args.shapes.split(","), args.passes.split(","), args.variants.split(","),
                  lower_only=args.lower_only, small=args.small)
    if args.dense and not args.lower_only:
        records += dense()
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
