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
    fp8_aligned      the FP8 sampler against QaRL's rollout-aligned forward

Columns, per sampled token (response tokens only), w = pi_prox / pi_behav:
    kl            k3 estimate of KL(pi_behav || pi_prox), as mismatch/kl (kl_se: its standard error)
    kl_exact      KL(pi_behav || pi_prox) over the whole vocabulary at each sampled position,
                  pi_behav's distribution recorded at each decode step (what k3 estimates)
    logp_absdiff  mean |log w|;  ratio_max  max w
    w_truncated   share of tokens whose TIS weight w is cut at C = 2
    ess           (sum w)^2 / (n sum w^2): the share of the batch the untruncated weights leave
--layers adds each source's relative error of every decoder layer's hidden state against the
actor's on the same tokens, both teacher-forced: where its drift enters (the decode's own drift,
the floor's and fp8_aligned's, does not show there).
"""

import argparse
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
           "int8", "nf4", "stale", "fp8_aligned"]
IS_CAP = 2.0  # C, the TIS cap whose truncation w_truncated counts


def build_sampler(actor: nn.Module, source: str) -> nn.Module:
    """The sampler with only `source` switched on (the actor is left as it is)."""
    if source in ("floor", "stale"):
        return actor
    if source in ("fp16", "bf16", "fp8", "int8", "nf4", "fp8_aligned"):
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


def sample_recording(sampler, tokenizer, prompts, n, max_new_tokens, generator):
    """qurl.sample, keeping the sampler's whole (B, R, V) log-distribution at every sampled
    position: each decode step's logits pass through qurl._pick, recorded here. sample drops
    finished rows from its batch (in order), so a step's batch is the rows whose first EOS came
    after the last drop: the rows with end > d for the d that matches the batch's size."""
    steps, real_pick = [], qurl._pick

    def pick(logits, temperature, noise):
        steps.append(torch.log_softmax(logits.double() / temperature, dim=-1))
        return real_pick(logits, temperature, noise)
    qurl._pick = pick
    try:
        rollout = qurl.sample(sampler, tokenizer, prompts, n, max_new_tokens, 1.0, generator)
    finally:
        qurl._pick = real_pick
    mask = rollout.response_mask
    R = mask.shape[1]
    end = torch.where(rollout.truncated, R, mask.sum(1).long() - 1)
    full = torch.zeros(*mask.shape, steps[0].shape[-1], dtype=torch.float64)
    for t, logp in enumerate(steps):
        d = next(d for d in range(-1, R + 1) if int((end > d).sum()) == len(logp))
        full[(end > d).nonzero().squeeze(1), t] = logp
    drawn = full.gather(-1, rollout.input_ids[:, -R:, None]).squeeze(-1) * mask
    if not torch.allclose(drawn.float(), rollout.logp_behav, atol=1e-4):  # fp32 softmax sums
        raise RuntimeError("mismatch: the recorded decode steps do not match sample's rows")
    return rollout, full


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


def measure(sampler, prox_model, rollout, behav_full, aligned: bool, layers: bool) -> dict:
    """The row's numbers: pi_behav from the sampler's decode, pi_prox from `prox_model` teacher-
    forced (through the sampler's quantizer for fp8_aligned)."""
    mask = rollout.response_mask
    fmt = "fp8" if aligned else None
    with torch.no_grad(), qurl.rollout_aligned(prox_model, fmt):
        prox_full, prox_hidden = teacher_forced(prox_model, rollout, layers)
        logp_prox = qurl.token_logprobs(prox_model, rollout.input_ids, rollout.attention_mask,
                                        mask)
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
        keep = mask.bool()
        row["layers"] = [float((b[keep] - p[keep]).norm() / p[keep].norm())
                         for b, p in zip(behav_hidden, prox_hidden)]
    return row


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
    print(f"{'source':<16}{'kl':>9}{'kl_exact':>10}{'|dlogp|':>9}{'ratio_max':>10}"
          f"{'w>C':>8}{'ess':>8}{'s':>6}")
    rows = []
    for source in opts.sources:
        start = time.time()
        sampler = build_sampler(actor, source)
        generator = torch.Generator().manual_seed(opts.seed)
        with qurl.rollout_autocast(source, torch.device("cpu"), torch.float32):
            rollout, behav_full = sample_recording(sampler, tokenizer, prompts, opts.group_size,
                                                   opts.max_new_tokens, generator)
        prox_model = actor
        if source == "stale":
            prox_model = take_stale_step(actor, tokenizer, problems, opts)
        aligned = source == "fp8_aligned"
        row = {"model": Path(opts.model).name, "source": source,
               **measure(sampler, prox_model, rollout, behav_full, aligned, opts.layers)}
        row["seconds"] = round(time.time() - start, 1)
        print(f"{source:<16}{row['kl']:>9.1e}{row['kl_exact']:>10.1e}{row['logp_absdiff']:>9.1e}"
              f"{row['ratio_max']:>10.3g}{row['w_truncated']:>8.2%}{row['ess']:>8.4f}"
              f"{row['seconds']:>6.0f}", flush=True)
        if opts.layers:  # where the drift enters: each decoder layer's relative error
            print(f"{'':<16}layers " + " ".join(f"{e:.0e}" for e in row["layers"]), flush=True)
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
