"""A/B of MoE layer configurations on one GPU: the per-rank training step of each, compiled once, timed in
alternating rounds after sustained load (the order flips every round), so that clock drift and the power
cap fall on both alike.

    python tools/layer_ab.py deepseek jax_ep jax_ep_gate_in_combine --experts 128 [--rounds 4]
        [--sustain 1] [--out ab.json]

``--experts N`` overrides the preset's expert count (``deepseek --experts 128``: the per-rank expert work of
the DeepSeek-V3 layer at EP2, its EP ops local). Prints each configuration's per-round ms per step
(``benchmarks.layer.best_of``: best of 3 chains of 10 steps after ``--sustain`` seconds of steps) and
their mean; ``--out`` writes one record per configuration (op ``layer_ab``).
"""

import argparse
import datetime
import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import layer as bench_layer  # noqa: E402
from benchmarks.ops import seconds_arg  # noqa: E402
from jax_ep.launch import positive_int  # noqa: E402


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(bench_layer.LAYER_PRESETS))
    parser.add_argument("configs", nargs="+", choices=sorted(bench_layer.CONFIGS))
    parser.add_argument("--experts", type=positive_int, default=None,
                        help="override the preset's expert count")
    parser.add_argument("--rounds", type=positive_int, default=4)
    parser.add_argument("--sustain", type=seconds_arg, default=1.0,
                        help="seconds of steps before each timing")
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if len(set(args.configs)) < len(args.configs):   # one record would hold both copies' timings
        parser.error(f"configs: each once, got {args.configs}")
    hidden, ffn, experts, topk, tokens = bench_layer.LAYER_PRESETS[args.shape]
    experts = args.experts or experts
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    steps, gate_weights = {}, {}
    for config in args.configs:
        layer, x = bench_layer.layer_and_tokens(mesh, (hidden, ffn, experts, topk, tokens), config)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        step, quantise = bench_layer.training_step(graphdef, rest)
        cached = bench_layer.CONFIGS[config].get("fp8_cached")
        fp8 = jax.block_until_ready(quantise(params)) if cached else None
        steps[config] = (step, (params, x, fp8))
        gate_weights[config] = layer.gate_weights
    times = {config: [] for config in steps}
    for r in range(args.rounds):
        for config in (args.configs if r % 2 == 0 else args.configs[::-1]):
            step, call_args = steps[config]
            times[config].append(1e3 * bench_layer.best_of(step, *call_args, iters=args.iters,
                                                           repeats=args.repeats, sustain_s=args.sustain))
    records = []
    for config, ms in times.items():
        print(f"{args.shape} ({experts} experts) {config}: {' '.join(f'{t:.3f}' for t in ms)} ms; "
              f"mean {np.mean(ms):.3f}")
        records.append(dict(op="layer_ab", shape=args.shape, num_experts=experts, config=config, rounds_ms=ms,
                            mean_ms=float(np.mean(ms)), sustain_s=args.sustain, configs=args.configs,
                            gate_weights=gate_weights[config],
                            device=jax.devices()[0].device_kind,
                            date=datetime.date.today().isoformat()))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
