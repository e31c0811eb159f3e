"""What the straight-through gradient costs: --align-forward's gradient against autograd through
the value's own computation.

    python tools/ste_grad.py [--model M] [--problems FILE] [--quant fp8,nf4] [--prompts N]
        [--group-size G] [--max-new-tokens T] [--seeds 1,2,3] [--groups 4] [--json FILE]

With --align-forward, logp's value is the sampler's decode (`sampler_logprobs`) while its gradient
is autograd's through a full parallel forward on fake-quantized weights and activations
(`rollout_aligned`): two computations of the same numbers in exact arithmetic, which a W8A8
quantizer parts (activation codes cross where the sums round apart). Here both are differentiated
on the same tokens and the same loss, L = -sum_i A_i sum_t logp_it / tokens (the policy gradient
at ratio 1, what every objective reduces to at the first update):

    ste     qurl's gradient: the full forward through `rollout_aligned` (QaRL's straight-through)
    decode  autograd through the fed KV-cache decode (`decode`'s own loop, fed the sampled tokens)
            through the same `rollout_aligned` layers: the value's computation, differentiated

and compared per parameter group (the embeddings, the decoder layers in --groups contiguous
groups, the final norm and head; a tied head counts with the embeddings): the cosine of the two
gradients and the norm ratio |ste| / |decode|. `none` (no quantizer) is the floor: the same two
computations in fp32. The rollout is the quantized sampler's; advantages are the GRPO advantages
of rewards drawn at random (half the samples rewarded). Seeds vary the prompts' samples and the
rewards.
"""

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import qurl  # noqa: E402


def parameter_groups(model, n_groups: int) -> dict[str, list[str]]:
    """Parameter names by group: embed (with a tied head), layers a-b, norm+head."""
    n_layers = len(model.model.layers)
    bounds = [round(i * n_layers / n_groups) for i in range(n_groups + 1)]
    labels = [f"layers {a + 1}-{b}" for a, b in zip(bounds, bounds[1:]) if b > a]
    starts = [a for a, b in zip(bounds, bounds[1:]) if b > a]
    groups: dict[str, list[str]] = {"embed": [], **{label: [] for label in labels}, "norm+head": []}
    for name, _ in model.named_parameters():
        if ".layers." in f".{name}":
            i = int(name.split(".layers.")[1].split(".")[0])
            groups[labels[max(j for j, a in enumerate(starts) if a <= i)]].append(name)
        else:
            groups["embed" if "embed" in name else "norm+head"].append(name)
    return {k: v for k, v in groups.items() if v}


def gradients(model, tokenizer, fmt, rollout, coef, n, decode_path: bool):
    """({name: grad} of sum(coef * logp), logp): the full forward's logp or the fed decode's. A
    weight's fake quantization is computed once per call (its value and gradient as at every use):
    the decode would otherwise keep a copy of every weight per token for backward."""
    model.zero_grad()
    plain, cache = qurl.fake_quant, {}

    def once(x, fmt):  # a weight's fake-quantized copy made once, not at every decode step
        if not isinstance(x, torch.nn.Parameter):
            return plain(x, fmt)
        if id(x) not in cache:
            cache[id(x)] = plain(x, fmt)
        return cache[id(x)]
    qurl.fake_quant = once
    try:
        return _gradients(model, tokenizer, fmt, rollout, coef, n, decode_path)
    finally:
        qurl.fake_quant = plain


def _gradients(model, tokenizer, fmt, rollout, coef, n, decode_path: bool):
    P = rollout.prompt_len
    with qurl.rollout_aligned(model, fmt), torch.enable_grad():
        if decode_path:  # decode's own loop, its no_grad decorator peeled off
            fed = qurl.decode.__wrapped__(model, tokenizer, rollout.input_ids[::n, :P],
                                          rollout.attention_mask[::n, :P], n,
                                          rollout.response_mask.shape[1], 1.0,
                                          forced=rollout.input_ids[:, P:])
            logp = fed.logp_behav
        else:
            logp = qurl.token_logprobs(model, rollout.input_ids, rollout.attention_mask,
                                       rollout.response_mask)
        (coef * logp).sum().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}, logp.detach()


def compare(ste: dict, dec: dict, groups: dict) -> dict:
    """Cosine and norm ratio |ste| / |decode| over each group and the whole model."""
    rows = {}
    for group, names in {**groups, "all": [n for v in groups.values() for n in v]}.items():
        a = torch.cat([ste[n].flatten().double() for n in names if n in ste])
        b = torch.cat([dec[n].flatten().double() for n in names if n in dec])
        cos = float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))
        rows[group] = {"cosine": cos, "norm_ratio": float(a.norm() / b.norm().clamp(min=1e-300))}
    return rows


def main(argv=None) -> None:
    defaults = qurl.Args()
    parser = argparse.ArgumentParser(prog="tools/ste_grad.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--problems", default=defaults.test_data)
    parser.add_argument("--quant", default="none,fp8,nf4", help="comma-separated: none, fp8, ...")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--invariant-scale", type=float, default=1.5)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--groups", type=int, default=4, help="groups of decoder layers")
    parser.add_argument("--json", help="append the rows here, one JSON line each")
    opts = parser.parse_args(argv)

    torch.manual_seed(0)
    actor, tokenizer = qurl.load_model(opts.model)
    qurl.prepare_actor(actor)
    if opts.invariant_scale != 1.0:
        qurl.invariant_rescale(actor, opts.invariant_scale)
    actor.train()
    problems = qurl.load_problems(opts.problems, "test")
    groups = parameter_groups(actor, opts.groups)
    n, name = opts.group_size, Path(opts.model).name
    for quant in opts.quant.split(","):
        fmt = None if quant == "none" else quant
        sampler = qurl.make_sampler(actor, quant, torch.float32)
        for seed in [int(s) for s in opts.seeds.split(",")]:
            rng = random.Random(seed)
            chosen = rng.sample(problems, opts.prompts)
            prompts = [qurl.format_prompt(p["question"], tokenizer) for p in chosen]
            rollout = qurl.sample(sampler, tokenizer, prompts, n, opts.max_new_tokens, 1.0,
                                  torch.Generator().manual_seed(seed))
            rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(len(prompts) * n)])
            adv = qurl.group_advantages(rewards, n)[0]
            mask = rollout.response_mask
            coef = -adv[:, None] * mask / mask.sum()
            ste, logp_ste = gradients(actor, tokenizer, fmt, rollout, coef, n, False)
            dec, logp_dec = gradients(actor, tokenizer, fmt, rollout, coef, n, True)
            row = {"model": name, "quant": quant, "seed": seed, "tokens": int(mask.sum()),
                   "value_gap_ste": float(((logp_ste - rollout.logp_behav) * mask).abs().max()),
                   "value_gap_decode": float(((logp_dec - rollout.logp_behav) * mask).abs().max()),
                   "groups": compare(ste, dec, groups)}
            print(json.dumps(row), flush=True)
            if opts.json:
                with open(opts.json, "a") as file:
                    file.write(json.dumps(row) + "\n")
        del sampler


if __name__ == "__main__":
    main()
