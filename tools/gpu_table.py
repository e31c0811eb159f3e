"""Tables of `tools/bench.py rollout` rows.

    python tools/gpu_table.py rows.jsonl                  the rollout table, a row per sampler
    python tools/gpu_table.py rows.jsonl --sweep [--plot FILE]
        compiled bf16 against FP8 at each row count (a batch sweep): tokens/s, their ratio, the
        decode step's milliseconds beside the H200's limit (`step_limit_ms`), the prefill's
        seconds; --plot draws tokens/s against rows per shape, the limit dashed
"""

import argparse
import json


def fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


def ratio(a, b):
    return None if a is None or not b else a / b


def rollout_table(rows: list[dict]) -> str:
    lines = [
        "| shape | sampler | generate tok/s | eager tok/s | compiled tok/s | compiled / eager "
        "| compiled / compiled bf16 | compile s | sync s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    bf16 = {r["model"]: r.get("compiled_tok_s") for r in rows if r["quant"] == "bf16"}
    for r in rows:
        compiled = r.get("compiled_tok_s") if r.get("compiled") else None
        lines.append(
            f"| {r['model']} | {r['quant']} | {fmt(r.get('generate_tok_s'), '.0f')} "
            f"| {fmt(r.get('tok_s'), '.0f')} "
            f"| {fmt(compiled, '.0f')} | {fmt(ratio(compiled, r.get('tok_s')), '.2f')} "
            f"| {fmt(ratio(compiled, bf16.get(r['model'])), '.2f')} "
            f"| {fmt(r.get('compile_s'), '.1f')} | {fmt(r.get('sync_s'), '.3g')} |"
        )
    return "\n".join(lines)


def sweep(rows: list[dict]) -> dict:
    """{(shape, rows): {quant: row}} of the compiled rows."""
    table = {}
    for r in rows:
        if r.get("compiled"):
            table.setdefault((r["model"], r["batch"]), {})[r["quant"]] = r
    return dict(sorted(table.items()))


def sweep_table(rows: list[dict]) -> str:
    lines = [
        "| shape | rows | bf16 tok/s | FP8 tok/s | FP8 / bf16 | bf16 step ms (limit) "
        "| FP8 step ms (limit) | prefill s, bf16 / FP8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (shape, batch), by_quant in sweep(rows).items():
        bf16, fp8 = by_quant.get("bf16", {}), by_quant.get("fp8", {})
        steps = [
            f"{fmt(r.get('step_ms'), '.2f')} ({fmt(r.get('limit_step_ms_h200'), '.2f')})"
            for r in (bf16, fp8)
        ]
        lines.append(
            f"| {shape} | {batch} | {fmt(bf16.get('compiled_tok_s'), '.0f')} "
            f"| {fmt(fp8.get('compiled_tok_s'), '.0f')} "
            f"| {fmt(ratio(fp8.get('compiled_tok_s'), bf16.get('compiled_tok_s')), '.2f')} "
            f"| {steps[0]} | {steps[1]} "
            f"| {fmt(bf16.get('prefill_s'), '.2f')} / {fmt(fp8.get('prefill_s'), '.2f')} |"
        )
    return "\n".join(lines)


def plot_sweep(rows: list[dict], out: str) -> None:
    """Tokens/s against rows, a panel per shape: bf16 and FP8 measured (solid) and at the H200's
    limit per decode step (dashed: rows / limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = sweep(rows)
    shapes = sorted({shape for shape, _ in table})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        points = [(b, q) for (s, b), q in table.items() if s == shape]
        for quant, color in (("bf16", "tab:blue"), ("fp8", "tab:red")):
            measured = [(b, q[quant]) for b, q in points if quant in q]
            xs = [b for b, _ in measured]
            ax.plot(xs, [r["compiled_tok_s"] for _, r in measured], "o-", color=color,
                    label=f"{quant}, measured")
            limits = [(b, r["limit_step_ms_h200"]) for b, r in measured
                      if r.get("limit_step_ms_h200")]
            if limits:
                ax.plot([b for b, _ in limits], [1e3 * b / ms for b, ms in limits], "--",
                        color=color, label=f"{quant}, limit per step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("rows (batch)")
        ax.set_ylabel("rollout tokens/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rows")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--plot", metavar="FILE")
    opts = parser.parse_args(argv)
    rows = [json.loads(line) for line in open(opts.rows) if line.strip()]
    print(f"device: {rows[0]['device'] if rows else '?'}\n")
    print(sweep_table(rows) if opts.sweep else rollout_table(rows))
    if opts.plot:
        plot_sweep(rows, opts.plot)


if __name__ == "__main__":
    main()
