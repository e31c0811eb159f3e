"""qurl: quantized-rollout reinforcement learning for LLM reasoning, in one file.

QuRL (arXiv 2602.13953) draws RL rollouts from a quantized copy of the model (the *sampler*:
W8A8 FP8 or INT8, W4A16 NF4, re-synced every RL step) and trains the fp32 model (the *actor*),
as QaRL (arXiv 2604.07853) does. The tokens are off-policy, so the loss knows three policies:

    logp_behav  pi_behav  the sampler that drew the tokens (`sample`, as it draws)
    logp_prox   pi_prox   the actor before the RL step's updates (`update`: the first
                          mini-batch's forward, detached; --align-forward: logp_behav)
    logp        pi_theta  the actor being trained (`token_logprobs`, with grad)

Where each equation lives, in the order an RL step (`train_step`) reaches it:
    sync_weights         the sampler <- the actor; its flip rate (QuRL's weight-update problem)
    QuantLinear          the sampler's FP8 / INT8 / NF4 linear (fp8_matmul: its FP8 kernel)
    invariant_rescale    W x = (W / s)(s x), once before RL (QuRL Eq. 11-12)
    group_advantages     GRPO: A_i = (reward_i - mean) / (std + 1e-6) within a group
    aligned_linear       QaRL's rollout-aligned forward (its value: departure 5)
    token_loss("naive")  PPO on pi_theta / pi_behav, the sampler as the old policy (QuRL Eq. 3)
    token_loss("tis")    ratio = pi_theta / pi_prox, w = min(pi_prox / pi_behav, C) (QuRL Eq. 5)
    token_loss("acr")    upper bound (1 + eps_high) / min(1, C pi_behav / pi_prox) (QuRL Eq. 9)
    tbpo_loss            TBPO's sequence ratio, capped weight and trust band (QaRL)
    k3                   k3 KL(pi_behav || pi_prox): the mismatch metric

Where qurl departs from the papers, and why:
    1. TBPO, not printed in full, is read as a geometric-mean sequence ratio, a sequence weight
       capped at --is-cap, and out-of-band sequences dropped from the loss and its denominator.
    2. One update per rollout by default (the tiny model learns best so): pi_theta = pi_prox at
       the update, so the PPO clip, ACR and TBPO's band never bind (--mini-batches 4 shows them).
    3. The sampler keeps its unquantized parts (lm_head aside) in fp32 under the actor's autocast:
       its mismatch is its quantizer's; an engine holds them in bf16.
    4. Groups whose rewards are all equal leave the update; the learning rate decays (cosine);
       evaluation is the actor's, greedy.
    5. --align-forward: logp's value is the sampler's log-probs (logp_behav; after an optimizer
       step, `sampler_logprobs`: the rollout's decode again), its gradient QaRL's straight-through
       forward's: no full forward computes a W8A8 decode's numbers. pi_prox = pi_behav exactly.
Run: python qurl.py --quant fp8 (README.md: a real Qwen on one GPU). Tests: python -m pytest -q
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import os
import random
import re
import signal
import sys
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its note on an optional package


class QurlError(Exception):
    """Bad input: printed as one line, exit status 2."""


def notice(msg):
    print(f"qurl: {msg}", file=sys.stderr, flush=True)


def arg(default, help, **argparse_extras):
    """A flag: its default, its --help line, argparse extras."""
    return field(default=default, metadata={"help": help, **argparse_extras})


@dataclass
class Args:
    model: str = arg("data/tiny-qwen", "model folder or hub name")
    train_data: str = arg("data/arith_train.jsonl", "problems: a .jsonl file or a hub name")
    test_data: str = arg("data/arith_test.jsonl", "held-out problems")
    quant: str = arg("fp8", "sampler: W8A8 int8/fp8, W4A16 nf4, a bf16/fp16 copy, none (the actor)",
                     choices=["none", "fp16", "bf16", "int8", "fp8", "nf4"])
    invariant_scale: float | None = arg(None, "QuRL invariant scaling s (1.5 unless --quant none)")
    align_forward: bool = arg(False, "QaRL: train through the sampler's quantizer")
    loss: str = arg("acr", "policy objective", choices=["naive", "tis", "acr", "tbpo"])
    eps_low: float = arg(0.2, "PPO clip: ratio >= 1 - eps_low")
    eps_high: float = arg(0.28, "PPO clip: ratio <= 1 + eps_high (DAPO's clip-higher)")
    is_cap: float = arg(2.0, "C: the cap of the importance weight w")
    tbpo_band: tuple[float, float, float] = arg(
        (3e-4, 4e-4, 7e-4), "TBPO keeps a sequence ratio in 1-LO..1+HI+ (A >= 0), 1+HI- (A < 0)",
        nargs=3, metavar=("LO", "HI+", "HI-"))
    steps: int = arg(900, "RL steps")
    prompts_per_step: int = arg(16, "distinct problems per step")
    group_size: int = arg(8, "samples per problem (the GRPO group)")
    max_new_tokens: int = arg(32, "response length limit")
    temperature: float = arg(1.0, "sampling temperature (logits / T on both sides)")
    lr: float = arg(1e-4, "AdamW learning rate")
    lr_schedule: str = arg("cosine", "cosine decay to 0", choices=["cosine", "constant"])
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    mini_batches: int = arg(1, "optimizer steps per pass")
    micro_batch: int = arg(64, "rows per forward and backward")
    grad_checkpointing: bool = arg(False, "less memory, more compute")
    eval_every: int = arg(100, "evaluate every N steps")
    eval_size: int = arg(500, "held-out problems evaluated (0: all)")
    seed: int = arg(1, "the random seed")
    dtype: str = arg("auto", "compute dtype (auto: bf16 on CUDA; fp16 needs loss scaling)",
                     choices=["auto", "float32", "bfloat16"])
    out_dir: str = arg("runs", "where runs/<run-name>/ is written")
    run_name: str | None = arg(None, "run folder (default <quant>-<loss>-s<seed>)")
    resume: str | None = arg(None, "continue the run in this folder")
    compile: bool = arg(False, "decode with a static KV cache, compiled layers, CUDA graphs")


# ==================== THE METHOD, 1: the loop and one RL step
def train(args) -> dict:
    """The RL loop: train_step, an evaluation every --eval-every steps, a checkpoint every
    SAVE_EVERY and on Ctrl-C or SIGTERM."""
    learner, run = start_run(args)
    with stop_requests():
        for step in range(run.step + 1, args.steps + 1):
            lr = lr_at(step, args.steps, args.lr, args.lr_schedule)
            for param_group in learner.optimizer.param_groups:
                param_group["lr"] = lr
            problems = [run.train_set[run.order[(run.data_pos + i) % len(run.order)]]
                        for i in range(args.prompts_per_step)]
            metrics = train_step(learner, args, problems, step)
            run.step, run.data_pos = step, run.data_pos + args.prompts_per_step

            if step % args.eval_every == 0 or step == args.steps:
                run.last_eval = metrics["eval/acc"] = run_eval(learner, args, run.test_set)
            log_step(run, args, metrics | {"opt/lr": lr})

            if STOP or (step % SAVE_EVERY == 0 and step != args.steps):
                save_checkpoint(learner, run)
            if STOP:
                notice(f"stopped at step {step}: continue with --resume {run.dir}")
                raise SystemExit(128 + next(iter(STOP)))  # 130 after Ctrl-C, 143 after SIGTERM
    save_checkpoint(learner, run)
    return finish_run(learner, run, args)


def train_step(learner, args, problems: list[dict], step: int) -> dict:
    """One RL step: sync, rollout, rewards, advantages, pi_prox, update. Returns its metrics."""
    start = time.time()
    G, device = args.group_size, learner.generator.device
    if learner.rollout_codes:  # 1. sync; flips count from the last rollout's codes
        learner.sampler.load_state_dict(learner.rollout_codes, strict=False)
    flip_rate, learner.rollout_codes = sync_weights(learner.sampler, learner.actor), None

    prompts = [format_prompt(p["question"], learner.tokenizer) for p in problems]  # 2. rollout
    generate = compiled_sample if args.compile else sample
    learner.actor.eval()  # if it samples (--quant none): no checkpointing in a decode
    with rollout_autocast(args.quant, device, learner.dtype):
        rollout = generate(learner.sampler, learner.tokenizer, prompts, G, args.max_new_tokens,
                           args.temperature, learner.generator)
    learner.actor.train()
    rollout_s = time.time() - start

    golds = [p["gold"] for p in problems for _ in range(G)]  # 3. rewards, GRPO advantages
    rewards = torch.tensor([reward(text, gold) for text, gold in zip(rollout.texts, golds)],
                           device=device)
    adv, has_signal = group_advantages(rewards, G)  # (B,) each
    batch = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
             "response_mask": rollout.response_mask, "logp_behav": rollout.logp_behav,
             "adv": adv, "row": torch.arange(len(adv), device=device)}

    fmt = args.quant if args.align_forward else None  # 4. pi_prox and the update
    with autocast(device, learner.dtype), rollout_aligned(learner.actor, fmt):
        logp_prox = rollout.logp_behav.clone()  # (B, R); aligned: pi_prox = pi_behav
        if not (has_signal.all() or args.align_forward):  # pi_prox for mismatch/* alone
            with torch.no_grad():
                no_signal = select(batch, ~has_signal)
                logp_prox[~has_signal] = batch_logprobs(learner.actor, no_signal, args)
        update_metrics, logp_prox[has_signal] = update(learner, args, select(batch, has_signal),
                                                       rollout)

    n_tokens = float(rollout.response_mask.sum())
    step_s = time.time() - start
    return {"step": step, "quant/flip_rate": flip_rate, "reward/mean": float(rewards.mean()),
            "reward/zero_std_groups": int((~has_signal).sum()) // G,
            "rollout/len_mean": n_tokens / len(rewards),
            "rollout/truncated": float(rollout.truncated.float().mean()),
            **mismatch_metrics(logp_prox, rollout.logp_behav, rollout.response_mask, args.is_cap),
            "rollout/entropy": float(masked_mean(-rollout.logp_behav, rollout.response_mask)),
            **update_metrics, "perf/rollout_tok_s": n_tokens / max(rollout_s, 1e-9),
            "perf/step_s": step_s, "perf/rollout_frac": rollout_s / max(step_s, 1e-9)}


# ==================== THE METHOD, 2: the sampler: quantized weights, their sync, invariant scaling
# `fmt`: a quantizer's format (fp8, int8, nf4); --quant also takes none, bf16, fp16 (no codes)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_X_MAX = 2.0**14  # bitsandbytes takes fp16 activations: rows above are halved, exactly
NF4_BLOCK = 64  # weights per absmax block (QLoRA's NF4, QaRL's W4A16)


@torch.no_grad()
def sync_weights(sampler, actor) -> float:
    """sampler <- actor in place (QuantLinears re-quantized). Returns the flip rate, the share of
    codes (half copies: values) changed: QuRL's weight-update problem."""
    if sampler is actor:
        return 0.0
    actor_modules = dict(actor.named_modules())
    changed = total = 0
    for name, module in decoder_linears(sampler):
        source = actor_modules[name]
        if isinstance(module, QuantLinear):
            changed += module.load_weight(source.weight, source.bias)
        else:  # a half copy: its codes are its values
            changed += int((module.weight != source.weight.to(module.weight.dtype)).sum())
        total += source.weight.numel()

    actor_params = dict(actor.named_parameters(remove_duplicate=False))  # lm_head may be untied
    for name, param in sampler.named_parameters():
        param.copy_(actor_params[name])
    return changed / max(total, 1)


