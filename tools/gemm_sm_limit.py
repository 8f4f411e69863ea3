"""The grouped GEMMs on fewer SMs: what leaving SMs to an exchange beside them would cost.

    python tools/gemm_sm_limit.py [--shapes dsv3|mid|layers] [--free 0,12,24,36] [--passes forward,dx,dw]
                                  [--sustain 0,2] [--out JSON] [--lower-only]

Hiding the EP traffic behind the expert GEMMs (issue 38, item 3) needs the persistent GEMM kernels to
leave SMs to the exchange kernels: their grid is one CTA (or ``ctas_per_sm``) per SM
(``gemm_mgpu._num_sms``). This tool times each pass of the layer's per-rank GEMMs at the configuration
the layer takes (``jax_ep.gemm.block_config``: the tuned table's) with that grid shrunk by each ``--free``
count (the kernels' ``num_sms``, what ``MoE(gemm_num_sms=...)`` sets; the kernels spread their tiles over
whatever grid there is), ms and TFLOP/s
on real rows, in one record. ``--sustain 0,S`` times each setting right after compiling and again after S
seconds of back-to-back calls, with the SM clock and power NVML saw while the timed calls ran
(``benchmarks.clocks``): under sustained load the H200 sits at its 700 W cap, where a smaller grid may run
at a higher clock (session 62: the row passes are bound by power), so a burst timing can overstate what
the freed SMs cost. ``--lower-only`` lowers each setting for CUDA without running it (any
machine; the CPU test's check that each setting is a program of its own).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tune_gemm  # noqa: E402

from benchmarks import clocks  # noqa: E402
from jax_ep import gemm  # noqa: E402


def run(shapes, passes, free, *, lower_only: bool = False,
        sustain_s: tuple[float, ...] = (0.0,)) -> list[dict]:
    total = 132 if lower_only else tune_gemm.mgpu._num_sms()   # every SM of the GPU (132 off one)
    rng = np.random.default_rng(0)
    records = []
    for (m, real, k, n, g, align) in shapes:
        if lower_only:  # shapes only: nothing to time
            x, w, dy, gs = (jax.ShapeDtypeStruct(s, d) for s, d in (
                ((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((m, n), jnp.bfloat16), ((g,), jnp.int32)))
        else:
            gs = jnp.asarray(tune_gemm.expert_group_sizes(real, g, rng, uniform=False, align=align))
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
            dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        for name in passes:
            cfg = gemm.block_config(name, m, k, n, g)   # what the layer takes for this pass
            for f in free:
                rec = dict(shape=[m, real, k, n, g], pass_name=name, config=list(cfg.astuple()),
                           sms=total - f, free_sms=f)
                fn = functools.partial(tune_gemm.run_pass, name, cfg, num_sms=total - f)
                lowered = jax.jit(fn).trace(x, w, dy, gs).lower(
                    lowering_platforms=("cuda",) if lower_only else None)
                compiled = None if lower_only else lowered.compile()
                if lower_only:
                    rec["lowered_sha1"] = hashlib.sha1(lowered.as_text().encode()).hexdigest()
                else:
                    for setting in sustain_s:   # the last setting's time is the record's ms
                        with clocks.collect() as seen:
                            t = tune_gemm.best_of(compiled, x, w, dy, gs, sustain_s=setting)
                        rec.update(ms=round(t * 1e3, 4), tflops=round(2 * real * k * n / t / 1e12, 1))
                        if len(sustain_s) > 1 or setting:
                            rec.setdefault("sustained", []).append(dict(sustain_s=setting, ms=rec["ms"],
                                                                        clocks=seen.summary()))
                print(rec, flush=True)
                records.append(rec)
    return records


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv3", choices=["dsv3", "mid", "layers"])
    parser.add_argument("--passes", default="forward,dx,dw")
    parser.add_argument("--free", default="0,12,24,36", help="SMs left free, comma-separated")
    parser.add_argument("--out", default=None, help="write the record here (JSON)")
    parser.add_argument("--lower-only", action="store_true", help="lower for CUDA, do not run")
    parser.add_argument("--sustain", type=tune_gemm.sustain_settings, default=(0.0,),
                        help="seconds of back-to-back calls before each timing, comma-separated (e.g. 0,2)")
    args = parser.parse_args(argv)
    free = [int(f) for f in args.free.split(",")]
    if any(f < 0 or f >= 132 for f in free):
        parser.error(f"--free: SM counts from 0 to 131, got {args.free}")
    with clocks.sampling():
        records = run(tune_gemm.SHAPES[args.shapes], [p for p in args.passes.split(",") if p], free,
                      lower_only=args.lower_only, sustain_s=args.sustain)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(
            tool="tools/gemm_sm_limit.py", argv=argv if argv is not None else sys.argv[1:],
            device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), runs=records), indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
