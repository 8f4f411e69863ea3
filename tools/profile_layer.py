"""Diagnose how a profiled MoE layer step's GPU events map to the layer's named scopes: per device-0
line, the total time and the top events with their stats (what benchmarks.layer.split_by_scope relies on).

    python tools/profile_layer.py [mid|deepseek|small] [layer config, e.g. ep_cuda_async]

With a config whose EP ops run on an async stream, it also prints what the compiled schedule puts
between each async op's start and done (the work XLA overlaps with it).
"""

import collections
import glob
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import layer as bench_layer  # noqa: E402
from jax_ep import moe  # noqa: E402
from jax_ep.config import KernelConfig  # noqa: E402
from jax_ep.gating import RouterConfig  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "mid"
config = bench_layer.CONFIGS[sys.argv[2] if len(sys.argv) > 2 else "jax_ep"]
hidden, ffn, experts, topk, tokens = bench_layer.LAYER_PRESETS[name]
mesh = Mesh(np.array(jax.devices()), ("ep",))
layer = moe.MoE(hidden, ffn, RouterConfig(experts, topk), rngs=nnx.Rngs(0), mesh=mesh,
                ep=moe.EPOptions(backend=config["backend"], kernel=KernelConfig(**config.get("kernel", {}))),
                gemm=config["gemm"], param_dtype=jnp.bfloat16)
x = jax.device_put(jax.random.normal(jax.random.key(1), (mesh.size * tokens, hidden), jnp.bfloat16),
                   NamedSharding(mesh, P("ep")))
graphdef, params, rest = nnx.split(layer, nnx.Param, ...)


@jax.jit
def step(params, x):
    def loss(params, x):  # d x too, as benchmarks.layer
        return jnp.mean(nnx.merge(graphdef, params, rest)(x, update_stats=False).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)


hlo = step.lower(params, x).compile().as_text()
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
n_experts = sum("moe_experts" in v for v in scopes.values())
print("hlo instructions with op_name:", len(scopes), "in moe_experts:", n_experts)
iters = 5
jax.block_until_ready(step(params, x))
with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
        for _ in range(iters):
            out = step(params, x)
        jax.block_until_ready(out)
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
for plane in data.planes:
    if plane.name != "/device:GPU:0":
        continue
    for line in plane.lines:
        events = list(line.events)
        total = sum(e.duration_ns for e in events) / 1e6 / iters
        print(f"LINE {line.name!r}: {len(events)} events, {total:.3f} ms per step")
        by_name = collections.defaultdict(float)
        example = {}
        for e in events:
            by_name[e.name] += e.duration_ns / 1e6 / iters
            example.setdefault(e.name, e)
        for ev_name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
            stats = {k: str(v)[:80] for k, v in getattr(example[ev_name], "stats", ())}
            print(f"   {ms:8.3f} ms  {ev_name[:70]}  {stats}")