def decoder_linears(model) -> list[tuple[str, nn.Module]]:
    """The linears QuRL quantizes: the decoder layers' (not embeddings, lm_head)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, QuantLinear)) and ".layers." in f".{name}"]


class QuantLinear(nn.Module):
    """nn.Linear in the sampler: fp8 (e4m3), int8 (LLM.int8): W8A8, weights per output channel,
    activations per token; nf4: W4A16 (QaRL's)."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self.kernel = "emulate"  # FP8: torch._scaled_mm on CUDA 8.9+, else emulated
        if linear.weight.is_cuda and torch.cuda.get_device_capability() >= (8, 9):
            self.kernel = "scaled_mm"
        for name in ("weight_q", "weight_scale", "bias"):
            self.register_buffer(name, None)
        self.register_buffer("weight_deq", None, persistent=False)  # CPU: values
        if linear.bias is not None:
            self.bias = linear.bias.detach().clone()
        self.nf4_state = None
        self.load_weight(linear.weight)

    @torch.no_grad()
    def load_weight(self, weight: Tensor, bias: Tensor | None = None) -> int:
        """Re-quantize in place; returns how many codes changed."""
        codes, scale, state = quantize(weight, self.fmt)
        changed = weight.numel()
        if self.weight_q is None:
            self.weight_q, self.weight_scale, self.nf4_state = codes, scale, state
        else:
            diff = self.weight_q.view(torch.uint8) ^ codes.view(torch.uint8)
            if self.fmt == "nf4":  # two 4-bit codes a byte
                diff = torch.stack([diff & 0x0F, diff & 0xF0])
            changed = int((diff != 0).sum())
            self.weight_q.copy_(codes)  # in place: a compiled decode holds these
            self.weight_scale.copy_(scale)
        if self.nf4_state is not None:
            self.nf4_state.absmax = self.weight_scale

        if self.fmt != "int8" and not codes.is_cuda:  # the CPU dequantizes once per sync
            values = dequantize(self.weight_q, self.weight_scale, self.nf4_state, self.fmt)
            if self.weight_deq is None:
                self.weight_deq = values
            else:
                self.weight_deq.copy_(values)
        if bias is not None:
            self.bias.copy_(bias)
        return changed

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type  # under autocast a linear returns the autocast dtype
        out_dtype = x.dtype
        if torch.is_autocast_enabled(device):
            out_dtype = torch.get_autocast_dtype(device)
        bias = self.bias.to(out_dtype) if self.bias is not None else None

        if self.fmt != "nf4":  # W8A8: 8-bit codes on both sides
            x2 = x.reshape(-1, self.in_features)  # (M, K): a row per token
            if self.fmt == "fp8":
                y = fp8_matmul(x2, self.weight_q, self.weight_scale, self.kernel, self.weight_deq)
            else:
                y = int8_matmul(x2, self.weight_q, self.weight_scale)
            y = y.to(out_dtype).reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias

        weight = self.weight_deq  # NF4, W4A16: the weights meet x in the compute dtype
        if weight is None:  # CUDA: bitsandbytes dequantizes into that dtype each call
            self.nf4_state.dtype = out_dtype
            weight = dequantize(self.weight_q, self.weight_scale, self.nf4_state, "nf4")
        return F.linear(x.to(out_dtype), weight.to(out_dtype), bias)


def quantize(weight: Tensor, fmt: str) -> tuple[Tensor, Tensor, object]:
    """Weights in the sampler's format: (codes, fp32 scales per row or NF4 block, NF4's state).
    NF4 (QLoRA's): 64 weights over their absmax, each to the nearest of 16 normal quantiles."""
    if fmt == "fp8":
        codes, scale = quantize_fp8(weight)
        return codes, scale, None
    if fmt == "int8":
        codes, absmax = quantize_int8(weight)
        return codes, absmax.float(), None

    import bitsandbytes.functional as bnbF
    weight = weight.detach().float().contiguous()
    codes, state = bnbF.quantize_4bit(weight, blocksize=NF4_BLOCK, quant_type="nf4")
    return codes, state.absmax.float(), state


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row FP8 e4m3 (QuRL's W8A8; a row: an output channel, a token): x ~= x8 * scale[:, None],
    scale = amax|row| / 448."""
    xf = x.detach().float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    x8 = (xf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # cast: no clamp
    return x8, scale


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """LLM.int8 vector-wise INT8 (bitsandbytes, threshold 0): x ~= x8 * absmax[:, None] / 127."""
    import bitsandbytes.functional as bnbF
    x8, absmax, _ = bnbF.int8_vectorwise_quant(x.detach().to(torch.float16).contiguous(), 0.0)
    return x8, absmax


def dequantize(codes: Tensor, scale: Tensor, state, fmt: str) -> Tensor:
    """fp32 values of `quantize`'s codes: code * scale (INT8: absmax / 127)."""
    if fmt == "fp8":
        return codes.float() * scale[:, None]
    if fmt == "int8":
        return codes.float() * (scale[:, None] / 127.0)
    import bitsandbytes.functional as bnbF
    return bnbF.dequantize_4bit(codes, state)


def fp8_matmul(x2: Tensor, weight_q: Tensor, weight_scale: Tensor, kernel: str = "emulate",
               weight_deq: Tensor | None = None) -> Tensor:
    """y = Q(x2) Q(W)^T in FP8 for (M, K) activations (quantized per token), (N, K) weight codes:
    by torch._scaled_mm, or dequantized (`weight_deq` if given)."""
    with torch.autocast(x2.device.type, enabled=False):  # the kernel fixes its own numerics
        x8, x_scale = quantize_fp8(x2)  # (M, K) codes, (M,) scales
        x_scale = x_scale[:, None]
        dtype = torch.bfloat16 if x2.is_cuda else torch.float32  # holds every e4m3 code
        if kernel == "scaled_mm":  # bf16 on CUDA (the kernel's own rounding), fp32 on CPU
            return torch._scaled_mm(x8, weight_q.t(), x_scale, weight_scale[None], out_dtype=dtype)

        if weight_deq is not None:  # the scales applied before the sum
            return F.linear(x8.float() * x_scale, weight_deq)
        return (x8.to(dtype) @ weight_q.to(dtype).t()).float() * x_scale * weight_scale


def int8_matmul(x2: Tensor, weight_q: Tensor, weight_absmax: Tensor) -> Tensor:
    """y = Q(x2) Q(W)^T by bitsandbytes' LLM.int8 kernels (threshold 0: pure W8A8)."""
    import bitsandbytes.functional as bnbF
    with torch.autocast(x2.device.type, enabled=False):
        shift = int8_shift(x2)  # (M, 1)
        x8, x_absmax = quantize_int8(x2 / shift)
        acc = bnbF.int8_linear_matmul(x8, weight_q)  # int32 = x8 @ w8^T
        y = bnbF.int8_mm_dequant(acc, x_absmax, weight_absmax)  # * absmax_x absmax_w / 127^2
        return y.float() * shift


def int8_shift(x2: Tensor) -> Tensor:
    """(M, 1) powers of 2 bringing each row's absmax under INT8_X_MAX (real checkpoints carry
    activations of 1e4-1e5): dividing by them is exact."""
    amax = x2.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.exp2(torch.ceil(torch.log2((amax / INT8_X_MAX).clamp(min=1.0))))


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --quant's half copies


def make_sampler(actor, quant: str, dtype):
    """none: the actor; bf16, fp16: a copy in that dtype (RoPE's buffers fp32); int8, fp8, nf4:
    `quantized_copy`, its lm_head in `dtype`, the rest fp32 under autocast."""
    if quant == "none":
        return actor
    if quant in HALF:
        memo = {id(param): nn.Parameter(param.detach().to(HALF[quant]), requires_grad=False)
                for param in actor.parameters()}
        return copy.deepcopy(actor, memo).eval()

    sampler = quantized_copy(actor, quant)
    head = sampler.get_output_embeddings()  # its own weight even if the actor ties it
    head.weight = nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
    return sampler


def quantized_copy(actor, fmt: str):
    """A frozen copy of the actor, its decoder linears QuantLinears (deepcopy's memo: no fp32
    copy)."""
    memo = {id(linear): QuantLinear(linear, fmt) for _, linear in decoder_linears(actor)}
    return copy.deepcopy(actor, memo).eval().requires_grad_(False)


@torch.no_grad()
def invariant_rescale(model, s: float):
    """QuRL's update-aware quantization (Eq. 11-12), once before RL: W x = (W / s)(s x), q/k/v and
    gate/up weights over s, their RMSNorms times s. W / s's grid is s times finer, Adam's updates
    as large: more of them reach the sampler."""
    if type(model).__name__ not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        raise QurlError(f"invariant scaling supports Qwen2, Qwen3 and Llama, not "
                        f"{type(model).__name__}: use --invariant-scale 1")
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        pairs = [(layer.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj]),
                 (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])]
        for norm, linears in pairs:
            norm.weight.mul_(s)  # s x (an RMSNorm is linear in its weight)
            for linear in linears:
                linear.weight.div_(s)  # W / s; the bias stays: (W / s)(s x) + b = W x + b


