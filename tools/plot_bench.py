"""Plot time per call vs tokens per rank for each backend from a jax_ep.bench JSON file.

    python tools/plot_bench.py docs/benchmarks/h200x2.json docs/benchmarks/h200x2_tokens.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    records = json.load(open(src))
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
