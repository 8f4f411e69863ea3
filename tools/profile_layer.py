"""Where a profiled MoE layer step's device time goes: every GPU kernel of device 0, summed per kernel
name over a chain of steps, with the HLO instruction and jax name scope it came from.

    python tools/profile_layer.py [mid|deepseek|small|deepseek_decode|...] [layer config, e.g. ep_cuda]
        [--experts N] [--top 40] [--hlo FILE] [--ordered] [--decode] [--no-command-buffer]

``--decode`` profiles a decode preset's forward instead (``deepseek_decode [config] --decode``, the step
``python -m benchmarks --layer`` times for it; ``jax_ep_fp8_cached`` runs the experts in FP8).
``--experts N`` overrides the preset's expert count: ``deepseek ep_cuda --experts 128`` on one GPU runs
the per-rank expert work of the DeepSeek-V3 layer at EP2 (no communication), at half the device cost.
It prints the step time, the compiled program's memory, the busy time per stream, how long kernels ran
beside another (``--no-command-buffer`` compiles the step kernel by kernel), the kernels by total
time (with their scopes), the total by kind of kernel (from their names) and per scope; with a config
whose EP ops run on an async stream it also prints what the compiled schedule puts between each async
op's start and done.
"""

import argparse
import collections
import pathlib
import re
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import layer as bench_layer  # noqa: E402
from jax_ep.launch import positive_int  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("shape", nargs="?", default="mid", choices=sorted(bench_layer.LAYER_PRESETS))
parser.add_argument("config", nargs="?", default="jax_ep", choices=sorted(bench_layer.CONFIGS))
parser.add_argument("--experts", type=positive_int, default=None, help="override the preset's expert count")
parser.add_argument("--top", type=positive_int, default=40, help="kernels listed (default 40)")
parser.add_argument("--iters", type=positive_int, default=5, help="profiled steps (default 5)")
parser.add_argument("--hlo", default=None, help="write the compiled HLO text here")
parser.add_argument("--decode", action="store_true", help="profile a decode preset's forward")
parser.add_argument("--ordered", action="store_true",
                    help="issue the EP calls with the ordering effect as several processes do "
                         "(jax_ep.ordering.needed; one process leaves it out), to time what it costs")
parser.add_argument("--no-command-buffer", action="store_true",
                    help="compile without XLA's command buffers (CUDA graphs), kernel by kernel as "
                         "benchmarks.layer's split runs the step, to see whether they change what runs "
                         "beside what")
args = parser.parse_args()
options = bench_layer.NO_COMMAND_BUFFERS if args.no_command_buffer else None
if args.ordered:
    from jax_ep import ordering  # noqa: E402

    ordering.needed = lambda: True

hidden, ffn, experts, topk, tokens = bench_layer.LAYER_PRESETS[args.shape]
experts = args.experts or experts
mesh = Mesh(np.array(jax.devices()), ("ep",))
print(f"{'decode forward' if args.decode else 'training step'} of {args.shape} (hidden {hidden}, ffn {ffn}, "
      f"experts {experts}, top-{topk}, {tokens} tokens/rank), config {args.config}, {mesh.size} device(s): "
      f"{jax.devices()[0].device_kind}")
if args.decode:
    layer, step, call_args = bench_layer.decode_step(mesh, (hidden, ffn, experts, topk, tokens), args.config,
                                                     bench_layer.SHARED_FFN.get(args.shape, 0))
    compiled = step.lower(*call_args).compile(options)
    call = lambda: compiled(*call_args)  # noqa: E731
