"""Where the mismatch comes from: one sampler per source, each alone on the exact fp32 actor.

    python tools/mismatch.py [--model M] [--problems FILE] [--prompts N] [--group-size G]
        [--max-new-tokens T] [--seed S] [--json FILE] [--plot FILE] [--layers] [--sources A,B]
    python tools/mismatch.py --plot FILE --from A.jsonl [B.jsonl ...]   (draw saved rows)

Every source samples the same prompts with the same seed, on the CPU (the FP8 kernel emulated, as
qurl.py does off a GPU); the fp32 actor, teacher-forced on the sampled tokens, is pi_prox. The
sources, built from qurl.py's own make_sampler, fake_quant, rollout_aligned and train_step (no
second quantizer):

    floor            the actor itself: the KV-cache decode against the teacher-forced forward
    fp16, bf16       the whole sampler in that dtype
    lm_head_bf16     the actor with only its lm_head weight rounded to bf16
    fp8_weights      W8A16: the decoder linears' weights on FP8 codes, activations exact
    fp8_activations  A8: activations quantized per token as FP8, weights exact
    fp8              W8A8, the sampler qurl trains with; int8 and nf4 likewise
    stale            the actor one RL step behind (one train_step, random rewards, between
                     sampling and pi_prox): what an asynchronous trainer accepts by design
    fp8_aligned      the FP8 sampler against qurl's aligned value (--align-forward): its own
                     decode fed the tokens it drew (`decode(..., forced=...)`),
                     what the value is after an optimizer step; int8, nf4, bf16 likewise
    fp8_aligned_forward  against QaRL's aligned value: a full forward through the sampler's own
                     quantized layers (qurl's before #38); int8, nf4, bf16 likewise

Columns, per sampled token (response tokens only), w = pi_prox / pi_behav:
    kl            k3 estimate of KL(pi_behav || pi_prox), as mismatch/kl (kl_se: its standard error)
    kl_exact      KL(pi_behav || pi_prox) over the whole vocabulary at each sampled position,
                  pi_behav's distribution recorded at each decode step (what k3 estimates)
    logp_absdiff  mean |log w|;  ratio_max  max w
    w_truncated   share of tokens whose TIS weight w is cut at C = 2
    ess           (sum w)^2 / (n sum w^2): the share of the batch the untruncated weights leave
--layers adds each source's relative error of every decoder layer's hidden state against the
actor's on the same tokens, both teacher-forced: where its drift enters; and, for the sampler's
decode against its own full forward on the same tokens, the share of each decoder layer's input
that differs: its activation codes for W8A8 (fp8, int8), its values bit for bit otherwise. There
the avalanche shows: where the first code crosses and how the crossings grow.
"""

import argparse
import contextlib
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import qurl  # noqa: E402
from bench import random_rewards  # noqa: E402

SOURCES = ["floor", "fp16", "bf16", "lm_head_bf16", "fp8_weights", "fp8_activations", "fp8",
           "int8", "nf4", "stale", "fp8_aligned", "int8_aligned", "nf4_aligned", "bf16_aligned",
           "fp8_aligned_forward", "int8_aligned_forward", "nf4_aligned_forward",
           "bf16_aligned_forward"]
IS_CAP = 2.0  # C, the TIS cap whose truncation w_truncated counts


def build_sampler(actor: nn.Module, source: str) -> nn.Module:
    """The sampler with only `source` switched on (the actor is left as it is)."""
    if source in ("floor", "stale"):
        return actor
    if source in ("fp16", "bf16", "fp8", "int8", "nf4") or "_aligned" in source:
        return qurl.make_sampler(actor, source.split("_")[0], torch.float32)
    sampler = copy.deepcopy(actor).eval().requires_grad_(False)
    if source == "lm_head_bf16":  # its own weight: a tied embedding stays exact
        head = sampler.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().to(torch.bfloat16).float(),
                                   requires_grad=False)
    for _, linear in qurl.decoder_linears(sampler):
        if source == "fp8_weights":  # the FP8 codes' values; x as it is
            linear.weight.data = qurl.fake_quant(linear.weight, "fp8").detach().clone()
        if source == "fp8_activations":  # x on FP8 codes, per token; W as it is
            linear.forward = lambda x, linear=linear: F.linear(
                qurl.fake_quant(x, "fp8"), linear.weight, linear.bias)
    return sampler


