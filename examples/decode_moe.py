"""Greedy decoding of the example MoE LM with jax_ep's low-latency ops, on all local devices.

    python examples/decode_moe.py [--batch 16] [--prompt-len 32] [--steps 32] [--backend auto]

Builds the byte-level MoE LM of examples/models.py with its experts split over every local device (the
GPUs, or 8 virtual CPU devices without one), with random weights (or after --train-steps steps of
training on the source of a few standard-library modules), then:

1. prefill: one forward over a batch of prompts (windows of that text) fills every attention layer's
   key/value cache; its MoE layers run the throughput ops (dispatch / combine);
2. decode: --steps greedy steps of one token per sequence (``model.decode_step``: attention over the
   cache, the MoE layers on ``jax_ep.ll_dispatch`` / ``ll_combine``), each a compiled call timed from
   the call to its token being ready;
3. prints the per-step latency (median, p90), and the share of it spent in dispatch/combine: a program
   of only the step's ll_dispatch + ll_combine calls (one pair per MoE layer, chained, same shapes and
   wire dtype, random routing), compiled and timed the same way, divided by the step's median;
4. checks the tokens: the full forward over prompt + generated text (throughput ops, no cache) must pick
   the same greedy tokens, up to near-ties that the bf16 roundings of the low-latency path can flip.

It prints first which backend each op resolved to (``--backend auto``: the CUDA kernel or the pure-JAX
reference, per op).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    HelpFormatter,
    LMConfig,
    MoETransformerLM,
    batches,
    build_training,
    corpus_bytes,
    gpu_moe_dtype,
    require_at_least,
    shard_model,
    timed_steps,
)

from jax_ep.config import EPConfig
from jax_ep.devices import use_virtual_cpu_devices
from jax_ep.ops import OPS, ll_combine, ll_dispatch

PREFILL_OPS = ("layout", "dispatch", "combine")
DECODE_OPS = ("ll_dispatch", "ll_combine")


def parse_args(argv, num_devices: int):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--batch", type=int, default=2 * num_devices,
                        help="sequences decoded together (all devices; a multiple of the device count, 2 per "
                        "device by default)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt bytes per sequence")
    parser.add_argument("--steps", type=int, default=32, help="decode steps (one token per sequence each)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="AdamW steps on the text before decoding (0: random weights)")
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                        help="EPOptions.backend of the MoE layers (and of the dispatch/combine-only program)")
    parser.add_argument("--dispatch-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                        help="wire dtype of the tokens (FP8 needs --hidden a multiple of 128)")
    parser.add_argument("--experts", type=int, default=2 * num_devices,
                        help="experts per MoE layer (a multiple of the device count; 2 per device)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (one MoE layer each)")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--ffn-hidden", type=int, default=128, help="width of each expert's SwiGLU")
    parser.add_argument("--repeats", type=int, default=50,
                        help="timed runs of the dispatch/combine-only program (median)")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and routing of the timing")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.batch % num_devices:
        parser.error(f"--batch {args.batch} must be a positive multiple of the device count {num_devices}")
    if args.experts < 1 or args.experts % num_devices:
        parser.error(f"--experts {args.experts} must be a positive multiple of the device count "
                     f"{num_devices}")
    require_at_least(parser, args, ("prompt_len", "steps", "layers", "hidden", "ffn_hidden", "repeats",
                                    "topk"))
    require_at_least(parser, args, ("train_steps",), minimum=0)
    if args.topk > args.experts:
        parser.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if args.hidden % LMConfig.num_heads:   # (Flax's error about a "memory dimension" before 2026-12-06)
        parser.error(f"--hidden {args.hidden} must be a multiple of the attention heads, "
                     f"{LMConfig.num_heads}")
    if args.dispatch_dtype == "float8_e4m3fn" and args.hidden % 128:
        parser.error(f"--dispatch-dtype float8_e4m3fn needs --hidden a multiple of 128, got {args.hidden}")
    return args


def resolved(ops, cfg: EPConfig, ep_size: int, dtype) -> str:
    """'op -> reference | cuda | unavailable: why' for each op, as jax_ep resolves cfg.backend when the
    op is traced at cfg's sizes on this machine."""
    out = []
    for op in ops:
        try:
            module = OPS[op].implementation(cfg, ep_size, dtype).__module__
            impl = {"jax_ep.reference": "reference", "jax_ep.cuda_backend": "cuda"}.get(module, module)
        except (ImportError, RuntimeError, NotImplementedError, ValueError) as e:
            impl = f"unavailable: {e}"
        out.append(f"{op} -> {impl}")
    return ", ".join(out)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def comm_only_program(mesh: Mesh, cfg: EPConfig, num_layers: int):
    """A jitted program of the decode step's EP ops alone: per MoE layer one ll_dispatch and one
    ll_combine of the received slots (as the experts' output), each layer's output the next one's
    input (so nothing runs in parallel or is computed once for all layers)."""
    axes = tuple(mesh.axis_names)

    def per_rank(x, topk_idx, topk_weights):       # x [T, H], routing [L, T, K]
        for layer in range(num_layers):
            d = ll_dispatch(x, topk_idx[layer], topk_weights[layer], cfg)
            x = ll_combine(d.x.astype(jnp.bfloat16), d.handle, cfg)
        return x

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(axes), P(None, axes), P(None, axes)),
                                 out_specs=P(axes)))