# ==================== THE METHOD, 3: the rollout, recording logp_behav
SYSTEM_PROMPT = ("Solve the problem step by step. Put the final answer, a number only, after "
                 "'####' on the last line.")


def format_prompt(question: str, tokenizer) -> str:
    """The chat template where the tokenizer has one, else the tiny model's format."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Q: {question}\nA: "


SYNC_EVERY = 8  # tokens between host syncs on a GPU (each stalls its launch queue)


@dataclass
class Rollout:
    input_ids: Tensor  # (B, P + R): the left-padded prompt, the response
    attention_mask: Tensor  # (B, P + R): 0 on the left padding
    response_mask: Tensor  # (B, R): 1 up to the first EOS, included (by position)
    logp_behav: Tensor  # (B, R): each token's log-prob where it was drawn
    prompt_len: int  # P: response token r sits at column P + r
    texts: list[str]
    truncated: Tensor  # (B,): no EOS


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int = 1, max_new_tokens: int = 64,
           temperature: float = 1.0, generator: torch.Generator | None = None) -> Rollout:
    """n samples of each prompt (`decode`)."""
    input_ids, prompt_mask = encode(tokenizer, prompts, next(model.parameters()).device)
    return decode(model, tokenizer, input_ids, prompt_mask, n, max_new_tokens, temperature,
                  generator)


def encode(tokenizer, prompts: list[str], device, multiple: int | None = None):
    """(b, P) token ids, left-padded (to a multiple of `multiple`), their mask."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                        padding_side="left", pad_to_multiple_of=multiple).to(device)
    return encoded["input_ids"], encoded["attention_mask"]


@torch.no_grad()
def decode(model, tokenizer, input_ids: Tensor, prompt_mask: Tensor, n: int, max_new_tokens: int,
           temperature: float, generator=None, forced: Tensor | None = None) -> Rollout:
    """(b, P) prompts decoded n times each: prefilled once, finished rows leaving when a quarter
    are done, RoPE positions from the mask. `forced` (B, <= R): tokens fed, not drawn."""
    device, B, pad = input_ids.device, len(input_ids) * n, tokenizer.pad_token_id
    logits, cache, cache_kwarg, stop_ids = _prefill(model, tokenizer, input_ids, prompt_mask)
    cache.batch_repeat_interleave(n)  # rows i n .. i n + n - 1: prompt i's samples
    logits = logits.repeat_interleave(n, 0)  # (B, V)
    attention_mask = prompt_mask.repeat_interleave(n, 0)  # (B, P), then a column a token
    position = attention_mask.sum(-1)  # (B,): the next RoPE position

    tokens, logp_behav, fed, end, done = _buffers(B, max_new_tokens, pad, forced, device)
    out_rows = torch.arange(B, device=device)  # batch row -> output row
    noise = 1.0  # a fed decode draws nothing
    for t in range(max_new_tokens):
        if forced is None:
            noise = torch.empty_like(logits, dtype=torch.float).exponential_(generator=generator)
        token, logp_behav[out_rows, t], end[out_rows], done = _advance(
            logits, temperature, noise, fed[out_rows, t], done, end[out_rows], t, stop_ids, pad)
        tokens[out_rows, t] = token
        if t == max_new_tokens - 1:
            break

        if device.type == "cpu" or t % SYNC_EVERY == 0:  # a host sync
            n_done = int(done.sum())
            if n_done == len(out_rows):
                break
            if n_done >= len(out_rows) / 4:  # drop the finished rows (and their cache)
                unfinished = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(unfinished)
                out_rows, token, done = out_rows[unfinished], token[unfinished], done[unfinished]
                attention_mask, position = attention_mask[unfinished], position[unfinished]

        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(out_rows), 1)], 1)
        logits = model(input_ids=token[:, None], attention_mask=attention_mask, use_cache=True,
                       position_ids=position[:, None], **cache_kwarg).logits[:, -1]  # (b, V)
        position = position + 1
    R = t + 1
    return _finish(tokenizer, input_ids, prompt_mask, n, tokens[:, :R], logp_behav[:, :R], end)


def _buffers(B, R, pad, forced, device):
    """Both decodes' outputs, by output row: (B, R) tokens, log-probs, the tokens to take
    (`forced` in its columns; -1: draw), (B,) the first EOS's index (R: none), done."""
    tokens = torch.full((B, R), pad, device=device)
    fed = torch.full_like(tokens, -1)
    if forced is not None:
        fed[:, :forced.shape[1]] = forced
    logp, end = torch.zeros(B, R, device=device), torch.full((B,), R, device=device)
    return tokens, logp, fed, end, torch.zeros_like(end, dtype=torch.bool)


