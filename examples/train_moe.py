"""Train a small MoE language model with expert parallelism, with and without load balancing.

    python examples/train_moe.py [--steps 40] [--out train_moe_out] [--mesh 2,4] [--backend auto]
                                 [--save DIR] [--restore DIR]
    python -m jax_ep.launch --nproc 2 --local-devices-per-process 4 examples/train_moe.py [...]

A decoder-only byte-level LM (examples/models.py: attention + MoE FFN layers) is trained on the source of a
few standard-library modules, under jit, with the MoE layers entering shard_map over a data x ep mesh
(tokens split over both axes, experts over "ep"). Without a GPU it runs on 8 virtual CPU devices.

The same model (same seed, same batches) is trained twice: without balancing and with DeepSeek-V3's
auxiliary-loss-free bias balancing (`MoE(balancing=BalancingConfig(bias_update_rate=...))`). Prints loss,
tokens/s and the expert imbalance (max/mean load); writes OUT/metrics.json and OUT/train_moe.png: loss
curves, imbalance curves, per-expert load heatmaps of both runs, and for each available backend the step
time split into dispatch+combine (timed on their own, `communication_time` of examples/demo.py) and the
rest of the step.

Checkpoints (``jax_ep.checkpoint``, Orbax): ``--save DIR`` writes each run's model and optimizer at the
end (DIR/no_balancing, DIR/bias_balancing) and the loss of each on a fixed check batch
(DIR/train_moe.json); ``--restore DIR`` starts each run from them, on the devices and mesh of this run
(another EP size works: the expert weights are resharded; the example's MoE layers have no expert
placement, which jax_ep.checkpoint would re-plan for the new EP size), and prints the restored model's
loss on the same check batch beside the saved one (equal to float32 rounding). The
data stream is not restored: the restored run draws its batches from the first again, steps from 0.
Give the restoring run its own --out (the default, train_moe_out, is the saving run's folder):

    python examples/train_moe.py --mesh 2,4 --save ckpt
    JAX_NUM_CPU_DEVICES=4 python examples/train_moe.py --mesh 2,2 --restore ckpt --out train_moe_restored

Started as several processes (``python -m jax_ep.launch``, SLURM, mpirun), it joins them with
``jax_ep.distributed.initialize()`` and builds the mesh over every process's devices; process 0 prints
and writes the outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from demo import communication_time
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    HelpFormatter,
    LMConfig,
    batches,
    build_training,
    corpus_bytes,
    gpu_moe_dtype,
    next_token_loss,
    require_at_least,
    require_finite,
    say,
    timed_steps,
    warm_median,
)

import jax_ep.checkpoint
import jax_ep.distributed
from jax_ep.balancing import imbalance
from jax_ep.devices import use_virtual_cpu_devices

RUNS = {"no_balancing": "without balancing", "bias_balancing": "with bias balancing"}
SHORT = {"no_balancing": "no balancing", "bias_balancing": "bias balancing"}
CHECK_SEED = 1234           # the batch of windows --save and --restore measure the loss on
CHECK_FILE = "train_moe.json"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (two runs)")
    parser.add_argument("--out", default="train_moe_out", help="directory for metrics.json and the plot")
    parser.add_argument("--mesh", default=None,
                        help="data,ep sizes, e.g. 2,4 (None: 1,<all devices>)")
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                        help="EPConfig.backend of the EP ops")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (each with a MoE FFN)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--bias-rate", type=float, default=1e-2,
                        help="bias update rate of the balanced run (softmax scores of 16 experts: ~0.06)")
    parser.add_argument("--seed", type=int, default=0, help="parameter and data seed")
    parser.add_argument("--remat", action="store_true",
                        help="rematerialise each block in the backward (nnx.remat), keeping dispatch's "
                             "results (jax_ep.remat.policy(): no exchange runs again)")
    parser.add_argument("--save", metavar="DIR", default=None,
                        help="save each run's model and optimizer at the end (Orbax, DIR/<run>, replaced "
                             "if there)")
    parser.add_argument("--restore", metavar="DIR", default=None,
                        help="start each run from the checkpoint --save wrote (any mesh of this run); give "
                             "this run its own --out, or it replaces the outputs there")
    args = parser.parse_args(argv)
    require_at_least(parser, args, ("batch", "seq", "experts", "layers"))

    num_devices = len(jax.devices())
    if args.mesh is None:
        args.mesh = (1, num_devices)
    else:
        try:
            args.mesh = tuple(int(v) for v in args.mesh.split(","))
        except ValueError:
            parser.error(f"--mesh must be two integers data,ep, got {args.mesh!r}")
        if len(args.mesh) != 2 or min(args.mesh) < 1:
            parser.error(f"--mesh must be two positive integers data,ep, got {args.mesh}")
    data, ep = args.mesh
    if data * ep > num_devices:
        parser.error(f"--mesh {data},{ep} needs {data * ep} devices, there are {num_devices}")
    if jax.process_count() > 1 and data * ep != num_devices:
        parser.error(f"--mesh {data},{ep}: with {jax.process_count()} processes the mesh must hold every "
                     f"device, {num_devices}")
    if args.batch % (data * ep):
        parser.error(f"--batch {args.batch} must be a multiple of the mesh size {data * ep}")
    if args.experts % ep:
        parser.error(f"--experts {args.experts} must be a multiple of the EP size {ep}")
    if args.experts < LMConfig.num_topk:   # (an EPValueError of RouterConfig's before 2026-12-06)
        parser.error(f"--experts {args.experts} must be at least the experts per token, {LMConfig.num_topk}")
    require_finite(parser, args, ("lr",), positive=True)
    require_finite(parser, args, ("bias_rate",), positive=False)   # (found after the first run had trained)
    require_at_least(parser, args, ("steps",), minimum=2)   # the two runs' first and last losses
    return args


@functools.partial(jax.jit, static_argnums=0)
def _loss_of_state(graphdef, state, batch):
    return next_token_loss(nnx.merge(graphdef, state), batch)


def check_loss(model, mesh: Mesh, args) -> float:
    """The model's loss on the fixed check batch (CHECK_SEED), computed on a copy: the model's load
    statistics and balancing bias stay as they are."""
    batch = next(batches(corpus_bytes(), args.batch, args.seq, seed=CHECK_SEED))
    batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    graphdef, state = nnx.split(model)
    return float(_loss_of_state(graphdef, state, batch))


def restore_run(model, optimizer, mesh: Mesh, args, name: str) -> dict:
    """Loads run `name` from --restore into the model and optimizer; its loss on the check batch, beside
    the one measured when it was saved."""
    directory = pathlib.Path(args.restore)
    jax_ep.checkpoint.restore(directory / name, model, optimizer)
    loss = check_loss(model, mesh, args)
    saved = json.loads((directory / CHECK_FILE).read_text())
    info = {"restored_from": str(directory / name), "check_loss": loss}
    if (saved["batch"], saved["seq"]) == (args.batch, args.seq):
        info["saved_check_loss"] = saved_loss = saved["check_loss"][name]
        say(f"[{RUNS[name]}] restored from {directory / name} (saved on mesh data x ep = "
            f"{saved['mesh'][0]} x {saved['mesh'][1]}): loss on the check batch {loss:.7f}, saved "
            f"{saved_loss:.7f}, difference {loss - saved_loss:.2g}")
    else:
        say(f"[{RUNS[name]}] restored from {directory / name}: loss on the check batch {loss:.7f} (saved "
            f"with --batch {saved['batch']} --seq {saved['seq']}: not comparable)")
    return info


def train(cfg: LMConfig, mesh: Mesh, args, label: str, name: str | None = None) -> dict:
    """Trains one model; returns its per-step loss, step time and per-layer, per-expert loads. With a run
    name, --restore loads the run before training and --save writes it after."""
    model, optimizer, train_step = build_training(cfg, mesh, args.lr, seed=args.seed)
    restored = restore_run(model, optimizer, mesh, args, name) if name and args.restore else None

    data = batches(corpus_bytes(), args.batch, args.seq, seed=args.seed)
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    losses, step_times, loads, dropped = [], [], [], []
    for step, loss, seconds in timed_steps(train_step, model, optimizer, data, batch_sharding, args.steps):
        losses.append(loss)
        step_times.append(seconds)
        loads.append(np.stack([np.asarray(m.last_load[...]) for m in model.moe_layers()]))   # [L, E]
        dropped.append(int(sum(int(m.last_dropped[...]) for m in model.moe_layers())))
        if step % 10 == 0 or step == args.steps - 1:
            per_layer = np.asarray(imbalance(jnp.asarray(loads[-1])))
            say(f"[{label}] step {step:4d}  loss {loss:.3f}  imbalance (max/mean) per layer "
                + " ".join(f"{v:.2f}" for v in per_layer))
    loads = np.stack(loads)                                                   # [steps, L, E]
    per_step = np.asarray(imbalance(jnp.asarray(loads)))                      # [steps, L]
    # imbalance of the load accumulated since step 0: what the bias (an integral controller) evens out
    cumulative = np.asarray(imbalance(jnp.asarray(np.cumsum(loads, axis=0))))  # [steps, L]
    step_time = warm_median(step_times)
    checkpoint = {}
    if restored:
        checkpoint["restored"] = restored
    if name and args.save:
        path = jax_ep.checkpoint.save(pathlib.Path(args.save) / name, model, optimizer, overwrite=True)
        checkpoint["saved"] = {"path": path, "check_loss": check_loss(model, mesh, args)}
        say(f"[{label}] saved to {path}: loss on the check batch {checkpoint['saved']['check_loss']:.7f}")
    return {"checkpoint": checkpoint,
            "loss": losses, "step_time_s": step_times, "median_step_time_s": step_time,
            "tokens_per_s": args.batch * args.seq / step_time,
            "expert_load": loads.tolist(), "imbalance": per_step.mean(axis=1).tolist(),
            "imbalance_per_layer": per_step.tolist(), "mean_imbalance": float(per_step.mean()),
            "imbalance_cumulative": cumulative.mean(axis=1).tolist(),
            "imbalance_total": float(cumulative[-1].mean()), "dropped": dropped}


def step_time_only(cfg: LMConfig, mesh: Mesh, args, steps: int = 6) -> float:
    """Median step time of a short run (for a backend the training runs did not use)."""
    short = argparse.Namespace(**{**vars(args), "steps": steps})
    return train(cfg, mesh, short, f"timing {cfg.backend}")["median_step_time_s"]


def communication_view(cfg: LMConfig, mesh: Mesh, args, trained_step_time: float) -> dict:
    """Per available backend: step time of the model, and the part spent in dispatch+combine."""
    tokens_per_rank = args.batch * args.seq // mesh.size
    comm = {}
    for backend in ("reference", "cuda"):
        try:
            comm[backend] = communication_time(mesh, cfg, tokens_per_rank, backend)
        except (ImportError, RuntimeError, NotImplementedError) as e:
            say(f"backend {backend!r}: not available here: {' '.join(str(e).split())}")
    # "auto" trains on cuda kernels where they are available, the reference path otherwise
    trained = args.backend if args.backend != "auto" else ("cuda" if "cuda" in comm else "reference")
    result = {}
    for backend, comm_s in comm.items():
        try:
            step = trained_step_time if backend == trained else step_time_only(
                dataclasses.replace(cfg, backend=backend), mesh, args)
        except (RuntimeError, NotImplementedError) as e:       # e.g. an op without a kernel
            say(f"backend {backend!r}: the model does not run: {' '.join(str(e).split())}")
            continue
        result[backend] = {"dispatch_combine_s": comm_s, "step_time_s": step, "share": comm_s / step}
        say(f"backend {backend!r}: step {1e3 * step:.1f} ms, dispatch+combine (fwd+bwd, "
            f"{cfg.num_layers} layers) {1e3 * comm_s:.1f} ms = {100 * comm_s / step:.0f}% of the step")
    return result


def plot(metrics: dict, path: pathlib.Path):
    """Draws the figure into path; returns it (closed: for its axes: loss, imbalance, step time, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = metrics["runs"]
    colors = {"no_balancing": "tab:red", "bias_balancing": "tab:blue"}
    # the two loss curves often lie on top of each other: a line style and markers tell them apart
    styles = {"no_balancing": dict(ls="-", marker="o", lw=2.5, alpha=0.8),
              "bias_balancing": dict(ls="--", marker="x", lw=1.5)}
    fig = plt.figure(figsize=(16, 10), layout="constrained")
    grid = fig.add_gridspec(2, 6, height_ratios=[1, 1.15])
    ax_loss, ax_imb, ax_comm = (fig.add_subplot(grid[0, 2 * i:2 * i + 2]) for i in range(3))
    heat_axes = [fig.add_subplot(grid[1, 0:3]), fig.add_subplot(grid[1, 3:6])]

    for name, run in runs.items():
        steps = np.arange(len(run["loss"]))
        ax_loss.plot(steps, run["loss"], color=colors[name], label=RUNS[name], **styles[name],
                     markevery=max(1, len(steps) // 12), ms=6)
        ax_imb.plot(steps, run["imbalance"], color=colors[name], alpha=0.5, lw=1,
                    label=f"{SHORT[name]}: per step (mean {run['mean_imbalance']:.2f})")
        ax_imb.plot(steps, run["imbalance_cumulative"], color=colors[name], lw=2.5,
                    label=f"{SHORT[name]}: load summed since step 0")
    ax_loss.set(title="Training loss", xlabel="step", ylabel="next-byte cross-entropy")
    ax_imb.axhline(1.0, color="gray", ls=":", lw=1)
    top = max(max(run["imbalance"]) for run in runs.values())
    ax_imb.set(title="Expert load imbalance (1 = balanced)", xlabel="step",
               ylabel="max / mean expert load (mean over layers)", ylim=(0, 1.6 * top))
    ax_imb.legend(loc="upper center", fontsize="small")
    ax_loss.legend()
    for ax in (ax_loss, ax_imb):
        ax.grid(alpha=0.3)

    comm = metrics["communication"]
    names = list(comm)
    step_ms = np.array([1e3 * comm[b]["step_time_s"] for b in names])
    comm_ms = np.array([1e3 * comm[b]["dispatch_combine_s"] for b in names])
    rest_ms = np.maximum(step_ms - comm_ms, 0)
    y = np.arange(len(names))
    ax_comm.barh(y, comm_ms, height=0.5, color="tab:orange",
                 label="dispatch + combine (fwd + bwd, timed alone)")
    ax_comm.barh(y, rest_ms, height=0.5, left=comm_ms, color="tab:gray", alpha=0.6,
                 label="rest of the step (= step without EP comm)")
    longest = max(step_ms.max(initial=0.0), 1e-9)
    for i, b in enumerate(names):
        # inside a long bar (the axis needs no room beyond the longest one), after a short one
        inside = step_ms[i] > 0.5 * longest
        pad = "" if inside else " "
        text = f"{pad}{step_ms[i]:.3g} ms, {100 * comm[b]['share']:.1f}% in\n{pad}dispatch+combine"
        ax_comm.text(step_ms[i], y[i], text + (" " if inside else ""), va="center",
                     ha="right" if inside else "left", fontsize="small")
    ax_comm.set_yticks(y, names)
    ax_comm.set_xlim(0, 1.05 * longest)
    ax_comm.set_ylim(-0.5, len(names) - 0.5)
    ax_comm.set(title="Step time per backend, EP communication share", xlabel="ms per training step",
                ylabel="backend")
    ax_comm.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize="small")

    loads = {name: np.asarray(run["expert_load"], np.float64) for name, run in runs.items()}   # [S, L, E]
    rel = {name: load / np.maximum(load.mean(axis=-1, keepdims=True), 1e-9) for name, load in loads.items()}
    # white = balanced (1), red = overloaded, blue = underloaded (0 = no tokens)
    norm = matplotlib.colors.TwoSlopeNorm(vmin=0.0, vcenter=1.0,
                                          vmax=max(2.0, max(float(r.max()) for r in rel.values())))
    num_layers, num_experts = next(iter(loads.values())).shape[1:]
    for ax, (name, r) in zip(heat_axes, rel.items(), strict=True):
        image = r.reshape(r.shape[0], -1).T                                   # [L*E, steps]
        im = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                       origin="upper")
        for layer in range(1, num_layers):
            ax.axhline(layer * num_experts - 0.5, color="black", lw=1.5)
        ticks = [layer * num_experts + e for layer in range(num_layers) for e in range(0, num_experts, 4)]
        ax.set_yticks(ticks, [f"L{t // num_experts} e{t % num_experts}" for t in ticks], fontsize="small")
        ax.set(title=f"Per-expert load / mean, {RUNS[name]}", xlabel="step", ylabel="layer, expert")
    fig.colorbar(im, ax=heat_axes, label="load / mean load (1 = balanced)", shrink=0.9)

    cfg = metrics["config"]
    fig.suptitle(f"jax_ep train_moe: {cfg['devices']}, mesh data x ep = {cfg['mesh'][0]} x {cfg['mesh'][1]}, "
                 f"{cfg['model']['num_experts']} experts top-{cfg['model']['num_topk']}, "
                 f"{cfg['model']['num_layers']} MoE layers, {cfg['steps']} steps x {cfg['tokens_per_step']} "
                 f"tokens, bias rate {cfg['bias_rate']}", fontsize="large")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main(argv=None) -> dict:
    if jax_ep.distributed.launched_by():   # one of several processes: join them (jax.distributed)
        jax_ep.distributed.initialize()
    use_virtual_cpu_devices()   # before the first device query (parse_args counts the devices)
    args = parse_args(argv)
    data, ep = args.mesh
    devices = jax.devices()[:data * ep]                 # every process's devices
    mesh = Mesh(np.array(devices).reshape(data, ep), ("data", "ep"))
    cfg = LMConfig(num_experts=args.experts, num_layers=args.layers, backend=args.backend,
                   moe_dtype=gpu_moe_dtype(), remat=args.remat)
    tokens = args.batch * args.seq
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"train_moe: {len(devices)} x {devices[0].platform} devices{processes}, mesh data x ep = {data} x "
        f"{ep}, {cfg.num_experts} experts top-{cfg.num_topk}, {cfg.num_layers} MoE layers, "
        f"{tokens} tokens/step, backend={args.backend}")

    runs = {}
    for name, rate in (("no_balancing", 0.0), ("bias_balancing", args.bias_rate)):
        start = time.perf_counter()
        try:
            runs[name] = train(dataclasses.replace(cfg, bias_update_rate=rate), mesh, args, RUNS[name], name)
        except jax_ep.checkpoint.CheckpointMismatchError as e:   # e.g. --restore with other --experts
            raise SystemExit(f"train_moe.py: --restore: {e}") from None
        run = runs[name]
        say(f"[{RUNS[name]}] loss {run['loss'][0]:.3f} -> {run['loss'][-1]:.3f}, "
            f"{run['tokens_per_s']:,.0f} tokens/s, imbalance (max/mean) per step "
            f"{run['mean_imbalance']:.2f}, of the run's total load {run['imbalance_total']:.2f}, "
            f"{time.perf_counter() - start:.0f} s with compilation")
    comm = communication_view(cfg, mesh, args, runs["bias_balancing"]["median_step_time_s"])

    out = pathlib.Path(args.out)
    metrics = {
        "config": {"devices": f"{len(devices)} x {devices[0].platform}", "mesh": [data, ep],
                   "steps": args.steps, "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens,
                   "lr": args.lr, "bias_rate": args.bias_rate, "seed": args.seed, "backend": args.backend,
                   "save": args.save, "restore": args.restore,
                   "model": dataclasses.asdict(cfg)},
        "runs": runs,
        "communication": comm,
    }
    if jax.process_index() == 0:
        if args.save:   # what --restore compares with
            record = {"mesh": [data, ep], "batch": args.batch, "seq": args.seq, "check_seed": CHECK_SEED,
                      "check_loss": {n: run["checkpoint"]["saved"]["check_loss"] for n, run in runs.items()}}
            (pathlib.Path(args.save) / CHECK_FILE).write_text(json.dumps(record, indent=1))
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        plot(metrics, out / "train_moe.png")
    for key, what in (("mean_imbalance", "per step, mean over the run"),
                      ("imbalance_total", "of the load summed over the run")):
        say(f"expert imbalance (max/mean) {what}: {runs['no_balancing'][key]:.2f} without balancing, "
            f"{runs['bias_balancing'][key]:.2f} with bias balancing")
    say(f"wrote {out / 'metrics.json'} and {out / 'train_moe.png'}")
    return metrics


if __name__ == "__main__":
    main()
