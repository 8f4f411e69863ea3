"""One launch of each grouped GEMM kernel the DeepSeek-V3 layer runs per rank at EP2, for Nsight Compute:
the bf16 forward, input gradient and weight gradient at the table's configurations (gate|up: 73600 rows
in the buffer, 32768 real, 7168 -> 4096, 128 experts) and the FP8 forward and input gradient
(gemm_fp8.KERNEL). Every program is compiled and run once before the profiled pass, which then launches
the kernels in the order printed, one each, so ncu's launches map to them.

    ncu -k regex:mosaic --launch-skip S --launch-count 5 ... python tools/gemm_ncu.py [--shape down]

(``GEMM_NCU=1 tools/gpu_check.sh`` runs it with the stall-reason sections.) ``--print-order`` prints the
kernel order and the number of Mosaic launches of the warm-up (S), without a GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tune_gemm import SHAPES as TUNED_SHAPES  # noqa: E402

from benchmarks.layer import expert_group_sizes  # noqa: E402
from jax_ep import gemm_mgpu as mgpu  # noqa: E402
from jax_ep.gemm import block_config  # noqa: E402

# tools/tune_gemm.py's DeepSeek-V3 layer shapes: (M incl. capacity padding, real rows, K, N, G, alignment)
SHAPES = dict(zip(("gate_up", "down"), TUNED_SHAPES["dsv3"], strict=True))
ORDER = ("forward bf16", "dx bf16", "dw bf16", "forward fp8", "dx fp8")


def operands(m, real, k, n, g, align=64):
    """x [M, K], w [G, K, N], dy [M, N] (bf16, random, made on the device) and the group sizes: `real`
    rows over g experts, each padded to `align` (benchmarks.layer.expert_group_sizes)."""
    gs = jnp.asarray(expert_group_sizes(real, g, np.random.default_rng(0), align=align))
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(key[1], (g, k, n), jnp.bfloat16) * k ** -0.5
    dy = jax.random.normal(key[2], (m, n), jnp.bfloat16)
    return x, w, dy, gs


def programs(m, real, k, n, g, align=64):
    """(name, jitted function, arguments) in ORDER."""
    from jax_ep.gemm_fp8 import grouped_matmul_fp8, quantize_gemm_rows, quantize_weight_blocks_both

    x, w, dy, gs = operands(m, real, k, n, g, align)
    plans = {p: block_config(p, m, k, n, g) for p in ("forward", "dx", "dw")}

    def bf16(name):
        cfg = plans[name]
        if name == "dw":
            return lambda x, w, dy, gs: mgpu.transposed_ragged_dot(x, dy, gs, config=cfg)
        def run(x, w, dy, gs):
            sched, tiles = mgpu.config_schedule(gs, m, cfg)
            return mgpu.ragged_dot(dy if name == "dx" else x, w, sched, tiles, config=cfg,
                                   transpose_rhs=name == "dx")
        return run

    xq, xs = quantize_gemm_rows(x)
    dyq, dys = quantize_gemm_rows(dy)
    wq, wq_t, ws = jax.jit(quantize_weight_blocks_both)(w)
    return [("forward bf16", jax.jit(bf16("forward")), (x, w, dy, gs)),
            ("dx bf16", jax.jit(bf16("dx")), (x, w, dy, gs)),
            ("dw bf16", jax.jit(bf16("dw")), (x, w, dy, gs)),
            ("forward fp8",
             jax.jit(lambda *a: grouped_matmul_fp8(*a[:4], a[5], wq_t=a[4], backend="mosaic_gpu")),
             (xq, xs, wq, ws, wq_t, gs)),
            ("dx fp8", jax.jit(lambda *a: grouped_matmul_fp8(*a, transpose_w=True, backend="mosaic_gpu")),
             (dyq, dys, wq, ws, gs))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gate_up", choices=sorted(SHAPES))
    parser.add_argument("--print-order", action="store_true", help="print the kernels' order and exit")
    args = parser.parse_args(argv)
    m, real, k, n, g, align = SHAPES[args.shape]
    if args.print_order:
        # the warm-up runs each program once: len(ORDER) Mosaic launches before the profiled ones
        print(f"warm-up Mosaic launches: {len(ORDER)}; profiled, in order: {', '.join(ORDER)}")
        return
    runs = programs(m, real, k, n, g, align)
    assert tuple(name for name, _, _ in runs) == ORDER
    for _, f, a in runs:  # compile and warm up
        jax.block_until_ready(f(*a))
    for name, f, a in runs:  # the profiled launches, one each
        jax.block_until_ready(f(*a))
        print(f"launched: {name} ({args.shape}: M={m} rows={real} K={k} N={n} G={g})", flush=True)


if __name__ == "__main__":
    main()
