"""Plot a `python -m benchmarks` JSON file: time per call vs tokens per rank for each backend, or, for a
``--layer`` file (records with op "moe_layer"), the MoE layer step split into its parts next to the
roofline.

    python tools/plot_bench.py docs/benchmarks/h200x2.json docs/benchmarks/h200x2_tokens.png
    python tools/plot_bench.py docs/benchmarks/h200x2_layer.json docs/benchmarks/h200x2_layer.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_layer(records, dst: str) -> None:
    """Stacked bars: each (layer shape, configuration)'s step split by part, and the roofline."""
    parts = ("experts", "dispatch", "combine", "router", "rest")
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rows = [r for r in records if r["shape"] == shape]
        # linear scale (stacked parts), cut above the fastest step so that it stays readable
        fastest = min((r["step_ms"] for r in rows if r["step_ms"]), default=1.0)
        top = 2.2 * max(fastest, rows[0]["roofline_ms"])
        labels = []
        for i, r in enumerate(rows):
            labels.append(f"{r['config']}\n({r['gemm']})")
            if r["step_ms"] is None:
                ax.text(i, 0, "failed\n(" + r.get("error", "")[:30] + ")", ha="center", fontsize=7)
                continue
            split = r["split_ms"] or {"rest": r["step_ms"]}
            bottom = 0.0
            for j, part in enumerate(parts):
                value = split.get(part, 0.0)
                ax.bar(i, value, bottom=bottom, color=f"C{j}", label=part if i == 0 else None)
                bottom += value
            ax.text(i, min(bottom, top), f"{r['step_ms']:.1f} ms" + (" (off scale)" if bottom > top else ""),
                    ha="center", va="bottom", fontsize=8)
        ax.axhline(rows[0]["roofline_ms"], color="k", ls="--", lw=1,
                   label=f"roofline {rows[0]['roofline_ms']:.2f} ms")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylim(0, top * 1.08)
        ax.set_ylabel("ms per training step (device 0, from the profile)")
        r0 = rows[0]
        ax.set_title(f"{shape}: hidden {r0['hidden']}, ffn {r0['ffn_hidden']}, {r0['num_experts']} experts, "
                     f"top-{r0['topk']}, {r0['tokens_per_rank']} tok/rank", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE layer training step, {records[0]['device']}, EP{records[0]['ep_size']} "
                 f"({records[0]['date']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(src: str, dst: str) -> None:
    records = json.load(open(src))
    if records and records[0]["op"] == "moe_layer":
        return plot_layer(records, dst)
    sweep = [r for r in records if r.get("run") == "tokens_sweep"]
    shape = {k: sweep[0][k] for k in ("hidden", "topk", "num_experts", "ep_size")}
    # the sweep, plus the preset run's points of the same shape (bf16, default SMs)
    records = sweep + [r for r in records if r.get("run") == "presets" and r["dtype"] == "bfloat16"
                       and all(r[k] == v for k, v in shape.items())
                       and r["tokens_per_rank"] not in {s["tokens_per_rank"] for s in sweep}]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for backend, style in (("cuda", "o-"), ("reference", "s-"), ("ragged", "^-")):
            rows = sorted((r["tokens_per_rank"], r["us"]) for r in records
                          if r["op"] == op and r["backend"] == backend)
            if rows:
                ax.plot([t for t, _ in rows], [u / 1e3 for _, u in rows], style, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_title(f"{op} (bf16)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per call (median wall time of a chain of calls)")
    axes[0].legend()
    r0 = records[0]
    fig.suptitle(f"jax_ep on {r0['device']}, EP{r0['ep_size']}, hidden {r0['hidden']}, top-{r0['topk']}, "
                 f"{r0['num_experts']} experts ({r0['date']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
