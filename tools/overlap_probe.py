"""Does an EP exchange on XLA's async stream run beside the expert GEMM? (issue 38 item 3)

On one device, three programs, each jitted, timed (best of --repeats chains of --iters calls) and
profiled (jax.profiler, --iters calls):

  gemm   the grouped GEMM of the DeepSeek-V3 gate|up projection of one rank at EP2 (a 73,600-row buffer,
         32,768 real rows, 7168 -> 4096, 128 experts) on the device's SMs less --free
         (``grouped_matmul(num_sms=...)``); ``--gemm ragged`` takes ``lax.ragged_dot`` instead (XLA's
         own kernels, not persistent)
  op     dispatch of 4096 tokens (hidden 7168, top-8 of 128 experts) on --free SMs
         (``KernelConfig(num_sms=free, async_stream=--stream)``), under shard_map on a one-device mesh
  both   the two in one program, no data between them
  gemm_all, op_all  the GEMM and the dispatch on every SM (with --programs): what a step runs when the
         exchange is not beside the GEMM, so gemm_all + op_all against both is the overlap's whole A/B

and prints, per program, the wall ms per call and the kernels' summed ms and the ms some kernel ran; for
"both" also how long kernels ran beside another: the most an overlap of this pair hides is the op's own
time. One device is EP1: the exchange copies locally, as fast as the GEMM leaves it memory bandwidth.

    python tools/overlap_probe.py [--free 24] [--gemm mosaic|ragged] [--stream 1|none]
                                  [--no-command-buffer] [--iters 5] [--repeats 3] [--small]
                                  [--dump DIR] [--xla-flag NAME=VALUE ...] [--side] [--sustain S]
                                  [--programs gemm_all,op_all,gemm,op,both]

``--dump DIR`` writes each program's optimised HLO (``<name>.hlo.txt``, its schedule) and the kernels of one
profiled call (``<name>.kernels.txt``: start µs from the first, duration, stream line, name), to see where
XLA put the exchange's start and done and which stream each kernel ran on. ``--xla-flag`` adds a debug
option to every compile (e.g. ``xla_gpu_enable_latency_hiding_scheduler=true``). ``--side`` runs "both"
through ``jax_ep.overlap.beside`` (the dispatch on jax_ep's side stream; the GEMM between its fork and join).

``--sustain S`` times each program after S seconds of back-to-back calls and profiles it after as long
inside the trace (``benchmarks.layer.best_of`` / ``profiled_steps``), and prints the SM clock and power NVML
saw while the timed calls ran: under sustained load an H200 sits at its 700 W cap, where an exchange's bytes
and a GEMM on fewer SMs change the clock the GEMM gets (session 62).

``--small`` shrinks every size (for a check of the tool, on CPU too: ``--gemm ragged``, the reference
exchange; nothing runs beside anything there).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import clocks  # noqa: E402
from benchmarks.layer import (  # noqa: E402
    NO_COMMAND_BUFFERS,
    best_of,
    expert_group_sizes,
    kernel_events,
    kernel_overlap_ms,
    profiled_steps,
)
from benchmarks.ops import routing_inputs, seconds_arg  # noqa: E402
from jax_ep import dispatch, grouped_matmul, overlap  # noqa: E402
from jax_ep.config import EPConfig, KernelConfig  # noqa: E402
from jax_ep.gemm_mgpu import _num_sms  # noqa: E402
from jax_ep.launch import positive_int  # noqa: E402

# (buffer rows, real rows, K, N, experts) of the GEMM; (tokens, hidden, top-k, experts) of the exchange
SIZES = {"deepseek": ((73600, 32768, 7168, 4096, 128), (4096, 7168, 8, 128)),
         "small": ((1024, 512, 256, 128, 8), (128, 256, 2, 8))}


def kernel_timeline(data) -> str:
    """One line per kernel of a trace on device 0 (``kernel_events``): start µs from the first kernel,
    duration µs, stream line and name, in start order."""
    events = kernel_events(data)
    first = events[0][0] if events else 0
    return "".join(f"{(s - first) / 1e3:12.1f} {(e - s) / 1e3:10.1f}  {ln:24s} {n}\n"
                   for s, e, ln, n in events)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--free", type=positive_int, default=24, help="SMs left to the exchange (default 24)")
    parser.add_argument("--gemm", choices=("mosaic", "ragged"), default="mosaic")
    parser.add_argument("--stream", default="1",
                        help="the exchange's XLA stream, or none (the compute stream)")
    parser.add_argument("--no-command-buffer", action="store_true",
                        help="compile without XLA's command buffers (CUDA graphs)")
    parser.add_argument("--iters", type=positive_int, default=5)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--small", action="store_true", help="small sizes: a check of the tool")
    parser.add_argument("--group", action="store_true",
                        help="trace 'both' in one XLA scheduling group (_scheduling_group_id, for the "
                             "latency-hiding scheduler; with jax 0.11.2 it changed nothing: "
                             "docs/benchmarks.md, session 43)")
    parser.add_argument("--side", action="store_true",
                        help="'both' through jax_ep.overlap.beside: the dispatch on jax_ep's side stream, "
                             "the GEMM on XLA's stream between the fork and the join (--stream unused)")
    parser.add_argument("--programs", default="gemm,op,both",
                        help="which programs (comma-separated; gemm_all: the GEMM on every SM)")
    parser.add_argument("--sustain", type=seconds_arg, default=0.0,
                        help="seconds of back-to-back calls before each timing and profile (default 0)")
    parser.add_argument("--dump", type=pathlib.Path, help="write each program's HLO and kernel timeline here")
    parser.add_argument("--xla-flag", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA debug option for every compile (repeatable)")
    args = parser.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    (m, real, k, n, g), (tokens, hidden, topk, experts) = SIZES["small" if args.small else "deepseek"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    gs = jnp.asarray(expert_group_sizes(real, g, rng, align=64 if not args.small else 1))
    gemm_sms = max(1, _num_sms() - args.free)
    backend = "mosaic_gpu" if args.gemm == "mosaic" else "ragged_dot"

    def gemm(x, w, gs, num_sms=gemm_sms):
        return grouped_matmul(x, w, gs, backend=backend, num_sms=num_sms, zero_tail=False)

    stream = None if args.stream == "none" or args.side else int(args.stream)
    cfg = EPConfig(num_experts=experts, num_topk=topk, hidden=hidden, max_tokens_per_rank=tokens,
                   backend="cuda" if on_gpu else "reference",
                   kernel=KernelConfig(num_sms=args.free, async_stream=stream) if on_gpu else KernelConfig())
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    tok = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    idx, gate = (jnp.asarray(a) for a in routing_inputs(rng, tokens, experts, topk))
    spec = P("ep")
    # every output of dispatch (scalars as [1]), so no part of the op is dead code
    def dispatch_program(cfg):
        return jax.shard_map(lambda t, i, v: [a.reshape(-1) if a.ndim == 0 else a
                                              for a in jax.tree.leaves(dispatch(t, i, v, cfg))], mesh=mesh,
                             in_specs=(spec, spec, spec), out_specs=spec)

    op = dispatch_program(cfg)
    def both(x, w, gs, t, i, v):
        with set_xla_metadata(_scheduling_group_id=0) if args.group else contextlib.nullcontext():
            return gemm(x, w, gs), op(t, i, v)

    def side_body(x, w, gs, t, i, v):
        with overlap.beside(gemm, x, w, gs) as work:
            d = dispatch(t, i, v, cfg)
        return work.result, [a.reshape(-1) if a.ndim == 0 else a for a in jax.tree.leaves(d)]

    # jax_ep.overlap: the GEMM traced beside the dispatch, both in one shard_map body (one trace level)
    both_side = jax.shard_map(side_body, mesh=mesh, in_specs=(P(), P(), P(), spec, spec, spec),
                              out_specs=(P(), spec))

    programs = {"gemm_all": (lambda x, w, gs: gemm(x, w, gs, None), (x, w, gs)),
                "op_all": (dispatch_program(cfg.replace(kernel=KernelConfig())), (tok, idx, gate)),
                "gemm": (gemm, (x, w, gs)), "op": (op, (tok, idx, gate)),
                "both": (both_side if args.side else both, (x, w, gs, tok, idx, gate))}
    unknown = set(args.programs.split(",")) - set(programs)
    if unknown:
        parser.error(f"--programs: unknown {sorted(unknown)}; choose from {sorted(programs)}")
    programs = {name: programs[name] for name in args.programs.split(",")}
    options = dict(NO_COMMAND_BUFFERS if args.no_command_buffer else {})
    for flag in args.xla_flag:
        key, sep, value = flag.partition("=")
        if not sep:
            parser.error(f"--xla-flag takes NAME=VALUE, got {flag!r}")
        # compile options take typed values: XLA refuses the string "true" for a bool flag
        typed = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
        options[key] = typed
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    print(f"{jax.devices()[0].device_kind}: GEMM ({args.gemm}) on {gemm_sms} SMs, " + (
          f"dispatch on {args.free} SMs, stream {args.stream}" if on_gpu else "the reference dispatch")
          + f", command buffers {'off' if args.no_command_buffer else 'on'}")
    result = {}
    with clocks.sampling():
        for name, (fn, fn_args) in programs.items():
            compiled = jax.jit(fn).lower(*fn_args).compile(options or None)
            with clocks.collect() as seen:
                wall_ms = 1e3 * best_of(compiled, *fn_args, iters=args.iters, repeats=args.repeats,
                                        sustain_s=args.sustain)
            data, calls = profiled_steps(lambda compiled=compiled, fn_args=fn_args: compiled(*fn_args),
                                         args.iters, args.sustain)
            # the trace holds the sustaining calls too: only the last --iters calls' kernels are counted
            summed, union = kernel_overlap_ms(data, args.iters, calls=calls)
            if args.dump:
                (args.dump / f"{name}.hlo.txt").write_text(compiled.as_text())
                (args.dump / f"{name}.kernels.txt").write_text(kernel_timeline(data))
            clock = seen.summary()
            result[name] = dict(wall_ms=round(wall_ms, 3), kernels_ms=round(summed, 3),
                                busy_ms=round(union, 3), beside_ms=round(summed - union, 3), clocks=clock)
            print(f"{name:8s} wall {wall_ms:8.3f} ms   kernels {summed:8.3f} ms   some kernel running "
                  f"{union:8.3f} ms   beside another {summed - union:6.3f} ms"
                  + (f"   {clock['sm_mhz'][0]:.0f} MHz, {clock['power_w'][0]:.0f} W" if clock else ""))
    if not {"gemm", "op", "both"} <= set(result):
        return result
    op_ms = result["op"]["kernels_ms"]
    print(f"hidden: {result['both']['beside_ms']:.3f} of the exchange's {op_ms:.3f} ms; wall both - gemm "
          f"{result['both']['wall_ms'] - result['gemm']['wall_ms']:.3f} ms")
    if {"gemm_all", "op_all"} <= set(result):
        serial = result["gemm_all"]["wall_ms"] + result["op_all"]["wall_ms"]
        print(f"overlap's A/B: both {result['both']['wall_ms']:.3f} ms against the GEMM then the exchange, "
              f"each on every SM, {serial:.3f} ms (wall)")
    return result


if __name__ == "__main__":
    main()