def _prefill(model, tokenizer, input_ids: Tensor, attention_mask: Tensor):
    """The prompts into a new KV cache: (last logits, cache, {keyword: cache}, stop ids).
    transformers 5.24 calls it `cache`, older ones `past_key_values`; each ignores the other."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    parameters = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in parameters else "past_key_values"

    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (b, P)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=True, logits_to_keep=1, **{keyword: cache}).logits[:, -1]  # (b, V)
    if cache.get_seq_length() != input_ids.shape[1]:
        import transformers
        raise RuntimeError(f"the model did not fill the KV cache (transformers "
                           f"{transformers.__version__}; tested: 4.57 to 5.25)")

    stop_ids = torch.tensor(stop_token_ids(model, tokenizer), device=input_ids.device)
    return logits, cache, {keyword: cache}, stop_ids


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids: the tokenizer's and the generation config's (Qwen: <|im_end|> too)."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    if not isinstance(configured, (list, tuple)):
        configured = [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})


def _advance(logits, temperature, noise, fed, done, end, t, stop_ids, pad):
    """Token t in both decodes: the tokens (padding after a row's end), their log-probs; a row's
    first stop token sets its `end` to t and `done`."""
    token, logp_behav = _pick(logits, temperature, noise, fed)
    token = torch.where(done, pad, token)
    finished = torch.isin(token, stop_ids) & ~done
    return token, logp_behav, torch.where(finished, t, end), done | finished


def _pick(logits: Tensor, temperature: float, noise: Tensor | float,
          fed: Tensor) -> tuple[Tensor, Tensor]:
    """The next token, `fed` where >= 0, else argmax(p / E), E ~ Exp(1) `noise` (multinomial's
    draw, no host sync); its log-prob under p = softmax(logits / T), untruncated as the ratio."""
    if temperature == 0:  # greedy; the log-prob is reported at T = 1
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
        token = torch.where(fed >= 0, fed, log_probs.argmax(dim=-1))
        return token, log_probs.gather(-1, token[:, None]).squeeze(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    token = torch.where(fed >= 0, fed, probs.div(noise).argmax(dim=-1))
    return token, probs.gather(-1, token[:, None]).log().squeeze(-1)


def _finish(tokenizer, input_ids, prompt_mask, n, tokens, logp_behav, end) -> Rollout:
    """The Rollout of (B, R) tokens, log-probs, (B,) first EOS of (b, P) prompts n times each."""
    R = tokens.shape[1]
    response_mask = (torch.arange(R, device=tokens.device)[None, :] <= end[:, None]).float()
    responses = [row[mask.bool()].tolist() for row, mask in zip(tokens, response_mask)]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)

    prompt_ids = input_ids.repeat_interleave(n, 0)  # (B, P)
    prompt_mask = prompt_mask.repeat_interleave(n, 0)
    ids = torch.cat([prompt_ids, tokens], dim=1)  # (B, P + R)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(tokens)], dim=1)
    return Rollout(ids, attention_mask, response_mask, logp_behav * response_mask,
                   input_ids.shape[1], texts, end >= R)


def rollout_autocast(quant: str, device, dtype):
    """A half copy (bf16, fp16) decodes in its dtype, autocast off; others as the actor."""
    if quant in HALF:
        dtype = torch.float32
    return autocast(device, dtype)


def autocast(device, dtype):
    """Forwards compute in `dtype` on fp32 master weights; fp32: autocast off."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


# ==================== THE METHOD, 4: reward and advantages
def reward(completion: str, gold: str) -> float:
    """1.0 when the final answer equals the gold one (3.50 == 3.5), else 0.0."""
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    gold = _normalize(gold)
    try:
        return float(Fraction(predicted) == Fraction(gold))  # exact values
    except (ValueError, ZeroDivisionError):  # a word answer
        return float(predicted == gold)


def extract_answer(text: str) -> str | None:
    """The final answer: '#### 42' (as asked; GSM8K's golds), else '\\boxed{42}' (Qwen's instruct
    models box it anyway), else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n")[0]
        return _normalize(tail) if tail else None

    boxed = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", text)  # one level of nested braces
    if boxed and boxed[-1].strip():
        return _normalize(boxed[-1])

    last = _last_number(text)
    return _normalize(last) if last is not None else None


def _normalize(answer: str) -> str:
    """'$1,234.50' -> '1234.50', '\\frac{3}{4}' -> '3/4', '12 eggs' -> '12'; words lowercased."""
    text = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", answer).replace("−", "-")
    text = re.sub(r"\\text\{([^{}]*)\}|[$%,]|\\!?", r"\1", text)  # \text{x} -> x; $ % , \ out
    number = _last_number(text)
    if number is None:  # no digit: a word answer
        return " ".join(text.split()).strip(".").lower()
    return number.replace(" ", "")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _last_number(text: str) -> str | None:
    """The last number in text ('1,234', '-0.5', '3/4'), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def group_advantages(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (reward_i - mean) / (std + 1e-6) in groups of consecutive rows (unbiased std,
    as TRL); has_signal: False where a group's rewards are equal."""
    grouped = rewards.float().view(-1, group_size)
    std = grouped.std(dim=1, keepdim=True)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (std + 1e-6)
    has_signal = (std > 0).expand_as(grouped)
    return adv.reshape(-1), has_signal.reshape(-1)


# ==================== THE METHOD, 5: the update: pi_prox, the aligned forward, the optimizer steps
@contextlib.contextmanager
def rollout_aligned(model, fmt: str | None):
    """In this block the decoder linears are `aligned_linear`s (fmt None, bf16, fp16: unchanged)."""
    linears = []
    if fmt and fmt not in HALF:
        linears = [module for _, module in decoder_linears(model)]
    for linear in linears:
        linear.forward = lambda x, linear=linear: aligned_linear(linear, fmt, x)
    try:
        yield model
    finally:
        for linear in linears:
            del linear.forward


def aligned_linear(linear: nn.Linear, fmt: str, x: Tensor) -> Tensor:
    """QaRL's rollout-aligned linear: the sampler's fake-quantized weights and (W8A8) activations,
    the gradient straight through (logp's value: `sampler_logprobs`)."""
    x_q = x if fmt == "nf4" else fake_quant(x, fmt)  # W4A16 leaves activations alone
    return F.linear(x_q, fake_quant(linear.weight, fmt), linear.bias)


def fake_quant(x: Tensor, fmt: str) -> Tensor:
    """Quantize-dequantize in the sampler's format: the value quantized, the gradient identity."""
    x2 = x if fmt == "nf4" else x.reshape(-1, x.shape[-1])  # a row per token, output channel
    shift = int8_shift(x2) if fmt == "int8" else 1.0  # as the sampler handles overflow
    values = dequantize(*quantize(x2 / shift, fmt), fmt) * shift
    return x + (values.reshape(x.shape).to(x.dtype) - x).detach()


def select(batch: dict, rows) -> dict:
    """Some rows of row-aligned tensors."""
    return {key: value[rows] for key, value in batch.items()}


def batch_logprobs(model, batch: dict, args) -> Tensor:
    """`token_logprobs` of a batch."""
    return token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                          batch["response_mask"], args.temperature, args.micro_batch)


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                   temperature: float = 1.0, micro_batch: int = 64) -> Tensor:
    """Teacher-forced (B, R) log-probs of the last R tokens of (B, P + R) rows, log_softmax(logits
    / T): a full forward a micro-batch."""
    R = response_mask.shape[1]
    if temperature <= 0:  # greedy rollouts are scored at T = 1
        temperature = 1.0
    chunks = []
    for i in range(0, input_ids.shape[0], micro_batch):
        ids, mask = input_ids[i:i + micro_batch], attention_mask[i:i + micro_batch]  # (b, P + R)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=R + 1).logits[:, :-1]  # (b, R, V): j predicts token j + 1
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        chunks.append(z.gather(-1, ids[:, -R:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1))
        del logits, z
    return torch.cat(chunks) * response_mask


MAX_GRAD_NORM = 1.0


def update(learner, args, batch: dict, rollout: Rollout | None = None) -> tuple[dict, Tensor]:
    """--ppo-epochs passes of --mini-batches optimizer steps over rows (`row`) of `rollout`.
    Returns the mean metrics and pi_prox (B, R), the actor's before them (aligned: pi_behav)."""
    mini_batches = _batches(len(batch["input_ids"]), args.mini_batches)
    logp_prox = batch["logp_behav"].clone()  # (B, R)
    if len(mini_batches) > 1 and not args.align_forward:
        later = slice(mini_batches[0].stop, None)
        with torch.no_grad():
            logp_prox[later] = batch_logprobs(learner.actor, select(batch, later), args)

    logp_sampler = batch["logp_behav"]  # aligned: logp's value, the sampler's log-probs
    logs, skipped = [], 0
    learner.optimizer.zero_grad()  # and after each optimizer step (freed)
    for epoch in range(args.ppo_epochs):
        for rows in mini_batches:
            mini, first = select(batch, rows), epoch == 0 and rows == mini_batches[0]
            prox = None if first and not args.align_forward else logp_prox[rows]  # None: its own
            if args.align_forward and not first:  # the actor moved: decode again
                logp_sampler = sampler_logprobs(learner, args, rollout)[batch["row"]]
            aligned = logp_sampler[rows] if args.align_forward else None
            metrics, finite, logp = backward_mini_batch(learner, args, mini, prox, aligned)
            if prox is None:
                logp_prox[rows] = logp

            grad_norm = torch.nn.utils.clip_grad_norm_(learner.actor.parameters(), MAX_GRAD_NORM)
            if finite and torch.isfinite(grad_norm):  # no optimizer step on NaN or inf
                learner.optimizer.step()
                torch.clear_autocast_cache()  # autocast keeps bf16 weights until its block ends
            else:
                skipped += 1
            learner.optimizer.zero_grad()
            logs.append(metrics)

    averaged = {"guard/skipped": skipped}
    if logs:
        for key in logs[0]:
            averaged[key] = sum(log[key] for log in logs) / len(logs)
    return averaged, logp_prox


def _batches(n_rows: int, n_parts: int) -> list[slice]:
    """n_parts contiguous slices, their sizes differing by at most one."""
    bounds = [round(i * n_rows / n_parts) for i in range(n_parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@torch.no_grad()
def sampler_logprobs(learner, args, rollout: Rollout) -> Tensor:
    """The sampler's (B, R) log-probs of the rollout's tokens at the actor's weights: re-synced,
    it runs the rollout's decode again (all rows, the same path), fed the tokens. No other decode
    computes its numbers: GEMMs round by row count, activation codes make a bit a code."""
    if learner.rollout_codes is None:  # the next sync counts flips from these
        state = learner.sampler.state_dict().items()
        learner.rollout_codes = {k: v.clone() for k, v in state if ".layers." in k}
    sync_weights(learner.sampler, learner.actor)
    G, P = args.group_size, rollout.prompt_len
    decode_fed = compiled_decode if args.compile else decode
    with rollout_autocast(args.quant, learner.generator.device, learner.dtype):
        fed = decode_fed(learner.sampler, learner.tokenizer, rollout.input_ids[::G, :P],
                         rollout.attention_mask[::G, :P], G, args.max_new_tokens,
                         args.temperature, forced=rollout.input_ids[:, P:])
    return fed.logp_behav


def backward_mini_batch(learner, args, mini: dict, logp_prox: Tensor | None,
                        logp_sampler: Tensor | None = None) -> tuple[dict, bool, Tensor]:
    """A mini-batch's gradient summed over micro-batches, each loss over the mini-batch's
    denominator (TBPO's, known after the forwards, divides the sum): the one-pass gradient at a
    micro-batch's memory. logp_prox None: the forward's; `logp_sampler` (aligned): logp's value,
    the gradient the forward's. Returns (metrics, all finite, (b, R) logp detached)."""
    mask = mini["response_mask"]  # (b, R)
    micro_batches = [slice(i, i + args.micro_batch) for i in range(0, len(mask), args.micro_batch)]
    loss_fn = functools.partial(token_loss, kind=args.loss, eps_low=args.eps_low,
                                eps_high=args.eps_high, is_cap=args.is_cap)
    denom = mask.sum().clamp(min=1.0)  # token losses: the mini-batch's tokens
    if args.loss == "tbpo":
        denom = 1.0
        loss_fn = functools.partial(tbpo_loss, is_cap=args.is_cap, tbpo_band=args.tbpo_band)

    logps, proxes, finite = [], [], torch.tensor(True)
    for rows in micro_batches:
        micro = select(mini, rows)
        logp = batch_logprobs(learner.actor, micro, args)  # (m, R), with grad
        if logp_sampler is not None:  # the sampler's value, the forward's gradient
            logp = logp_sampler[rows] + (logp - logp.detach())
        prox = logp.detach()
        if logp_prox is not None:
            prox = logp_prox[rows]
        loss, _ = loss_fn(logp, prox, micro["logp_behav"], micro["adv"], micro["response_mask"],
                          denom=denom)
        loss.backward()
        finite = finite & torch.isfinite(loss.detach())
        logps.append(logp.detach())
        proxes.append(prox)

    logp, prox = torch.cat(logps), torch.cat(proxes)  # (b, R) each
    if args.loss == "tbpo":  # the sequences in band
        denom = tbpo_ratio(logp, prox, mini["adv"], mask, args.tbpo_band)[1].sum().clamp(min=1)
        for param in learner.actor.parameters():
            if param.grad is not None:
                param.grad /= denom
    _, metrics = loss_fn(logp, prox, mini["logp_behav"], mini["adv"], mask, denom=denom)
    metrics["loss/entropy"] = masked_mean(-logp, mask)  # of the sampled tokens
    values = torch.stack([*metrics.values(), finite]).tolist()  # one host sync
    return dict(zip(metrics, values)), bool(values[-1]), logp


# ==================== THE METHOD, 6: the losses and the mismatch metrics
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: a runaway log-ratio stays finite


def token_loss(logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor,
               kind: str, eps_low: float, eps_high: float, is_cap: float,
               denom: Tensor | float | None = None) -> tuple[Tensor, dict]:
    """Token objectives over (B, R) log-probs, (B,) adv, (B, R) mask: naive clips pi_theta /
    pi_behav; tis clips pi_theta / pi_prox, weighted by w = min(pi_prox / pi_behav, C); acr widens
    the upper bound where w is cut. The mask's mean (DAPO), or sum / `denom`."""
    logp_prox, logp_behav = logp_prox.detach(), logp_behav.detach()
    adv = adv.detach().to(logp.dtype)[:, None]  # a token takes its sequence's advantage
    mask = mask.to(logp.dtype)
    log_w = (logp_prox - logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    w = log_w.exp().clamp(max=is_cap)  # QuRL Eq. 5: w = min(pi_prox / pi_behav, C), no grad
    log_ratio = logp - logp_prox  # pi_theta / pi_prox
    if kind == "naive":  # QuRL Eq. 3: pi_theta / pi_behav, the sampler as the old policy
        log_ratio, w = logp - logp_behav, torch.ones_like(w)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    upper = torch.full_like(logp, 1 + eps_high)
    if kind == "acr":
        r = (is_cap * (-log_w).exp()).clamp(max=1.0)  # QuRL Eq. 9: r = min(1, C pi_behav/pi_prox)
        upper = upper / r  # QuRL Eq. 9: the upper bound (1 + eps_high) / r

    clipped = ratio.clamp(min=1 - eps_low).minimum(upper)
    per_token = -w * torch.minimum(ratio * adv, clipped * adv)  # -w min(ratio A, clip(ratio) A)
    if denom is None:
        denom = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / denom

    ratio = ratio.detach()
    clip_low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)  # tokens the clip stops
    clip_high = ((ratio > upper) & (adv > 0)).to(mask.dtype)
    return loss, {"loss/policy": loss.detach(), "clip/low": masked_mean(clip_low, mask),
                 "clip/high": masked_mean(clip_high, mask),
                 "clip/acr_upper": masked_mean(upper, mask)}


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """The mean of x where mask is 1 (all, or along dim); 0 where empty."""
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(p || q) from samples of p, r = log q/p: e^r - 1 - r."""
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp() - 1 - log_ratio


def tbpo_loss(logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor,
              is_cap: float, tbpo_band: tuple[float, float, float],
              denom: Tensor | float | None = None) -> tuple[Tensor, dict]:
    """QaRL's Trust-Band Policy Optimization (`token_loss`'s shapes): A >= 0 PPO-clipped to
    [1 - LO, 1 + HI+], A < 0 held in [1 - LO, 1 + HI-]. Sequences out of band leave the loss and
    its denominator (their count, or `denom`)."""
    adv, mask = adv.detach().to(logp.dtype), mask.to(logp.dtype)
    lo, hi_pos, hi_neg = tbpo_band
    ratio, in_band, below, above = tbpo_ratio(logp, logp_prox, adv, mask, tbpo_band)
    log_w = (logp_prox - logp_behav).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    w_hat = masked_mean(log_w, mask, dim=1).exp().clamp(max=is_cap)  # min(w_i, C), no grad

    positive = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi_pos) * adv)  # A >= 0: clip
    negative = ratio.clamp(1 - lo, 1 + hi_neg) * adv  # A < 0: the band
    loss = -(in_band * w_hat * torch.where(adv >= 0, positive, negative)).sum()
    if denom is None:
        denom = in_band.sum().clamp(min=1)
    loss = loss / denom

    n_nonempty = (mask.sum(1) > 0).sum().clamp(min=1)
    return loss, {"loss/policy": loss.detach(), "tbpo/kept": in_band.sum() / n_nonempty,
                 "clip/low": below.sum() / n_nonempty, "clip/high": above.sum() / n_nonempty}


def tbpo_ratio(logp: Tensor, logp_prox: Tensor, adv: Tensor, mask: Tensor,
               tbpo_band: tuple[float, float, float]) -> tuple[Tensor, ...]:
    """TBPO's (B,) sequence ratios exp(mean_t log pi_theta / pi_prox) (as GSPO's), in_band, below,
    above. A >= 0 below 1 - LO stays in band: there its loss min(ratio A, clip(ratio) A) is ratio A,
    whose gradient raises the ratio."""
    lo, hi_pos, hi_neg = tbpo_band
    log_ratio = masked_mean(logp - logp_prox.detach(), mask, dim=1)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    held = ratio.detach()
    below = (adv < 0) & (held < 1 - lo)
    above = torch.where(adv >= 0, held > 1 + hi_pos, held > 1 + hi_neg)
    return ratio, (mask.sum(1) > 0) & ~below & ~above, below, above


def mismatch_metrics(logp_prox: Tensor, logp_behav: Tensor, mask: Tensor,
                     is_cap: float = 2.0) -> dict:
    """Over the sampled tokens: k3 KL(pi_behav || pi_prox), mean |log w|, max w, the share of w
    above C (cut by TIS), w = pi_prox / pi_behav."""
    log_w = (logp_prox - logp_behav).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_max = 1.0
    if mask.any():
        ratio_max = float(log_w.masked_fill(mask == 0, -math.inf).max().exp())
    return {"mismatch/kl": float(masked_mean(k3(log_w), mask)),
            "mismatch/logp_absdiff": float(masked_mean(log_w.abs(), mask)),
            "mismatch/ratio_max": ratio_max,
            "mismatch/w_truncated": float(masked_mean((log_w > math.log(is_cap)).float(), mask))}


# ==================== APPENDIX: plumbing (flags, data, model, runs)
METRIC_KEYS = ["step", "quant/flip_rate", "reward/mean", "reward/zero_std_groups",
               "rollout/len_mean", "rollout/truncated", "mismatch/kl", "mismatch/logp_absdiff",
               "mismatch/ratio_max", "mismatch/w_truncated", "rollout/entropy", "clip/low",
               "clip/high", "clip/acr_upper", "loss/policy", "loss/entropy", "tbpo/kept",
               "guard/skipped", "perf/rollout_tok_s", "perf/step_s", "perf/rollout_frac", "opt/lr",
               "eval/acc"]
LOG_EVERY, SAVE_EVERY = 10, 50  # steps between progress lines, checkpoints


@dataclass
class Learner:
    """What an RL step touches."""
    actor: nn.Module  # fp32 master weights
    optimizer: torch.optim.Optimizer
    sampler: nn.Module  # the rollout's copy (--quant none: the actor)
    tokenizer: object
    generator: torch.Generator  # the sampler's random numbers
    dtype: torch.dtype  # the compute dtype
    rollout_codes: dict | None = None  # aligned: the sampler's codes before `update` re-syncs it


@dataclass
class RunState:
    """A run's bookkeeping between steps."""
    dir: Path
    train_set: list[dict]
    test_set: list[dict]
    order: list[int]  # a permutation of train_set's indices
    invariant_scale: float  # s
    step: int = 0  # the last step finished
    data_pos: int = 0  # problems consumed so far
    first_eval: float | None = None  # the accuracy at the start, the latest
    last_eval: float | None = None
    skipped: int = 0  # non-finite updates skipped
    t_start: float = 0.0


def start_run(args):
    """Check data, model, folder; build the learner; only then write; evaluate the start."""
    device, dtype = resolve_device_dtype(args.dtype)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    train_set = load_problems(args.train_data, "train")
    test_set = load_problems(args.test_data, "test")[:args.eval_size or None]
    actor, tokenizer = load_model(args.model, device, torch.float32)
    prepare_actor(actor, args.grad_checkpointing)
    check_prompt_lengths(actor, tokenizer, train_set + test_set, args.max_new_tokens)
    folder = run_dir(args)

    s = args.invariant_scale
    if s is None:
        s = 1.0 if args.quant == "none" else 1.5
    if s != 1.0:
        invariant_rescale(actor, s)
    ckpt = load_checkpoint(folder / "ckpt.pt", actor) if args.resume else None

    optimizer = torch.optim.AdamW(actor.parameters(), args.lr, (0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    learner = Learner(actor, optimizer, make_sampler(actor, args.quant, dtype), tokenizer,
                      generator, dtype)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed + 1))
    run = RunState(folder, train_set, test_set, order.tolist(), s)
    if ckpt:
        resume_from(learner, run, ckpt)
        notice(f"resuming from {folder / 'ckpt.pt'} (written after step {run.step}): step "
               f"{run.step + 1} of {args.steps} is next")
    else:
        try:
            folder.mkdir(parents=True)
            (folder / "args.json").write_text(json.dumps(asdict(args), indent=1))
        except OSError as e:
            raise QurlError(f"cannot write to {folder} ({e.strerror}); choose another --out-dir")

    run.t_start = time.time()
    if not ckpt:
        run.first_eval = run.last_eval = run_eval(learner, args, test_set)
        notice(f"step 0: eval/acc {run.first_eval:.3f} on {len(test_set)} held-out problems")
    return learner, run


def run_eval(learner, args, problems):
    learner.actor.eval()
    with autocast(learner.generator.device, learner.dtype):
        accuracy = evaluate(learner.actor, learner.tokenizer, problems, args.max_new_tokens)
    learner.actor.train()
    return accuracy


@torch.no_grad()
def evaluate(model, tokenizer, problems, max_new_tokens=32, batch_size=256):
    """Greedy accuracy on held-out problems."""
    correct = 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [format_prompt(p["question"], tokenizer) for p in chunk]
        rollout = sample(model, tokenizer, prompts, 1, max_new_tokens, temperature=0.0)
        correct += sum(reward(text, p["gold"]) for text, p in zip(rollout.texts, chunk))
    return correct / len(problems)


def log_step(run, args, metrics):
    """A step's metrics.jsonl row; every LOG_EVERY steps a progress line."""
    run.skipped += metrics["guard/skipped"]
    if metrics["guard/skipped"]:
        notice(f"step {run.step}: non-finite loss or gradient, update skipped")
    row = {key: metrics.get(key) for key in METRIC_KEYS} | {"guard/skipped": run.skipped}
    with open(run.dir / "metrics.jsonl", "a") as file:
        file.write(json.dumps(row) + "\n")
    if run.step % LOG_EVERY == 0 or run.step == args.steps:
        print(f"step {run.step:4d}/{args.steps} reward {row['reward/mean']:.3f} eval "
              f"{run.last_eval or 0:.3f} kl {row['mismatch/kl']:.1e} flip "
              f"{row['quant/flip_rate']:.2%} tok/s {row['perf/rollout_tok_s']:.0f} "
              f"[{time.time() - run.t_start:.0f}s]", flush=True)


def save_checkpoint(learner, run):
    """What a run resumes from, moved into place by os.replace: a crash leaves a whole one."""
    sampler = None  # its codes: the rollout's, the next flip rate's reference
    if learner.sampler is not learner.actor:
        sampler = learner.sampler.state_dict() | (learner.rollout_codes or {})
    ckpt = {"step": run.step, "data_pos": run.data_pos, "skipped": run.skipped,
            "first_eval": run.first_eval, "last_eval": run.last_eval, "sampler": sampler,
            "actor": learner.actor.state_dict(), "optimizer": learner.optimizer.state_dict(),
            "rng": (random.getstate(), torch.get_rng_state(), learner.generator.get_state())}
    torch.save(ckpt, run.dir / "ckpt.pt.tmp")
    os.replace(run.dir / "ckpt.pt.tmp", run.dir / "ckpt.pt")


def finish_run(learner, run, args):
    """final/: the fp32 actor (bf16 rounds off RL's small updates), invariant scaling folded
    back; summary.json (a seed replays a run at its torch thread count only)."""
    if run.invariant_scale != 1.0:
        invariant_rescale(learner.actor, 1.0 / run.invariant_scale)
    learner.actor.save_pretrained(run.dir / "final")
    learner.tokenizer.save_pretrained(run.dir / "final")
    summary = {"start_eval_acc": run.first_eval, "final_eval_acc": run.last_eval,
               "wall_s": round(time.time() - run.t_start, 1), "steps": args.steps,
               "skipped_updates": run.skipped, "torch_threads": torch.get_num_threads()}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"done: eval/acc {run.first_eval or 0:.3f} -> {run.last_eval:.3f} in "
          f"{summary['wall_s']:.0f}s; run folder {run.dir}", flush=True)
    return summary