else:
    layer, x = bench_layer.layer_and_tokens(mesh, (hidden, ffn, experts, topk, tokens), args.config,
                                            bench_layer.SHARED_FFN.get(args.shape, 0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    step, quantise = bench_layer.training_step(graphdef, rest)   # the step benchmarks.layer times
    # a config with cached FP8 weights (jax_ep_fp8_cached): quantised once here, outside the profiled steps
    fp8 = None
    if bench_layer.CONFIGS[args.config].get("fp8_cached"):
        fp8 = jax.block_until_ready(quantise(params))
        t0 = time.perf_counter()
        jax.block_until_ready(quantise(params))
        print(f"weight quantisation (once per optimiser step, not in the step): "
              f"{1e3 * (time.perf_counter() - t0):.3f} ms")
    compiled = step.lower(params, x, fp8).compile(options)
    call = lambda: compiled(params, x, fp8)  # noqa: E731
hlo = compiled.as_text()
if args.hlo:
    pathlib.Path(args.hlo).write_text(hlo)
memory = compiled.memory_analysis()
if memory is not None:
    print("memory (GiB): " + ", ".join(
        f"{k} {getattr(memory, k + '_size_in_bytes') / 2**30:.2f}"
        for k in ("argument", "output", "temp", "generated_code")))
scopes = bench_layer.hlo_scopes(hlo)
# the entry computation's schedule: what runs between each async start and its done
entry = hlo[hlo.index("\nENTRY"):]
body = [line.strip() for line in entry.splitlines()[1:] if " = " in line]
names = [line.split(" = ")[0].replace("ROOT ", "") for line in body]
for i, line in enumerate(body):
    if "async-start" in line or "-start(" in line:
        done = next((j for j in range(i + 1, len(body)) if names[i] in body[j] and "-done" in body[j]), None)
        between = [m.group(1) if (m := re.search(r" ([a-z][a-z0-9-]*)\(", b)) else "?"
                   for b in body[i + 1:done or i + 1]]
        print(f"ASYNC {names[i]}: {line[:90]}")
        print(f"   {len(between)} instructions until its done: {collections.Counter(between).most_common(6)}")

jax.block_until_ready(call())
t0 = time.perf_counter()
for _ in range(args.iters):
    out = call()
jax.block_until_ready(out)
print(f"step (wall, unprofiled): {1e3 * (time.perf_counter() - t0) / args.iters:.3f} ms")

data = bench_layer.profiled(call, args.iters)


def scope_of(event) -> tuple[str, str]:
    """(HLO instruction, its jax scope path shortened) of a GPU event, or ('?', '')."""
    words = [event.name, *(str(v) for _, v in getattr(event, "stats", ()))]
    for word in words:
        for token in re.split(r"[\s,;]+", word):
            if token in scopes:
                path = scopes[token]
                keep = [p for p in path.split("/") if p.startswith("moe_") or p in ("transpose", "jvp")]
                return token, "/".join(keep) or path[-60:]
    return "?", ""


by_kernel = collections.defaultdict(lambda: [0.0, 0, "", ""])
by_scope = collections.defaultdict(float)
for plane in data.planes:
    if not plane.name.startswith("/device:GPU:"):
        continue
    for line in plane.lines:
        events = list(line.events)
        if not events:
            continue
        busy = sum(e.duration_ns for e in events) / 1e6 / args.iters
        span = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1e6 / args.iters
        print(f"{plane.name} LINE {line.name!r}: {len(events)} events, {busy:.3f} ms busy, "
              f"{span:.3f} ms first start to last end, per step")
        if plane.name != "/device:GPU:0" or not line.name.startswith("Stream"):
            continue
        for e in events:
            hlo_name, scope = scope_of(e)
            entry = by_kernel[e.name[:90]]
            entry[0] += e.duration_ns / 1e6 / args.iters
            entry[1] += 1
            entry[2] = entry[2] or hlo_name
            entry[3] = entry[3] or scope
            by_scope[scope or "?"] += e.duration_ns / 1e6 / args.iters
summed_ms, union_ms = bench_layer.kernel_overlap_ms(data, args.iters)
print(f"device 0: kernels {summed_ms:.3f} ms, some kernel running {union_ms:.3f} ms, "
      f"kernels beside another {summed_ms - union_ms:.3f} ms per step")
# copies: where they sit in the chain of steps and what they carry (the profiler's stats)
t0_ns = min((e.start_ns for plane in data.planes if plane.name.startswith("/device:GPU:")
            for line in plane.lines for e in line.events), default=0)
for plane in data.planes:
    if not plane.name.startswith("/device:GPU:"):
        continue
    copies = [e for line in plane.lines for e in line.events if e.name.startswith(("Memcpy", "Memset"))]
    big = sorted(copies, key=lambda e: -e.duration_ns)[:8]
    for e in sorted(big, key=lambda e: e.start_ns):
        stats = {k: str(v)[:60] for k, v in getattr(e, "stats", ())}
        print(f"COPY {plane.name} {e.name} at {(e.start_ns - t0_ns) / 1e6:9.3f} ms, "
              f"{e.duration_ns / 1e6:7.3f} ms: {stats}")
for plane in data.planes:  # what the host spent its time on (transfers, launches, waits)
    if plane.name.startswith("/host"):
        host = collections.defaultdict(float)
        for line in plane.lines:
            for e in line.events:
                host[(line.name[:30], e.name[:70])] += e.duration_ns / 1e6 / args.iters
        for (line_name, ev_name), ms in sorted(host.items(), key=lambda kv: -kv[1])[:25]:
            print(f"HOST {ms:9.3f} ms  {line_name} | {ev_name}")
# the Mosaic GPU launches (the grouped GEMMs) one by one, in launch order, over the profiled steps: which
# pass takes what (they share one kernel name in the table below)
launches = sorted((e for plane in data.planes if plane.name == "/device:GPU:0" for line in plane.lines
                   if line.name.startswith("Stream") for e in line.events if "mosaic_gpu" in e.name),
                  key=lambda e: e.start_ns)
per_step = len(launches) // args.iters if args.iters else 0
for i in range(per_step):
    ms = sorted(e.duration_ns / 1e6 for e in launches[i::per_step])
    print(f"mosaic launch {i} of {per_step} per step: median {ms[len(ms) // 2]:.3f} ms")
# idle time of device 0's busiest stream inside the chain of steps: the gaps between one kernel's end and
# the next one's start, summed by the pair of kernels around them (what a step loses to launches, waits)
stream = max((line for plane in data.planes if plane.name == "/device:GPU:0" for line in plane.lines
              if line.name.startswith("Stream")), key=lambda line: len(list(line.events)), default=None)
if stream is not None:
    chain = sorted(stream.events, key=lambda e: e.start_ns)
    gaps = collections.defaultdict(lambda: [0.0, 0])
    busy_until = chain[0].end_ns if chain else 0
    for a, b in zip(chain, chain[1:], strict=False):
        idle = (b.start_ns - busy_until) / 1e3
        busy_until = max(busy_until, b.end_ns)
        if idle > 0:
            entry = gaps[(a.name[:48], b.name[:48])]
            entry[0] += idle / args.iters
            entry[1] += 1
    idle_total = sum(v[0] for v in gaps.values())
    print(f"\nidle on {stream.name!r}: {idle_total / 1e3:.3f} ms per step between kernels; largest by pair:")
    for (before, after), (us, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {us:8.1f} us  {n // args.iters:3d}x per step  {before} -> {after}")
total = sum(v[0] for v in by_kernel.values())
print(f"\nkernels on device 0 streams: {total:.3f} ms per step; top {args.top}:")
print(f"{'ms':>8} {'%':>5} {'calls':>5}  kernel | hlo | scope")
for name, (ms, calls, hlo_name, scope) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"{ms:8.3f} {100 * ms / total:5.1f} {calls // args.iters:5d}  {name} | {hlo_name} | {scope}")
# by kind of kernel, from the names: what a step is made of when the scopes are unknown ("?": XLA's GPU
# kernels often carry no jax scope)
KINDS = (("grouped GEMMs (Mosaic GPU)", ("mosaic_gpu",)), ("EP kernels (jax_ep CUDA)", ("jax_ep::",)),
         ("SwiGLU kernels (jax_ep Triton)", ("jax_ep_swiglu",)), ("NCCL", ("nccl",)),
         ("XLA / cuBLAS GEMMs", ("gemm", "xmma", "cutlass", "cublas")), ("copies", ("Memcpy", "Memset")))
by_kind = collections.defaultdict(float)
for name, (ms, *_rest) in by_kernel.items():
    kind = next((k for k, keys in KINDS if any(key in name for key in keys)), "other XLA kernels (fusions)")
    by_kind[kind] += ms
print("\nby kind:")
for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    print(f"{ms:8.3f} {100 * ms / total:5.1f}  {kind}")
print("\nper scope:")
for scope, ms in sorted(by_scope.items(), key=lambda kv: -kv[1]):
    print(f"{ms:8.3f} {100 * ms / total:5.1f}  {scope}")
