"""Plot a `python -m benchmarks` JSON file: time per call vs tokens per rank, one line per backend, layout
and dtype (device µs where profiled, else wall µs), one row of panels per shape; or, for a
``--layer`` file (records with op "moe_layer"), the MoE layer step split into its parts next to the
roofline.

    python tools/plot_bench.py docs/benchmarks/h200x2.json docs/benchmarks/h200x2_tokens.png
    python tools/plot_bench.py docs/benchmarks/h200x2_layer.json docs/benchmarks/h200x2_layer.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_layer(records, dst: str) -> None:
    """Stacked bars: each (layer shape, configuration)'s step split by part, and the roofline."""
    parts = ("experts", "dispatch", "combine", "router", "shared", "rest")
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rows = [r for r in records if r["shape"] == shape]
        # linear scale (stacked parts), cut above the fastest step so that it stays readable
        fastest = min((r["step_ms"] for r in rows if r["step_ms"]), default=1.0)
        top = 2.2 * max(fastest, rows[0]["roofline_ms"])
        labels, drawn = [], set()
        for i, r in enumerate(rows):
            labels.append(f"{r['config']}\n({r['gemm']})")
            if r["step_ms"] is None:
                ax.text(i, 0, "failed\n(" + r.get("error", "")[:30] + ")", ha="center", fontsize=7)
                continue
            # without a profile (--profile) the whole step is one bar: wall-clock time
            split = r["split_ms"] or {"wall step (no profile)": r["step_ms"]}
            bottom = 0.0
            for j, part in enumerate(parts if r["split_ms"] else tuple(split)):
                value = split.get(part, 0.0)
                ax.bar(i, value, bottom=bottom, color=f"C{j}" if r["split_ms"] else "0.6",
                       label=part if part not in drawn else None)
                drawn.add(part)
                bottom += value
            ax.text(i, min(bottom, top), f"{r['step_ms']:.1f} ms" + (" (off scale)" if bottom > top else ""),
                    ha="center", va="bottom", fontsize=8)
        ax.axhline(rows[0]["roofline_ms"], color="k", ls="--", lw=1,
                   label=f"roofline {rows[0]['roofline_ms']:.2f} ms")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylim(0, top * 1.08)
        kinds = {bool(r["split_ms"]) for r in rows if r["step_ms"] is not None}
        ax.set_ylabel("ms per step " + ("(device 0, profile)" if kinds == {True} else "(wall clock)"
                                        if kinds == {False} else "(profile, else wall)"))
        r0 = rows[0]
        ax.set_title(f"{shape}: hidden {r0['hidden']}, ffn {r0['ffn_hidden']}, {r0['num_experts']} experts, "
                     f"top-{r0['topk']}, {r0['tokens_per_rank']} tok/rank", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE layer training step, {records[0]['device']}, EP{records[0]['ep_size']} "
                 f"({records[0]['date']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def device_us(r, records) -> float | None:
    """The record's device time per call: ``device_us``, or for files written before that field the sum
    of ``kernels_us`` (ragged combine: its round trip minus the matching dispatch)."""
    if r.get("device_us") is not None:
        return r["device_us"]
    if not r.get("kernels_us"):
        return None
    total = sum(r["kernels_us"].values())
    if r["backend"] == "ragged" and r["op"] == "combine":
        keys = ("run", "backend", "tokens_per_rank", "hidden", "topk", "num_experts", "ep_size")
        disp = [d for d in records if d["op"] == "dispatch" and d.get("kernels_us")
                and all(d.get(k) == r.get(k) for k in keys)]
        if not disp:
            return None
        total -= sum(disp[-1]["kernels_us"].values())
    return total


MARKERS = {"cuda": "o", "reference": "s", "dense": "D", "ragged": "^"}


def plot_ops(records, dst: str) -> None:
    """Time per call over tokens per rank: one row of panels (dispatch, combine) per shape, one line per
    backend, layout and dtype (solid: expert-major rows, dashed: rank-major). A line shows device µs
    when every one of its points was profiled, else wall µs (the label says which). Published figures
    (``measured: false``) are single stars."""
    records = [r for r in records if r.get("run") != "sm_sweep"]   # older files: the SM tuning sweep
    shapes = list(dict.fromkeys((r["hidden"], r["topk"], r["num_experts"]) for r in records
                                if r.get("measured", True)))
    if not shapes:
        raise SystemExit("no measured records to plot")
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 4.4 * len(shapes)), squeeze=False)
    for row, (hidden, topk, experts) in zip(axes, shapes, strict=True):
        for ax, op in zip(row, ("dispatch", "combine"), strict=True):
            # jax_ep's rank-major ops (python -m benchmarks --rank-major) join their expert-major panel
            panel = [r for r in records if r["op"] in (op, f"{op}_rank_major")
                     and (r["hidden"], r["topk"], r["num_experts"]) == (hidden, topk, experts)]
            def line_of(r):   # one line per backend, layout, dtype and rows pushed / pulled
                return (r["backend"], r.get("layout", "expert_major"), r["dtype"], r.get("pull"))

            lines = list(dict.fromkeys(line_of(r) for r in panel))
            for i, (backend, layout, dtype, pull) in enumerate(lines):
                rows = [r for r in panel if line_of(r) == (backend, layout, dtype, pull)]
                short = {"float8_e4m3fn": "fp8", "bfloat16": "bf16"}.get(dtype, dtype)
                label = f"{backend} {layout} {short}" + ("" if pull is None else " pull" if pull else " push")
                if not rows[0].get("measured", True):
                    for r in rows:
                        ax.plot(r["tokens_per_rank"], r["us"], "*", ms=14,
                                color="k" if short == "bf16" else "0.5",
                                label=f"{label} (EP{r['ep_size']}, {r['num_sms']} SMs, not measured here)")
                    continue
                sms = [r["num_sms"] for r in rows]
                default = max(set(sms), key=sms.count)                 # one SM count per line
                points = {r["tokens_per_rank"]: r for r in rows if r["num_sms"] == default}  # last wins
                tokens = sorted(points)
                device = [device_us(points[t], records) for t in tokens]
                use_device = all(d is not None for d in device)
                values = device if use_device else [points[t]["us"] for t in tokens]
                on = "" if default is None else f", {default} SMs"
                ax.plot(tokens, values, marker=MARKERS.get(backend, "x"),
                        ls="--" if layout == "rank_major" else "-", color=f"C{i}",
                        label=f"{label} ({'device' if use_device else 'wall'}{on})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("µs per call")
            ax.set_title(f"{op}: hidden {hidden}, top-{topk}, {experts} experts", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    r0 = next(r for r in records if r.get("measured", True))
    fig.suptitle(f"jax_ep on {r0['device']}, EP{r0['ep_size']} ({r0['date']}); device µs = profiled kernels, "
                 "wall µs = median of chained calls", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(src: str, dst: str) -> None:
    records = json.load(open(src))
    # a --layer file: its training-step records (decode records, written first, are not steps)
    steps = [r for r in records if r.get("op") == "moe_layer"]
    if steps:
        return plot_layer(steps, dst)
    return plot_ops(records, dst)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", metavar="SRC", help="JSON records of python -m benchmarks (with or without "
                        "--rank-major) or of python -m benchmarks --layer")
    parser.add_argument("dst", metavar="DST", help="the PNG to write")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    main(args.src, args.dst)