STOP: set = set()  # signals received


@contextlib.contextmanager
def stop_requests():
    """Here Ctrl-C and SIGTERM (a preemption) ask the loop to finish the step, checkpoint and
    exit; a second signal aborts."""
    STOP.clear()
    previous = {sig: signal.signal(sig, _request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield STOP
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _request_stop(signum, frame):
    name = signal.Signals(signum).name
    if STOP:  # a second signal: abort, no checkpoint of this step
        notice(f"{name} again: aborting; the last checkpoint is kept")
        raise SystemExit(128 + signum)
    STOP.add(signum)
    notice(f"{name}: finishing this step, then a checkpoint (again: abort now)")


def lr_at(step, steps, lr, schedule):
    """The learning rate of step 1..steps (cosine: the last updates are small)."""
    if schedule == "constant":
        return lr
    return 0.5 * lr * (1 + math.cos(math.pi * (step - 1) / max(steps, 1)))


def load_checkpoint(path, actor):
    """ckpt.pt as data (weights_only: a foreign pickle runs no code), the actor loaded from it;
    or one line why not."""
    try:
        ckpt = torch.load(path, weights_only=True)
    except Exception as e:  # the zip reader's, the unpickler's
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]:.120}"
        raise QurlError(f"{path} is not a readable checkpoint ({reason})") from None
    try:
        actor.load_state_dict(ckpt["actor"])
    except RuntimeError:
        raise QurlError(f"{path} is not a checkpoint of this --model") from None
    return ckpt


