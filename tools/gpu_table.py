"""The rollout table of `tools/bench.py rollout` rows: `python tools/gpu_table.py rows.jsonl`."""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"device: {rows[0]['device'] if rows else '?'}\n")
print(
    "| shape | sampler | generate tok/s | eager tok/s | compiled tok/s | compiled / eager "
    "| compiled / compiled bf16 | compile s | sync s |\n|---|---|---|---|---|---|---|---|---|"
)
bf16 = {r["model"]: r.get("compiled_tok_s") for r in rows if r["quant"] == "bf16"}
for r in rows:
    fmt = lambda v, spec=".3g": "-" if v is None else format(v, spec)  # noqa: E731
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    compiled = r.get("compiled_tok_s") if r.get("compiled") else None
    print(
        f"| {r['model']} | {r['quant']} | {fmt(r.get('generate_tok_s'), '.0f')} "
        f"| {fmt(r.get('tok_s'), '.0f')} "
        f"| {fmt(compiled, '.0f')} | {fmt(ratio(compiled, r.get('tok_s')), '.2f')} "
        f"| {fmt(ratio(compiled, bf16.get(r['model'])), '.2f')} | {fmt(r.get('compile_s'), '.1f')} "
        f"| {fmt(r.get('sync_s'), '.3g')} |"
    )