def comm_only_inputs(cfg: EPConfig, num_tokens: int, num_layers: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, cfg.hidden)).astype(jnp.bfloat16)
    idx = np.argsort(rng.random((num_layers, num_tokens, cfg.num_experts)), axis=2)[..., :cfg.num_topk]
    w = rng.random((num_layers, num_tokens, cfg.num_topk)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(idx, jnp.int32), jnp.asarray(w)


def main(argv=None) -> None:
    use_virtual_cpu_devices()
    devices = jax.local_devices()
    args = parse_args(argv, len(devices))
    mesh = Mesh(np.array(devices), ("ep",))
    ep_size = mesh.size
    cfg = LMConfig(hidden=args.hidden, ffn_hidden=args.ffn_hidden, num_layers=args.layers,
                   num_experts=args.experts, num_topk=args.topk, backend=args.backend,
                   dispatch_dtype=args.dispatch_dtype, moe_dtype=gpu_moe_dtype())
    moe_dtype = jnp.dtype(cfg.moe_dtype or jnp.float32)
    batch, prompt_len, steps = args.batch, args.prompt_len, args.steps
    print(f"jax_ep decode: {ep_size} x {devices[0].platform} devices, EP size {ep_size}, {args.experts} "
          f"experts, top-{args.topk}, {args.layers} MoE layers, hidden {args.hidden}, {batch} sequences "
          f"({batch // ep_size} per device), prompts of {prompt_len} bytes, {steps} decode steps, "
          f"wire {args.dispatch_dtype}, backend={args.backend}", flush=True)
    prefill_cfg = EPConfig(args.experts, args.topk, args.hidden, batch * prompt_len // ep_size,
                           backend=args.backend, dispatch_dtype=args.dispatch_dtype)
    decode_cfg = EPConfig(args.experts, args.topk, args.hidden, batch // ep_size, backend=args.backend,
                          dispatch_dtype=args.dispatch_dtype)
    print(f"backend {args.backend} resolved per op: prefill (throughput) "
          f"{resolved(PREFILL_OPS, prefill_cfg, ep_size, moe_dtype)}; decode (low latency) "
          f"{resolved(DECODE_OPS, decode_cfg, ep_size, moe_dtype)}", flush=True)

    text = corpus_bytes()
    tokens_sharding = NamedSharding(mesh, P("ep"))
    if args.train_steps:
        model, optimizer, train_step = build_training(cfg, mesh, 3e-3, seed=args.seed)
        data = batches(text, batch, prompt_len + steps, seed=args.seed + 1)
        losses = [loss for _, loss, _ in timed_steps(train_step, model, optimizer, data, tokens_sharding,
                                                     args.train_steps)]
        print(f"trained {args.train_steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
        del optimizer
    else:
        model = MoETransformerLM(cfg, rngs=nnx.Rngs(args.seed), mesh=mesh)
        shard_model(model, mesh)
    model.init_cache(batch, prompt_len + steps, mesh=mesh)

    # compiled functions of (parameters, the rest of the state: caches, statistics), the state donated:
    # a step is the compiled program and nothing else (no Python graph traversal)
    graphdef, params, state = nnx.split(model, nnx.Param, ...)

    def run(method, params, state, tokens):
        m = nnx.merge(graphdef, params, state)
        logits = getattr(m, method)(tokens)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), nnx.state(m, nnx.Not(nnx.Param))

    prompts = jax.device_put(next(batches(text, batch, prompt_len - 1, seed=args.seed + 2)), tokens_sharding)
    token = jax.device_put(jnp.zeros((batch,), jnp.int32), tokens_sharding)
    start = time.perf_counter()
    prefill = jax.jit(functools.partial(run, "prefill"), donate_argnums=1).lower(
        params, state, prompts).compile()
    decode = jax.jit(lambda p, s, t: run("decode_step", p, s, t[:, None]), donate_argnums=1).lower(
        params, state, token).compile()
    compile_s = time.perf_counter() - start

    start = time.perf_counter()
    token, state = prefill(params, state, prompts)
    token.block_until_ready()
    prefill_s = time.perf_counter() - start
    generated, step_s = [token], []
    for _ in range(steps):
        start = time.perf_counter()
        token, state = decode(params, state, token)
        token.block_until_ready()
        step_s.append(time.perf_counter() - start)
        generated.append(token)
    generated = np.stack([np.asarray(t) for t in generated], axis=1)           # [B, steps + 1]
    median, p90 = float(np.median(step_s)), float(np.percentile(step_s, 90))
    print(f"compile {compile_s:.1f} s (prefill + decode step); prefill {1e3 * prefill_s:.1f} ms "
          f"({batch} x {prompt_len} tokens)", flush=True)
    print(f"decode step latency over {steps} steps ({batch} tokens per step): median "
          f"{1e3 * median:.2f} ms, p90 {1e3 * p90:.2f} ms; {batch / median:,.0f} tokens/s", flush=True)

    # dispatch/combine alone: the step's ll_dispatch + ll_combine calls, same shapes, in their own program
    comm = comm_only_program(mesh, decode_cfg, args.layers)
    comm_args = comm_only_inputs(decode_cfg, batch, args.layers, args.seed)
    compiled = comm.lower(*comm_args).compile()
    # placed as the program takes them (else every timed call first scatters them over the mesh, which
    # the step's timings do not), and one untimed call first (a first run's one-time costs)
    comm_args = [jax.device_put(a, s) for a, s in zip(comm_args, compiled.input_shardings[0], strict=True)]
    timed(compiled, *comm_args)
    comm_s = float(np.median([timed(compiled, *comm_args) for _ in range(args.repeats)]))
    print(f"dispatch/combine: {1e3 * comm_s:.2f} ms = {100 * comm_s / median:.0f}% of the median decode step "
          f"(measured: a compiled program of only the step's {args.layers} ll_dispatch + ll_combine pairs, "
          f"same shapes and wire dtype, random routing, median of {args.repeats} runs, against the "
          "median step)", flush=True)

    # the tokens, checked against the full forward over prompt + generated text (no cache)
    model = nnx.merge(graphdef, params, state)
    sequences = np.concatenate([np.asarray(prompts), generated], axis=1)
    full = nnx.jit(lambda m, t: m(t))(model, jax.device_put(sequences[:, :-1], tokens_sharding))
    picked = np.argmax(np.asarray(full[:, prompt_len - 1:]), axis=-1)
    agree = int(np.sum(picked == generated))
    print(f"check: the full forward (throughput ops, no cache) picks {agree} of the {generated.size} "
          "generated tokens", flush=True)
    for row in range(min(2, batch)):
        print(f"sample {row}: {bytes(np.asarray(prompts[row], np.uint8)).decode('latin-1')!r} -> "
              f"{bytes(generated[row].astype(np.uint8)).decode('latin-1')!r}")
    if agree < 0.9 * generated.size:
        raise SystemExit("jax_ep decode: the cached low-latency decode disagrees with the full forward")


if __name__ == "__main__":
    main()