def take_stale_step(actor: nn.Module, tokenizer, problems: list[dict], opts) -> nn.Module:
    """A copy of the actor after one train_step at the lab's sizes, with random rewards (a
    pretrained model may get every answer wrong, and an all-equal group would not update)."""
    trained = copy.deepcopy(actor)
    optimizer = torch.optim.AdamW(trained.parameters(), opts.stale_lr, (0.9, 0.99),
                                  weight_decay=0.0)
    generator = torch.Generator().manual_seed(opts.seed + 1)
    learner = qurl.Learner(trained, optimizer, trained, tokenizer, generator, torch.float32)
    args = qurl.Args(model=opts.model, quant="none", prompts_per_step=opts.prompts,
                     group_size=opts.group_size, max_new_tokens=opts.max_new_tokens,
                     lr=opts.stale_lr, micro_batch=16)
    with random_rewards(opts.seed):
        qurl.train_step(learner, args, problems, step=1)
    return trained.eval()


def sample_recording(sampler, tokenizer, prompts, n, max_new_tokens, generator, forced=None):
    """qurl's decode (`forced`: fed those tokens), keeping the sampler's whole (B,
    R, V) log-distribution at every sampled position: each decode step's logits pass through
    qurl._pick, recorded here. Returns the rollout, those distributions, and the rows of each
    decode step (the decode drops finished rows from its batch)."""
    steps, real_pick = [], qurl._pick

    def pick(logits, temperature, noise, fed):
        steps.append(torch.log_softmax(logits.double() / temperature, dim=-1))
        return real_pick(logits, temperature, noise, fed)
    qurl._pick = pick
    try:
        input_ids, prompt_mask = qurl.encode(tokenizer, prompts, "cpu")
        rollout = qurl.decode(sampler, tokenizer, input_ids, prompt_mask, n, max_new_tokens, 1.0,
                              generator, forced)
    finally:
        qurl._pick = real_pick
    mask = rollout.response_mask
    R = mask.shape[1]
    rows = step_rows(rollout, [len(logp) for logp in steps])
    full = torch.zeros(*mask.shape, steps[0].shape[-1], dtype=torch.float64)
    for t, logp in enumerate(steps):
        full[rows[t], t] = logp
    drawn = full.gather(-1, rollout.input_ids[:, -R:, None]).squeeze(-1) * mask
    if not torch.allclose(drawn.float(), rollout.logp_behav, atol=1e-4):  # fp32 softmax sums
        raise RuntimeError("mismatch: the recorded decode steps do not match sample's rows")
    return rollout, full, rows


def step_rows(rollout, sizes: list[int]) -> list[torch.Tensor]:
    """The rollout's rows in each decode step of these batch sizes: qurl's decode drops finished
    rows in order, so a step's batch is the rows whose first EOS came after the last drop (the rows
    with end > d, for the d that gives its size)."""
    R = rollout.response_mask.shape[1]
    end = torch.where(rollout.truncated, R, rollout.response_mask.sum(1).long() - 1)
    return [(end > next(d for d in range(-1, R + 1) if int((end > d).sum()) == size))
            .nonzero().squeeze(1) for size in sizes]