def resume_from(learner, run, ckpt):
    learner.optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["sampler"] is not None:
        learner.sampler.load_state_dict(ckpt["sampler"])
    run.step, run.data_pos, run.skipped = ckpt["step"], ckpt["data_pos"], ckpt["skipped"]
    run.first_eval, run.last_eval = ckpt["first_eval"], ckpt.get("last_eval", ckpt["first_eval"])
    random.setstate(ckpt["rng"][0])
    torch.set_rng_state(ckpt["rng"][1])
    learner.generator.set_state(ckpt["rng"][2])
    log = run.dir / "metrics.jsonl"  # rows logged after the checkpoint would come twice
    lines = log.read_text().splitlines() if log.exists() else []
    log.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= run.step))


def run_dir(args):
    """The run folder, refused if it exists (nothing is replaced)."""
    if args.resume:
        if not (Path(args.resume) / "ckpt.pt").is_file():
            raise QurlError(f"--resume {args.resume}: no checkpoint there")
        return Path(args.resume)
    folder = Path(args.out_dir) / (args.run_name or f"{args.quant}-{args.loss}-s{args.seed}")
    if folder.exists():
        raise QurlError(f"run folder {folder} exists: --resume {folder}, or another --run-name")
    return folder


def load_problems(spec, split="train"):
    """[{"question", "gold"}] from a .jsonl file (an error names its line) or a hub data set."""
    if spec.endswith(".jsonl"):
        if not Path(spec).is_file():
            raise QurlError(f"data file not found: {spec}")
        lines = enumerate(Path(spec).read_text(encoding="utf-8").splitlines(), 1)
        records = [(f"{spec}:{number}", line) for number, line in lines if line.strip()]
    else:
        records = _load_from_hub(spec, split)

    problems = []
    for where, record in records:
        try:
            record = json.loads(record) if isinstance(record, str) else record
        except json.JSONDecodeError as e:
            raise QurlError(f"{where}: malformed JSON line ({e.msg})") from None
        if not isinstance(record, dict) or not {"question", "answer"} <= set(record):
            raise QurlError(f"{where}: not an object with a question and an answer")
        gold = extract_answer(str(record["answer"]))
        if gold is None:
            raise QurlError(f"{where}: the gold answer does not parse: {record['answer']!r:.80}")
        problems.append({"question": str(record["question"]), "gold": gold})

    if not problems:
        raise QurlError(f"{spec}: no problems found (empty data set)")
    return problems


