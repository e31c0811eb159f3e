"""Plots of qurl runs: `python tools/plot.py RUN [RUN ...] [--out fig.png]`.

Reward, held-out accuracy, mismatch KL, sampled entropy, clip fractions, the share of truncated
importance weights and flip rate per step of each run folder's metrics.jsonl (per-step series
smoothed), one line per run. `--arms`: runs named ARM-sN are one arm, drawn as the seeds' mean
with their range shaded; `--table`: each arm's numbers at the end as a markdown table (held-out
accuracy at the last step, the mean of the evaluations from `--last` steps before it on and of
each metric over the last `--last` steps; mean ± standard deviation over the seeds, the seeds in
brackets).
"""

import argparse
import json
import re
import statistics
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


def read_run(run: str) -> tuple[list[dict], float | None]:
    """A run folder's metrics rows and its start accuracy (summary.json), or exit with why."""
    metrics, summary = Path(run) / "metrics.jsonl", Path(run) / "summary.json"
    if not metrics.is_file():
        sys.exit(f"plot: {metrics} not found (is {run} a run folder?)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    start = json.loads(summary.read_text()).get("start_eval_acc") if summary.is_file() else None
    return rows, start


def series(rows: list[dict], start: float | None, key: str) -> list[tuple]:
    """(step, value) of one metric; eval/acc from step 0."""
    points = [(0, start)] if key == "eval/acc" and start is not None else []
    return points + [(row["step"], row[key]) for row in rows if row.get(key) is not None]


def arms_of(runs: list[str]) -> dict[str, list[str]]:
    """Run folders grouped by their name without its -sN seed suffix, in the order given."""
    arms = {}
    for run in runs:
        arms.setdefault(re.sub(r"-s\d+$", "", Path(run).name), []).append(run)
    return arms


def plot_runs(run_dirs: list[str], out: str = "runs.png", keys: list[str] | None = None,
              arms: bool = False):
    """One panel per metric (PANELS by default), one line per run or per arm (the seeds' mean,
    their range shaded); returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = keys or list(PANELS)
    columns = min(4, len(keys))
    rows_of_panels = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(5 * columns, 3.6 * rows_of_panels),
                             squeeze=False)
    groups = arms_of(run_dirs) if arms else {Path(run).name: [run] for run in run_dirs}
    for number, (label, runs) in enumerate(groups.items()):
        color = f"C{number % 10}"  # one colour a run in every panel, even where others have no line
        runs_read = [read_run(run) for run in runs]
        for ax, key in zip(axes.flat, keys):
            per_run = [dict(series(rows, start, key)) for rows, start in runs_read]
            steps = sorted(set.intersection(*(set(values) for values in per_run)))
            at_step = [[values[x] for values in per_run] for x in steps]  # the seeds' values
            curves = [list(map(f, at_step)) for f in (statistics.mean, min, max)]
            if key == "mismatch/kl":  # a log axis: an exact zero (--quant none) sits at 1e-12
                curves = [[max(v, 1e-12) for v in curve] for curve in curves]
            if key != "eval/acc" and len(steps) > 20:
                window = max(1, len(steps) // 25)
                curves = [[v for _, v in _smooth(list(zip(steps, c)), window)] for c in curves]
            mean, low, high = curves
            if steps:
                marker = "o" if key == "eval/acc" else None
                ax.plot(steps, mean, label=label, color=color, marker=marker, markersize=3)
                if len(runs) > 1:
                    ax.fill_between(steps, low, high, color=color, alpha=0.15)
            scale = "log" if key == "mismatch/kl" else "linear"
            ax.set(title=PANELS.get(key, key), xlabel="step", yscale=scale)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax in axes.flat:
        if ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not 1e-12 + x
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")
    return fig


def _spread(values: list[float], digits: str) -> str:
    """mean ± sample standard deviation (the values), or the one value; — where the arm does not log
    the metric."""
    if any(v != v for v in values):  # NaN: a run without the metric (acr's tbpo/kept)
        return "—"
    listed = ", ".join(format(v, digits) for v in values)
    if len(values) == 1:
        return f"{format(values[0], digits)} (one seed)"
    mean, std = statistics.mean(values), statistics.stdev(values)
    return f"{format(mean, digits)} ± {format(std, digits)} ({listed})"


def arm_table(run_dirs: list[str], keys: list[str], last: int = 20) -> str:
    """A markdown row per arm: eval/acc (%) at the last step, the mean of the evaluations from
    step last_step - last on, each key's mean over the last `last` steps; across seeds, mean ±
    std."""
    head = ["arm", "seeds", "acc at end, %", f"acc, evals at steps >= end - {last}, %", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, runs in arms_of(run_dirs).items():
        end, late, means = [], [], {key: [] for key in keys}
        for run in runs:
            rows, _ = read_run(run)
            final = rows[-1]["step"]
            if rows[-1].get("eval/acc") is None:
                sys.exit(f"plot: {run} ends at step {final} without an evaluation (cut before "
                         "its last one?): --table needs a finished run")
            tail = [row for row in rows if row["step"] > final - last]
            evals = [row["eval/acc"] for row in rows
                     if row["step"] >= final - last and row.get("eval/acc") is not None]
            end.append(100 * rows[-1]["eval/acc"])
            late.append(100 * statistics.mean(evals))
            for key in keys:
                values = [row[key] for row in tail if row.get(key) is not None]
                means[key].append(statistics.mean(values) if values else float("nan"))
        cells = [arm, str(len(runs)), _spread(end, ".1f"), _spread(late, ".1f")]
        cells += [_spread(means[key], ".3g") for key in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tools/plot.py", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (runs/NAME)")
    parser.add_argument("--out", default="runs.png", help="the figure to write")
    parser.add_argument("--metrics", help="comma-separated metric keys (default: the 8 panels)")
    parser.add_argument("--arms", action="store_true", help="runs ARM-sN as one arm: mean, range")
    parser.add_argument("--table", action="store_true", help="print the arms' table, no figure")
    parser.add_argument("--last", type=int, default=20, help="--table: steps at the end")
    opts = parser.parse_args(argv)
    keys = opts.metrics.split(",") if opts.metrics else None
    if opts.table:
        print(arm_table(opts.runs, keys or list(PANELS), opts.last))
        return
    plot_runs(opts.runs, opts.out, keys, opts.arms)


if __name__ == "__main__":
    main()
