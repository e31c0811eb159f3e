"""Plots of qurl runs: `python tools/plot.py RUN [RUN ...] [--out fig.png]`.

Reward, held-out accuracy, mismatch KL, sampled entropy, clip fractions, the share of truncated
importance weights and flip rate per step of each run folder's metrics.jsonl (per-step series
smoothed), one line per run.
"""

import argparse
import json
import sys
from pathlib import Path

PANELS = {
    "reward/mean": "reward (train)",
    "eval/acc": "held-out accuracy (greedy)",
    "mismatch/kl": "mismatch KL(pi_behav||pi_prox)",
    "rollout/entropy": "entropy (sampled tokens)",
    "clip/low": "clip/low (gradient zeroed)",
    "clip/high": "clip/high (gradient zeroed)",
    "mismatch/w_truncated": "share of weights w truncated at C",
    "quant/flip_rate": "quant flip rate",
}


def _smooth(points: list[tuple], window: int) -> list[tuple]:
    """Each value replaced by the mean of it and the `window` before it."""
    out = []
    for i, (x, _) in enumerate(points):
        values = [v for _, v in points[max(0, i - window) : i + 1]]
        out.append((x, sum(values) / len(values)))
    return out


def plot_runs(run_dirs: list[str], out: str = "runs.png"):
    """One panel per metric in PANELS, one line per run; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 7.2))
    for run in run_dirs:
        metrics, summary = Path(run) / "metrics.jsonl", Path(run) / "summary.json"
        if not metrics.is_file():
            sys.exit(f"plot: {metrics} not found (is {run} a run folder?)")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        start = json.loads(summary.read_text()).get("start_eval_acc") if summary.is_file() else None
        for ax, (key, title) in zip(axes.flat, PANELS.items()):
            points = [(0, start)] if key == "eval/acc" and start is not None else []
            points += [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if key == "mismatch/kl":  # a log axis: an exact zero (--quant none) sits at 1e-12
                points = [(x, max(v, 1e-12)) for x, v in points]
            if key != "eval/acc" and len(points) > 20:
                points = _smooth(points, max(1, len(points) // 25))
            if points:
                marker = "o" if key == "eval/acc" else None
                ax.plot(*zip(*points), label=Path(run).name, marker=marker, markersize=3)
            ax.set(title=title, xlabel="step", yscale="log" if key == "mismatch/kl" else "linear")
    for ax in axes.flat:
        if ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not 1e-12 + x
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tools/plot.py", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (runs/NAME)")
    parser.add_argument("--out", default="runs.png", help="the figure to write")
    opts = parser.parse_args(argv)
    plot_runs(opts.runs, opts.out)


if __name__ == "__main__":
    main()