def _load_from_hub(name, split):
    """A hub data set's records (gsm8k: config main)."""
    if Path(name).exists() or name.startswith((".", "/")) or name.count("/") != 1:
        raise QurlError(f"data '{name}' is neither a .jsonl file nor a hub name")
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        config = "main" if name.endswith("gsm8k") else None
        table = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise QurlError(f"cannot load hub data set '{name}' ({type(e).__name__}: "
                        f"{str(e).splitlines()[0]:.150}); a local .jsonl works offline") from None
    return [(f"{name}[{split}] row {i + 1}", record) for i, record in enumerate(table)]


def resolve_device_dtype(dtype="auto"):
    """CUDA if torch sees it (CUDA_VISIBLE_DEVICES= for the CPU); auto: bf16 on CUDA."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bfloat16" if bf16 else "float32"
    return device, getattr(torch, dtype)


def load_model(name="data/tiny-qwen", device="cpu", dtype=torch.float32):
    """(model, tokenizer), with left padding and a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    except (OSError, ValueError) as e:  # 4.x: HFValidationError
        raise QurlError(f"cannot load model '{name}' as a folder here or a hub name (offline? "
                        f"data/tiny-qwen is local): {str(e).splitlines()[0]:.200}")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def prepare_actor(actor, grad_checkpointing=False):
    """No dropout: pi_prox and pi_theta would be noisy estimates of one policy."""
    for module in actor.modules():  # nn.Dropout's p, transformers' attention's float
        for name in ("p", "attention_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    if grad_checkpointing:  # transformers 5.24's name (the old one warns), or 4.x's
        enable = getattr(actor, "activation_checkpointing_enable", None)
        (enable or actor.gradient_checkpointing_enable)({"use_reentrant": False})


def check_prompt_lengths(model, tokenizer, problems, max_new_tokens):
    """The widest prompt in tokens; refuses one beyond the context."""
    prompts = [format_prompt(p["question"], tokenizer) for p in problems]
    widest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    limit = getattr(model.config, "max_position_embeddings", math.inf)
    if widest + max_new_tokens > limit:
        raise QurlError(f"a prompt of {widest} tokens + --max-new-tokens {max_new_tokens} exceed "
                        f"the model's context of {limit}")
    return widest


def _parser():
    """argparse from Args: the typed flags alone (Args holds the defaults)."""
    parser = argparse.ArgumentParser(prog="qurl.py", description=__doc__.split("\n")[0],
                                     argument_default=argparse.SUPPRESS)
    parser.error = lambda msg: _die(f"{msg} (see python qurl.py --help)")  # one line, no usage
    for f in fields(Args):
        name, kind = "--" + f.name.replace("_", "-"), str(f.type)
        meta = f.metadata | {"help": f"{f.metadata['help']} (default: {f.default})"}
        extras = {"type": {"int": int, "str": str, "str | None": str}.get(kind, float)}
        if kind == "bool":
            extras = {"action": argparse.BooleanOptionalAction}
        parser.add_argument(name, **extras, **meta)
    return parser


def parse_args(argv=None):
    """The flags, checked; --resume DIR starts from the run's args.json, typed flags win."""
    typed = vars(_parser().parse_args(argv))
    args = Args(**typed)
    if args.resume:
        saved = Path(args.resume) / "args.json"
        if not saved.is_file():
            _die(f"--resume {args.resume}: not a run folder (no args.json)")
        names = {f.name for f in fields(Args)}
        saved_args = {k: v for k, v in json.loads(saved.read_text()).items() if k in names}
        args = Args(**saved_args | typed)
    complaint = validate_args(args)
    if complaint:
        _die(complaint)
    for line in flag_notices(args, set(typed)):
        notice(line)
    return args


def validate_args(args):
    """One line on the first value that would crash or mislead, or None."""
    for name in ("prompts_per_step", "max_new_tokens", "ppo_epochs", "mini_batches", "micro_batch",
                 "eval_every", "lr", "temperature"):
        if getattr(args, name) <= 0:
            greedy = " (0 is greedy: no distribution to train)" * (name == "temperature")
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}{greedy}"
    checks = [
        (args.group_size >= 2, "--group-size must be >= 2 (GRPO compares a group's samples)"),
        (args.is_cap >= 1, "--is-cap must be >= 1 (it truncates pi_prox / pi_behav)"),
        (min(args.tbpo_band) >= 0, "--tbpo-band widths must be >= 0"),
        (args.invariant_scale is None or args.invariant_scale > 0,
         "--invariant-scale must be > 0 (1 turns it off)"),
        (args.quant != "none" or not args.align_forward,
         "--align-forward needs a sampler apart from the actor (--quant other than none)"),
    ]
    return next((complaint for ok, complaint in checks if not ok), None)


def flag_notices(args, typed):
    """A line for each typed flag that does nothing with the chosen loss."""
    unused = {"naive": {"tbpo_band", "is_cap"}, "tis": {"tbpo_band"}, "acr": {"tbpo_band"},
              "tbpo": {"eps_low", "eps_high"}}[args.loss]
    return [f"--{name.replace('_', '-')} does nothing with --loss {args.loss}"
            for name in sorted(unused & typed)]


def _die(msg):
    notice(f"error: {msg}")
    sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    except QurlError as e:
        _die(str(e))


# ==================== APPENDIX B: a compiled decode (--compile), for speed alone
DECODERS = weakref.WeakKeyDictionary()  # sampler -> {(B, P, R, T): StaticDecoder, or None: eager}
FUSED = weakref.WeakKeyDictionary()  # decoder layer -> (qkv_proj, gate_up_proj): a copy fuses anew


@torch.no_grad()
def compiled_sample(model, tokenizer, prompts, n=1, max_new_tokens=64, temperature=1.0,
                    generator=None) -> Rollout:
    """`sample` by compiled layers (~10 kernels a layer, not ~50; a CUDA graph a token on a GPU):
    its tokens, log-probs up to float sums."""
    prompts = encode(tokenizer, prompts, model.device, 64)  # few shapes
    return compiled_decode(model, tokenizer, *prompts, n, max_new_tokens, temperature, generator)


@torch.no_grad()
def compiled_decode(model, tokenizer, input_ids, prompt_mask, n, max_new_tokens, temperature,
                    generator=None, forced=None) -> Rollout:
    """`decode` by a `StaticDecoder`, fed too (its graphs); else `decode`, said once."""
    decoders = DECODERS.setdefault(model, {})
    key = (len(input_ids) * n, input_ids.shape[1], max_new_tokens, temperature)
    try:
        if None not in decoders.values():
            if key not in decoders:
                decoders[key] = StaticDecoder(model, tokenizer, *key)
            with torch._dynamo.config.patch(recompile_limit=64):  # 2 graphs a decoder
                outputs = decoders[key].generate(model, input_ids, prompt_mask, n, generator,
                                                 forced)
            return _finish(tokenizer, input_ids, prompt_mask, n, *outputs)
    except Exception as e:
        decoders[key] = None
        reason = " ".join(str(e).split())
        warnings.warn(f"--compile: decoding eagerly ({type(e).__name__}: {reason:.100})")
    return decode(model, tokenizer, input_ids, prompt_mask, n, max_new_tokens, temperature,
                  generator, forced)