@contextlib.contextmanager
def layer_inputs(model):
    """In this block each decoder layer's first linear (q_proj) records its input: a list per
    layer, one (rows, tokens, hidden) tensor per call."""
    seen = [[] for _ in model.model.layers]
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(
        lambda module, args, i=i: seen[i].append(args[0].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def crossings(sampler, rollout, decoded, rows) -> list[float]:
    """Per decoder layer, the share of its input that differs between the sampler's decode
    (`decoded`: `layer_inputs` of it, the prefill first) and its own full forward on the same
    tokens: activation codes for W8A8, values bit for bit otherwise."""
    with torch.no_grad(), layer_inputs(sampler) as full:
        teacher_forced(sampler, rollout, False)
    linear = sampler.model.layers[0].self_attn.q_proj
    fmt = getattr(linear, "fmt", None) if getattr(linear, "fmt", None) != "nf4" else None
    mask, P = rollout.response_mask.bool(), rollout.prompt_len
    shares = []
    for steps, whole in zip(decoded, full):
        differ = total = 0
        for t, x in enumerate(steps[1:], 1):  # step t feeds response token t - 1
            keep = mask[rows[t], t - 1]
            a, b = x[keep, 0], whole[0][rows[t][keep], P + t - 1]
            if fmt:  # the codes the sampler's GEMM multiplies
                a, b = (qurl.quantize(v / qurl.int8_shift(v) if fmt == "int8" else v, fmt)[0]
                        .view(torch.uint8) for v in (a, b))
            differ, total = differ + int((a != b).sum()), total + a.numel()
        shares.append(differ / max(total, 1))
    return shares


def teacher_forced(model, rollout, hidden: bool):
    """(B, R, V) log_softmax of the logits that predict each response token (T = 1), as
    token_logprobs computes them, and with hidden=True the (B, R, h) hidden states per layer."""
    R = rollout.response_mask.shape[1]
    positions = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                position_ids=positions, use_cache=False, output_hidden_states=hidden)
    logp = torch.log_softmax(out.logits[:, -R - 1:-1].double(), dim=-1)
    if not hidden:
        return logp, None
    return logp, [h[:, -R - 1:-1].float() for h in out.hidden_states[1:]]


def measure(sampler, prox_model, rollout, behav_full, prox_full, logp_prox, layers) -> dict:
    """The row's numbers: pi_behav from the sampler's decode, pi_prox (`prox_full`, `logp_prox`);
    with `layers`, each decoder layer's hidden-state error of the sampler against `prox_model`
    (both teacher-forced)."""
    mask = rollout.response_mask
    metrics = qurl.mismatch_metrics(logp_prox, rollout.logp_behav, mask)
    log_w = (logp_prox - rollout.logp_behav)[mask.bool()].double()
    w, k3 = log_w.exp(), qurl.k3(log_w)
    exact = (behav_full.exp() * (behav_full - prox_full)).sum(-1)[mask.bool()]
    row = {"kl": metrics["mismatch/kl"], "kl_se": float(k3.std() / math.sqrt(len(k3))),
           "kl_exact": float(exact.double().mean()),
           "logp_absdiff": metrics["mismatch/logp_absdiff"],
           "ratio_max": metrics["mismatch/ratio_max"],
           "w_truncated": float((w > IS_CAP).double().mean()),
           "ess": float(w.sum() ** 2 / (len(w) * (w**2).sum())), "tokens": int(mask.sum())}
    if layers:  # ||h_sampler - h_actor|| / ||h_actor|| over the response positions
        with torch.no_grad():
            behav_hidden = teacher_forced(sampler, rollout, True)[1]
            prox_hidden = teacher_forced(prox_model, rollout, True)[1]
        keep = mask.bool()
        row["layers"] = [float((b[keep] - p[keep]).norm() / p[keep].norm())
                         for b, p in zip(behav_hidden, prox_hidden)]
    return row


def prox_of(source, actor, sampler, rollout, tokenizer, prompts, problems, opts):
    """pi_prox for a source: (its model for --layers, (B, R, V) log-distributions, (B, R)
    log-probs of the sampled tokens). The actor teacher-forced; the stale actor; the sampler's
    full forward (*_aligned_forward); its decode fed its tokens (*_aligned)."""
    prox_model = actor
    if source == "stale":
        prox_model = take_stale_step(actor, tokenizer, problems, opts)
    if source.endswith("_aligned"):
        forced = rollout.input_ids[:, rollout.prompt_len:]
        with qurl.rollout_autocast(source.split("_")[0], torch.device("cpu"), torch.float32):
            again, prox_full, _ = sample_recording(sampler, tokenizer, prompts, opts.group_size,
                                                   opts.max_new_tokens, None, forced)
        return sampler, prox_full, again.logp_behav
    if source.endswith("_aligned_forward"):
        prox_model = sampler
    with torch.no_grad():
        prox_full = teacher_forced(prox_model, rollout, False)[0]
        logp_prox = qurl.token_logprobs(prox_model, rollout.input_ids, rollout.attention_mask,
                                        rollout.response_mask)
    return prox_model, prox_full, logp_prox


def run_lab(opts) -> list[dict]:
    """Every source of opts.sources, in order; a row each (printed as it comes)."""
    torch.manual_seed(opts.seed)
    actor, tokenizer = qurl.load_model(opts.model, "cpu", torch.float32)
    qurl.prepare_actor(actor)
    actor.eval()
    problems = qurl.load_problems(opts.problems, "test")[:opts.prompts]
    prompts = [qurl.format_prompt(p["question"], tokenizer) for p in problems]
    print(f"{Path(opts.model).name}: {len(prompts)} prompts x {opts.group_size} samples x "
          f"{opts.max_new_tokens} new tokens, seed {opts.seed}, pi_prox the fp32 actor")
    print(f"{'source':<21}{'kl':>9}{'kl_exact':>10}{'|dlogp|':>9}{'ratio_max':>10}"
          f"{'w>C':>8}{'ess':>8}{'s':>6}")
    rows = []
    for source in opts.sources:
        start = time.time()
        sampler = build_sampler(actor, source)
        generator = torch.Generator().manual_seed(opts.seed)
        recording = layer_inputs(sampler) if opts.layers else contextlib.nullcontext()
        with qurl.rollout_autocast(source.split("_")[0], torch.device("cpu"), torch.float32):
            with recording as decoded:
                rollout, behav_full, step_of = sample_recording(
                    sampler, tokenizer, prompts, opts.group_size, opts.max_new_tokens, generator)
            prox_model, prox_full, logp_prox = prox_of(source, actor, sampler, rollout,
                                                       tokenizer, prompts, problems, opts)
            row = {"model": Path(opts.model).name, "source": source,
                   **measure(sampler, prox_model, rollout, behav_full, prox_full, logp_prox,
                             opts.layers)}
            if opts.layers:  # the decode against the sampler's own full forward
                row["crossings"] = crossings(sampler, rollout, decoded, step_of)
        row["seconds"] = round(time.time() - start, 1)
        print(f"{source:<21}{row['kl']:>9.1e}{row['kl_exact']:>10.1e}{row['logp_absdiff']:>9.1e}"
              f"{row['ratio_max']:>10.3g}{row['w_truncated']:>8.2%}{row['ess']:>8.4f}"
              f"{row['seconds']:>6.0f}", flush=True)
        if opts.layers:  # where the drift enters: each decoder layer's relative error
            print(f"{'':<21}layers    " + " ".join(f"{e:.0e}" for e in row["layers"]))
            print(f"{'':<21}crossings " + " ".join(f"{e:.0e}" for e in row["crossings"]),
                  flush=True)
        rows.append(row)
    return rows


def plot(rows: list[dict], out: str) -> None:
    """KL per source on a log axis, a group of bars per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in rows))
    sources = list(dict.fromkeys(row["source"] for row in rows))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(sources) + 1.2))
    height = 0.8 / len(models)
    for i, model in enumerate(models):
        kl = {row["source"]: max(row["kl_exact"], 1e-12) for row in rows if row["model"] == model}
        ys = [s + i * height for s in range(len(sources))]
        ax.barh(ys, [kl.get(source, math.nan) for source in sources], height, label=model)
    ax.set_yticks([s + 0.4 - height / 2 for s in range(len(sources))], sources)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="KL(pi_behav || pi_prox) per token, whole vocabulary")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main(argv=None) -> None:
    defaults = qurl.Args()
    parser = argparse.ArgumentParser(prog="tools/mismatch.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=defaults.model, help="model folder or hub name")
    parser.add_argument("--problems", default=defaults.test_data, help="a .jsonl of problems")
    parser.add_argument("--prompts", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--stale-lr", type=float, default=None,
                        help="the stale step's learning rate (default: qurl's 1e-4 for the tiny "
                             "model, the README recipe's 1e-6 for another)")
    parser.add_argument("--sources", default=",".join(SOURCES), help="a comma-separated subset")
    parser.add_argument("--layers", action="store_true", help="the hidden states' error per layer")
    parser.add_argument("--json", help="write the rows here, one JSON line each")
    parser.add_argument("--plot", help="draw KL per source here (PNG)")
    parser.add_argument("--from", dest="saved", nargs="+", help="saved rows to draw (runs nothing)")
    opts = parser.parse_args(argv)
    opts.sources = opts.sources.split(",")
    unknown = sorted(set(opts.sources) - set(SOURCES))
    if unknown:
        parser.error(f"unknown sources {unknown}: choose from {','.join(SOURCES)}")
    if opts.stale_lr is None:
        opts.stale_lr = defaults.lr if opts.model == defaults.model else 1e-6
    try:
        if opts.saved:
            rows = [json.loads(line) for path in opts.saved for line in Path(path).read_text()
                    .splitlines() if line.strip()]
        else:
            rows = run_lab(opts)
    except qurl.QurlError as e:
        sys.exit(f"mismatch: error: {e}")
    if opts.json:
        Path(opts.json).write_text("".join(json.dumps(row) + "\n" for row in rows))
    if opts.plot:
        plot(rows, opts.plot)


if __name__ == "__main__":
    main()