@torch.no_grad()
def fuse(linears):
    """One linear for several on one input (vLLM's QKVParallelLinear): one GEMM, one activation
    quantization. Per-row codes and scales stack; the parts become views of its rows (a sync
    refreshes both)."""
    fused = copy.deepcopy(linears[0])  # NF4's state holds its absmax: it follows
    for name, whole in [*fused.named_parameters(), *fused.named_buffers()]:
        parts = [getattr(linear, name) for linear in linears]
        sizes = [len(part) for part in parts]
        whole.data = whole.new_empty((sum(sizes), *whole.shape[1:]))
        for part, view in zip(parts, whole.data.split(sizes)):
            part.data = view.copy_(part)  # (cat refuses FP8 under autocast)
    fused.out_features = sum(linear.out_features for linear in linears)
    if getattr(fused, "nf4_state", None):
        assert fused.in_features % NF4_BLOCK == 0, "NF4 blocks would span rows"
        fused.nf4_state.shape = torch.Size((fused.out_features, fused.in_features))
    return fused


class StaticDecoder:
    """B rows in a static KV cache of L = P + R columns, one compiled graph for every layer;
    buffers at fixed addresses."""

    def __init__(self, model, tokenizer, n_rows, prompt_len, max_new_tokens, temperature):
        device = model.device
        for layer in model.model.layers:  # fused once
            attention, mlp = layer.self_attn, layer.mlp
            if layer not in FUSED:
                FUSED[layer] = (fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
                                fuse([mlp.gate_proj, mlp.up_proj]))
        attention = model.model.layers[0].self_attn  # every layer's shapes
        self.prompt_len, self.temperature = prompt_len, temperature
        self.pad = tokenizer.pad_token_id  # (a tokenizer's property breaks graphs)
        self.stop_ids = torch.tensor(stop_token_ids(model, tokenizer), device=device)

        weight = model.model.embed_tokens.weight
        dtype = weight.dtype  # K, V in the dtype attention reads
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        L, D = prompt_len + max_new_tokens, attention.head_dim
        shape = (len(model.model.layers), n_rows, attention.k_proj.out_features // D, L, D)
        self.k_cache, self.v_cache = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        angles = model.model.rotary_emb(weight, torch.arange(L, device=device)[None])  # eager
        self.rope = [table[0] for table in angles]  # (L, D) cos, sin (compiled ones round apart)
        self.valid = torch.ones(n_rows, L, dtype=torch.bool, device=device)  # not left padding
        self.noise = torch.ones(n_rows, len(weight), device=device)  # (B, V): E in `_pick`
        self.replay = None  # `graphed` at first use

        compiled = functools.partial(torch.compile, dynamic=False, fullgraph=True,  # or an error
                                     options={"emulate_precision_casts": True})  # eager rounding
        self.layer, self.embed, self.draw = map(compiled, (decoder_layer, self.embed, self.draw))

    def generate(self, model, input_ids, prompt_mask, n, generator, forced=None):
        """`decode`'s (B, R) tokens, log-probs, (B,) first EOS of (b, P) prompts, n each."""
        B, R = len(self.valid), self.valid.shape[1] - self.prompt_len
        tokens, logp, fed, end, done = _buffers(B, R, self.pad, forced, input_ids.device)
        self.valid[:, :self.prompt_len] = prompt_mask.repeat_interleave(n, 0).bool()
        column = torch.full((1,), self.prompt_len, device=input_ids.device)  # next token's

        for t in range(tokens.shape[1]):
            if t % SYNC_EVERY == 0 and bool(done.all()):
                return tokens[:, :t], logp[:, :t], end
            if self.temperature and forced is None:
                self.noise.exponential_(generator=generator)
            if t == 0:
                token, logp[:, t], end, done = self.prefill(model, input_ids, n, fed[:, t], end,
                                                            done)
            else:
                inputs = (token, column, fed[:, t], end, done)
                self.replay = self.replay or graphed(self.decode_one_token, model, *inputs)
                token, logp[:, t], end, done = self.replay(model, *inputs)
                column = column + 1
            tokens[:, t] = token
        return tokens, logp, end

    def prefill(self, model, input_ids, n, fed, end, done):
        """The prompts' K, V into the first of their n rows, copied; the first tokens drawn."""
        columns = torch.arange(self.prompt_len, device=input_ids.device)  # (P,)
        x = self.forward(model, input_ids, columns, slice(None, None, n))
        for kv in (self.k_cache, self.v_cache):
            groups = kv[..., :self.prompt_len, :].unflatten(1, (-1, n))  # (N_layers, b, n, ..)
            groups[:, :, 1:] = groups[:, :, :1]
        return self.draw(model, x.repeat_interleave(n, 0), columns[-1:], fed, end, done)

    def decode_one_token(self, model, token, column, fed, end, done):
        """(B,) tokens at cache `column` (1,) to the next ones (`draw`)."""
        x = self.forward(model, token[:, None], column)
        return self.draw(model, x, column, fed, end, done)

    def forward(self, model, ids, columns, rows=slice(None)):
        """(b, S) tokens at cache `columns` through the layers, K, V into the cache's `rows`: the
        last position's output."""
        x, cos, sin, visible = self.embed(model, ids, columns, rows)
        for i, layer in enumerate(model.model.layers):
            x = self.layer(layer, *FUSED[layer], x, cos, sin, self.k_cache[i, rows],
                           self.v_cache[i, rows], columns, visible)
        return x[:, -1]

    def embed(self, model, ids, columns, rows):
        """(b, S, hidden) embeddings, (b, S, D) RoPE angles, (b, 1, S, L) visible cache columns."""
        keys = torch.arange(self.valid.shape[1], device=ids.device)  # (L,)
        earlier = self.valid[rows, None] & (keys < columns[:, None])  # (b, S, L) real tokens
        visible = earlier | (keys == columns[:, None])  # and itself (a pad: itself only)
        cos, sin = (table[earlier.sum(-1)] for table in self.rope)  # position: tokens before
        return model.model.embed_tokens(ids), cos, sin, visible[:, None]

    def draw(self, model, x, column, fed, end, done):
        """The last layer's (B, hidden) output to the next tokens (`_advance`)."""
        logits = model.lm_head(model.model.norm(x))  # (B, V)
        t = column + 1 - self.prompt_len  # the index of the token drawn
        return _advance(logits, self.temperature, self.noise, fed, done, end, t, self.stop_ids,
                        self.pad)


def graphed(fn, model, *inputs):
    """fn as a CUDA graph on a GPU: a call copies its arguments into `inputs`, replays and returns
    the outputs (the next call overwrites them). Two idempotent calls on `inputs` (on a CPU too)
    compile it first."""
    stream = torch.cuda.Stream() if inputs[0].is_cuda else None
    if stream:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # None: a no-op
        fn(model, *inputs)
        fn(model, *inputs)
    if not stream:
        return fn
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(model, *inputs)

    def replay(model, *args):
        for static, value in zip(inputs, args):
            static.copy_(value)  # (a no-op on itself)
        graph.replay()
        return outputs
    return replay


def _rope(x, cos, sin):
    """Rotary position embedding of (B, H, S, D) heads (HF's convention)."""
    mid = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., mid:], x[..., :mid]), -1) * sin[:, None]


def decoder_layer(layer, qkv_proj, gate_up_proj, x, cos, sin, k_cache, v_cache, columns, visible):
    """A Llama/Qwen layer over (B, S, hidden) tokens, K, V written at `columns` of its (B, H_kv,
    L, D) cache; a K/V head's queries share one attention (repeat_kv would copy the cache)."""
    attention, (B, S, _), (H_kv, D) = layer.self_attn, x.shape, k_cache.shape[1::2]
    qkv = qkv_proj(layer.input_layernorm(x)).view(B, S, -1, D).transpose(1, 2)
    q, k, v = qkv.split([qkv.shape[1] - 2 * H_kv, H_kv, H_kv], 1)  # (B, H or H_kv, S, D)
    if hasattr(attention, "q_norm"):  # Qwen3
        q, k = attention.q_norm(q), attention.k_norm(k)
    k_cache.index_copy_(2, columns, _rope(k, cos, sin).to(k_cache.dtype))  # (B, H_kv, L, D)
    v_cache.index_copy_(2, columns, v.to(v_cache.dtype))

    q_per_kv = q.shape[1] // H_kv  # (B, H, S, D) -> (B, H_kv, q_per_kv S, D)
    q = _rope(q, cos, sin).reshape(B, H_kv, q_per_kv * S, D)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, visible.repeat(1, 1, q_per_kv, 1),
                                         scale=attention.scaling)
    x = x + attention.o_proj(out.view(B, -1, S, D).transpose(1, 2).reshape(B, S, -1))
    gate, up = gate_up_proj(layer.post_attention_layernorm(x)).chunk(2, -1)  # (B, S, I) each
    return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


if __name__ == "__main__":
    main()
