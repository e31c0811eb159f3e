"""qurl: quantized-rollout reinforcement learning for LLM reasoning, in one file.

RL for reasoning spends most of its time generating rollouts. QuRL generates them with a *quantized* copy of the
actor (W8A8: INT8 through bitsandbytes, or FP8 e4m3 through torch; QaRL also W4A16 NF4) and trains the
*full-precision* actor. The data are then slightly off-policy, so the loss has to know about three policies:

    logp_behav  pi_behav  the quantized old actor that sampled the tokens        (recorded by `sample`)
    logp_prox   pi_prox   the full-precision old actor, before this step's update  (`token_logprobs`, no grad)
    logp        pi_theta  the actor being trained                                (`token_logprobs`, with grad)

Decoupled PPO clips the ratio pi_theta/pi_prox and corrects pi_prox/pi_behav with a truncated importance weight
(TIS). QuRL's Adaptive Clipping Range (ACR) widens the upper clip bound exactly where truncation shrank the trust
region, and its invariant scaling makes small RL updates survive re-quantization. QaRL trains through the same
quantizer the sampler uses (`--align-forward`) and replaces the token loss by a sequence-level trust band (TBPO).

Where each piece lives (the method first, then Appendix A plumbing and Appendix B tools):
    GRPO advantage                                                          group_advantages
    naive ratio pi_theta/pi_behav                                           token_loss(loss="naive")
    decoupled PPO + TIS, w = min(pi_prox/pi_behav, C) (QuRL Eq. 5)          token_loss(loss="tis")
    ACR, upper bound (1+eps_high)/min(1, C pi_behav/pi_prox) (QuRL Eq. 9)   token_loss(loss="acr")
    TBPO's sequence ratio, weight and trust band (QaRL)                     tbpo_loss
    k3 KL (mismatch metric, optional KL penalty)                            k3, mismatch_metrics, kl_penalty
    W8A8 FP8 / INT8 and W4A16 NF4 codes                                     quantize, dequantize
    the sampler's quantized linear                                          w8a8_matmul, QuantLinear
    weight sync and flip rate (QuRL's weight-update problem)                sync_weights
    invariant scaling W x = (W/s)(s x) (QuRL Eq. 11-12)                     invariant_scale
    rollout-aligned forward (QaRL)                                          aligned_linear, rollout_aligned
    one RL step; gradient accumulation                                      train_step, update

Where qurl departs from the papers, and why:
    1. TBPO: the paper does not print every detail. qurl's reading: a geometric-mean sequence ratio, a sequence-level
       mismatch weight capped at --is-cap, and out-of-band sequences dropped from the loss and its denominator.
    2. One update per rollout is the default (the tiny model learns best so); there R = 1, so the PPO clip, ACR and
       TBPO's band never bind. Use --mini-batches > 1 for the papers' regime.
    3. The rollout actor keeps its non-quantized parts as an fp32 copy run under the learner's autocast, so that the
       aligned forward reproduces it bit for bit; an inference engine would hold them in bf16.
    4. Groups whose rewards are all equal are left out of the update, and the learning rate decays (cosine).
    5. Evaluation is greedy, of the full-precision actor (the model that is trained and saved).

Run (CPU, the embedded tiny model; the README gives the timings and what to expect):
    python qurl.py --quant fp8
    python qurl.py --quant fp8 --dry-run          # config, data, one prompt, estimated memory; then exit
Run (one GPU, a real Qwen on GSM8K; `bash .ci/gpu` is the prepared GPU check):
    python qurl.py --model Qwen/Qwen2.5-0.5B-Instruct --train-data openai/gsm8k --test-data openai/gsm8k \\
        --quant fp8 --max-new-tokens 512 --prompts-per-step 32 --group-size 8 --lr 1e-6 --steps 200
Tests: python -m pytest -q
"""
from __future__ import annotations

import argparse, contextlib, copy, dataclasses, inspect, json, logging, math, os, random, re, shutil, signal, sys
import time, warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its import-time note on an optional CPU 4-bit package

class QurlError(Exception):
    """A problem with the user's input: main() prints it as one line and exits 2, without a traceback."""

def notice(msg: str) -> None:
    print(f"qurl: {msg}", file=sys.stderr, flush=True)

def arg(default, help: str, **kw):
    """A flag: its default, its one-line --help, and argparse extras (choices, nargs; group starts a --help section)."""
    return field(default=default, metadata={"help": help, **kw})

@dataclass
class Args:
    model: str = arg("data/tiny-qwen", "model folder or hub name (Qwen/Qwen2.5-0.5B-Instruct)", group="model and data")
    train_data: str = arg("data/arith_train.jsonl", "problems: .jsonl/.json/.parquet or hub NAME[:CONFIG][@SPLIT]")
    test_data: str = arg("data/arith_test.jsonl", "held-out problems, the same way (hub split: test by default)")
    fields: str = arg("question,answer", "the fields holding a problem and its gold answer ('#### 42', '\\boxed{42}')")
    quant: str = arg("fp8", "rollout actor precision: W8A8 int8/fp8, W4A16 nf4", choices=["none", "int8", "fp8", "nf4"],
                     group="quantized rollout")
    invariant_scale: float | None = arg(None, "QuRL invariant scaling s (default 1.5 with a quantized actor, else 1)")
    align_forward: bool = arg(False, "QaRL: train through the sampler's quantizer (fake-quant, straight-through)")
    loss: str = arg("acr", "policy objective", choices=["naive", "tis", "acr", "tbpo"], group="objective")
    eps_low: float = arg(0.2, "PPO lower clip: ratio >= 1 - eps_low")
    eps_high: float = arg(0.28, "PPO upper clip: ratio <= 1 + eps_high (DAPO clip-higher)")
    is_cap: float = arg(2.0, "truncation C of pi_prox/pi_behav (token losses) or of the sequence weight w_i (tbpo)")
    tbpo_band: tuple[float, float, float] = arg((3e-4, 4e-4, 7e-4), "TBPO keeps s_i >= 1 - LO and s_i <= 1 + HI+ "
                                                "(A >= 0) or 1 + HI- (A < 0)", nargs=3, metavar=("LO", "HI+", "HI-"))
    kl_coef: float = arg(0.0, "weight of the k3 KL penalty to the initial actor (0: off, no reference model)")
    steps: int = arg(900, "RL steps (one rollout batch and its updates per step)", group="the RL loop")
    prompts_per_step: int = arg(16, "distinct problems per step")
    group_size: int = arg(8, "samples per problem (GRPO group)")
    max_new_tokens: int = arg(32, "response length limit")
    temperature: float = arg(1.0, "sampling temperature; log-probs on both sides use logits / T")
    lr: float = arg(1e-4, "AdamW learning rate", group="optimisation")
    lr_schedule: str = arg("cosine", "constant, or cosine decay to 0 at --steps", choices=["constant", "cosine"])
    ppo_epochs: int = arg(1, "passes over each rollout batch")
    mini_batches: int = arg(1, "optimizer steps per pass (the batch is split into this many mini-batches)")
    micro_batch: int = arg(64, "rows per forward and backward (gradient accumulation)", group="memory (not the math)")
    grad_checkpointing: bool = arg(False, "recompute activations in backward: less memory, about 1/3 more compute")
    eval_every: int = arg(100, "evaluate the fp actor (greedy) every N steps, and at the end", group="evaluation")
    eval_size: int = arg(500, "held-out problems per evaluation (0: all)")
    eval_k: int = arg(0, "also log eval/pass@k from k samples per problem at T = 1 (0: off; costs ~k evaluations)")
    seed: int = arg(1, "seeds python, torch, the data order and the sampler", group="the run")
    dtype: str = arg("auto", "compute dtype of the forwards: auto (bf16 on CUDA, else fp32), float32 or bfloat16")
    out_dir: str = arg("runs", "where runs/<run-name>/ is written")
    run_name: str | None = arg(None, "run folder name (default: <quant>-<loss>-s<seed>, numbered if it exists)")
    resume: str | None = arg(None, "continue the run in this folder from its checkpoint")
    overwrite: bool = arg(False, "replace an existing run folder (only one qurl created)")
    track: str | None = arg(None, "also log the metrics to wandb or tensorboard", choices=["wandb", "tensorboard"])
    dry_run: bool = arg(False, "print config, data, a prompt and estimated memory", group="tools instead of training")
    plot: list[str] | None = arg(None, "draw these run folders' metrics into --out and exit", nargs="+")
    out: str = arg("assets/runs.png", "output file of --plot")


# ============================================ THE METHOD, 1: data format and reward (what the verifier checks) ========
SYSTEM_PROMPT = "Solve the problem step by step. Put the final answer, a number only, after '####' on the last line."

def format_prompt(question: str, tokenizer) -> str:
    """The chat template when the tokenizer has one (instruct models), else the plain format of the tiny model."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return f"Q: {question}\nA: "

def extract_answer(text: str) -> str | None:
    """The final answer: '#### 42', then '\\boxed{42}', then 'the answer is 42', else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().split("\n")[0]
        return _normalize(tail) if tail else None
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return _normalize(boxed)
    said = re.search(r"answer is[:\s]*\$?\s*(-?[\d,]*\.?\d+(?:\s*/\s*\d+)?)", text, flags=re.IGNORECASE)
    last = said.group(1) if said else _last_number(text)
    return _normalize(last) if last is not None else None

def reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer equals the gold answer (numerically, 3.50 == 3.5), else 0.0."""
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    gold = _normalize(gold)
    pred_num, gold_num = _as_number(pred), _as_number(gold)
    return float(pred_num == gold_num) if pred_num is not None and gold_num is not None else float(pred == gold)


# ============================================ THE METHOD, 2: quantization: W8A8 FP8/INT8, W4A16 NF4, sync, scaling ====
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_X_MAX = 2.0 ** 14  # bitsandbytes takes fp16 activations (max 65504): larger rows are scaled down first, exactly
NF4_BLOCK = 64  # weights per absmax block (QLoRA's NF4 and QaRL's W4A16)

def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 e4m3: x ~= x8 * scale[:, None], scale = amax|x_row| / 448 (QuRL Sec. 3, W8A8 FP8). The same
    quantizer serves weights (a row = an output channel) and activations (a row = a token)."""
    xf = x.detach().float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    x8 = (xf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # clamp: the cast may not saturate
    return x8, scale

def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8 vector-wise INT8 (bitsandbytes, threshold 0): x ~= x8 * absmax[:, None] / 127. Returns (x8, absmax):
    bnb keeps the row absmax, not the step, because int8_mm_dequant multiplies by absmax_x*absmax_w/127^2."""
    import bitsandbytes.functional as bnbF
    x8, absmax, _ = bnbF.int8_vectorwise_quant(x.detach().to(torch.float16).contiguous(), threshold=0.0)
    return x8, absmax

def int8_shift(x2: torch.Tensor) -> torch.Tensor:
    """(M, 1) powers of 2 that bring each row's absmax under INT8_X_MAX: bitsandbytes takes fp16 (max 65504), and
    real checkpoints carry activations of 1e4-1e5. Dividing by a power of 2 and multiplying back is exact."""
    amax = x2.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.exp2(torch.ceil(torch.log2((amax / INT8_X_MAX).clamp(min=1.0))))

def quantize_nf4(weight: torch.Tensor):
    """Weight-only NF4 (bitsandbytes, QLoRA's 4-bit NormalFloat): blocks of 64 weights scaled by their absmax, each
    weight the nearest of 16 normal-quantile levels. Returns (packed codes, two per byte, and bnb's QuantState)."""
    import bitsandbytes.functional as bnbF
    return bnbF.quantize_4bit(weight.detach().float().contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")

def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Weights in the sampler's format: (codes, fp32 scales: per row for fp8/int8, per block for nf4, nf4 state)."""
    if fmt == "nf4":
        q, state = quantize_nf4(weight)
        return q, state.absmax.float(), state
    q, scale = quantize_fp8(weight) if fmt == "fp8" else quantize_int8(weight)
    return q, scale.float(), None

def dequantize(q: torch.Tensor, scale: torch.Tensor, state, fmt: str) -> torch.Tensor:
    """fp32 values of `quantize`'s codes: code * scale (int8: * absmax / 127), or bitsandbytes' NF4 dequantize."""
    if fmt == "nf4":
        import bitsandbytes.functional as bnbF
        return bnbF.dequantize_4bit(q, state)
    return q.float() * (scale[:, None] if fmt == "fp8" else scale[:, None] / 127.0)

def w8a8_matmul(x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, fmt: str, kernel: str,
                w_deq: torch.Tensor | None = None) -> torch.Tensor:
    """y = Q(x2) @ Q(W)^T for (M, K) activations, quantized per token here, and (N, K) weight codes with per-row
    scales: the sampler's kernel, in fp32 (rounded to fp16 for INT8, bf16 for CUDA FP8, as those kernels return it).
    FP8: kernel 'scaled_mm' (torch._scaled_mm) or 'emulate', the same math, on w_deq when given (CPU: faster)."""
    dev_type = x2.device.type   # the kernel fixes its own numerics: no autocast inside
    with torch.autocast(dev_type, enabled=False) if torch.is_autocast_enabled(dev_type) else contextlib.nullcontext():
        if fmt == "int8":
            import bitsandbytes.functional as bnbF
            shift = int8_shift(x2)
            if not x2.is_cuda and bool((shift > 1).any()):  # (a host sync: on CUDA it would stall every decode step)
                warnings.warn("INT8: activations exceed fp16's range for bitsandbytes (65504); those tokens are "
                              "scaled by a power of 2 and back, exactly")  # one text: warned once, not per value
            x8, s_x = quantize_int8(x2 / shift)
            acc = bnbF.int8_linear_matmul(x8, w_q)                             # int32 = x8 @ w8^T
            return bnbF.int8_mm_dequant(acc, s_x, w_scale).float() * shift     # * absmax_x*absmax_w/127^2
        x8, s_x = quantize_fp8(x2)
        s_x = s_x[:, None]
        if kernel == "scaled_mm":
            return torch._scaled_mm(x8, w_q.t(), scale_a=s_x, scale_b=w_scale[None, :], out_dtype=torch.bfloat16
                                    if x2.is_cuda else torch.float32).float()
        if w_deq is not None:           # scales applied before the sum
            return F.linear(x8.float() * s_x, w_deq)
        dt = torch.bfloat16 if x2.is_cuda else torch.float32   # bf16 holds every e4m3 code exactly
        return (x8.to(dt) @ w_q.to(dt).t()).float() * s_x * w_scale

class QuantLinear(nn.Module):
    """Drop-in for nn.Linear in the rollout actor, bias in full precision. 'fp8' (e4m3) and 'int8' (bitsandbytes
    LLM.int8, threshold 0) are W8A8: 8-bit weight codes with per-output-channel scales, activations quantized per
    token on the fly. 'nf4' is W4A16 (QaRL's class): NF4 weight codes in blocks of 64, activations left as they are."""

    def __init__(self, linear: nn.Linear, fmt: str, fp8_kernel: str = "auto"):
        super().__init__()
        assert fmt in ("fp8", "int8", "nf4"), fmt
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight_q", torch.empty(0, dtype=torch.uint8, device=weight.device))
        self.register_buffer("weight_scale", torch.empty(0, dtype=torch.float32, device=weight.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        # FP8: torch._scaled_mm where it runs (CUDA >= 8.9, or CPU on request; dims multiples of 16), else the same math
        wanted = fp8_kernel == "scaled_mm" or (fp8_kernel == "auto" and weight.device.type == "cuda")
        runs = hasattr(torch, "_scaled_mm") and not (weight.shape[0] % 16 or weight.shape[1] % 16) and (
            weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) >= (8, 9))
        self.kernel = {"int8": "bnb", "nf4": "bnb-nf4"}.get(fmt) or ("scaled_mm" if wanted and runs else "emulate")
        if fmt == "fp8" and wanted and not runs:
            warnings.warn("FP8: torch._scaled_mm is unavailable here (it needs CPU or CUDA compute capability >= 8.9, "
                          "and dims that are multiples of 16); using dequantize-and-matmul, same numerics (slower)")
        self.nf4_state = None
        # CPU keeps the dequantized weights (4 bytes per weight): dequantizing per call would cost more than the matmul
        self.register_buffer("weight_deq", None, persistent=False)
        self.load_weight(weight)

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
        """Re-quantize from full-precision weights; returns how many weight codes (8- or 4-bit) changed."""
        q, scale, self.nf4_state = quantize(weight, self.fmt)
        old, new = self.weight_q.view(torch.uint8).flatten(), q.view(torch.uint8).flatten()
        if old.shape != new.shape:
            changed = weight.numel()
        elif self.fmt == "nf4":  # two 4-bit codes per byte: a moved block absmax changes values, not codes
            diff = old ^ new
            changed = int(((diff & 0x0F) != 0).sum() + ((diff & 0xF0) != 0).sum())
        else:
            changed = int((old != new).sum())
        self.weight_q, self.weight_scale = q, scale
        if q.device.type == "cpu" and self.kernel in ("emulate", "bnb-nf4"):  # exact codes times their scales, fp32
            self.weight_deq = dequantize(q, scale, self.nf4_state, self.fmt)
        if bias is not None:
            self.bias.copy_(bias)
        return changed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev_type = x.device.type  # a linear returns the autocast dtype inside torch.autocast, else the input's
        out_dtype = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else x.dtype
        if self.fmt == "nf4":  # W4A16: the weights are dequantized into the compute dtype and meet x there
            weight = self.weight_deq
            if weight is None:  # CUDA: bitsandbytes dequantizes the 4-bit codes straight into it at every call
                self.nf4_state.dtype = out_dtype
                weight = dequantize(self.weight_q, self.weight_scale, self.nf4_state, "nf4")
            bias = None if self.bias is None else self.bias.to(out_dtype)
            return F.linear(x.to(out_dtype), weight.to(out_dtype), bias)
        x2 = x.reshape(-1, self.in_features)
        try:
            y = w8a8_matmul(x2, self.weight_q, self.weight_scale, self.fmt, self.kernel, self.weight_deq)
        except (RuntimeError, ValueError) as e:  # a build or device that refuses row-wise scales: switch, once
            if self.kernel != "scaled_mm" or isinstance(e, torch.OutOfMemoryError):
                raise
            warnings.warn(f"FP8: torch._scaled_mm refused a call ({str(e)[:80]}); this layer uses "
                          f"dequantize-and-matmul from now on, same numerics")
            self.kernel = "emulate"
            y = w8a8_matmul(x2, self.weight_q, self.weight_scale, self.fmt, self.kernel, self.weight_deq)
        y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.fmt}, kernel={self.kernel}"

def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linears QuRL quantizes: those inside decoder layers. Embeddings, norms and lm_head stay full precision."""
    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, (nn.Linear, QuantLinear)) and ".layers." in f".{name}"]

def quantize_actor(model: nn.Module, fmt: str) -> nn.Module:
    """A frozen copy of the model whose decoder-layer linears are QuantLinear (W8A8: 1 byte per weight, W4A16: 1/2)."""
    if fmt in ("int8", "nf4"):
        _require_bnb(fmt)
    # deepcopy's memo puts each decoder linear's QuantLinear in its place: their full-precision weights are never
    # copied, so building the actor never holds two full copies of the model (a 7B model has 28 GB of fp32 masters)
    memo = {id(lin): QuantLinear(lin, fmt) for _, lin in decoder_linears(model)}
    return copy.deepcopy(model, memo).eval().requires_grad_(False)

@torch.no_grad()
def sync_weights(q_model: nn.Module, model: nn.Module) -> float:
    """Quantized actor <- fp actor: re-quantize every QuantLinear, copy everything else. Returns the flip rate, the
    fraction of weight codes that changed (QuRL's weight-update problem: tiny updates often flip none)."""
    if q_model is model:  # fp32 with --quant none: the sampler is the actor itself
        return 0.0
    fp = dict(model.named_modules())
    changed = total = 0
    for name, qm in q_model.named_modules():
        if isinstance(qm, QuantLinear):
            changed += qm.load_weight(fp[name].weight, fp[name].bias)
            total += qm.weight_q.numel()
    fp_params = dict(model.named_parameters())
    for name, param in q_model.named_parameters():
        param.copy_(fp_params[name])
    return changed / max(total, 1)

_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm")

@torch.no_grad()
def invariant_scale(model: nn.Module, s: float) -> None:
    """QuRL's update-aware rescale (Eq. 11-12), once before RL: W x = (W / s)(s x). q/k/v and gate/up weights are
    divided by s, the RMSNorm weights feeding them multiplied by s. The fp function is unchanged; the quantization
    step shrinks by s while an Adam update keeps its size, so s times more updates survive re-quantization."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise QurlError(f"invariant_scale: {type(model).__name__} has no model.layers (Qwen2, Qwen3, Llama do); use "
                        f"--invariant-scale 1")
    groups = [(layer, norm, block, projs) for layer in layers for norm, block, projs in
              [("input_layernorm", getattr(layer, "self_attn", None), ("q_proj", "k_proj", "v_proj")),
               ("post_attention_layernorm", getattr(layer, "mlp", None), ("gate_proj", "up_proj"))]]
    for layer, norm, block, projs in groups:  # check every layer before changing any
        if (type(getattr(layer, norm, None)).__name__ not in _NORMS or block is None
                or not all(isinstance(getattr(block, proj, None), nn.Linear) for proj in projs)):
            raise QurlError(f"invariant_scale: layer {type(layer).__name__} is not a recognised pre-norm (RMSNorm -> "
                            f"{'/'.join(projs)}) layer; supported: Qwen2, Qwen3, Llama. Use --invariant-scale 1")
    for layer, norm, block, projs in groups:
        getattr(layer, norm).weight.mul_(s)   # s x   (RMSNorm output is linear in its weight)
        for proj in projs:
            getattr(block, proj).weight.div_(s)  # W / s (bias unchanged: (W/s)(s x) + b = W x + b)

def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize in the sampler's format, straight-through: the value quantized, the gradient the identity."""
    rows = x if fmt == "nf4" else x.reshape(-1, x.shape[-1])
    shift = int8_shift(rows) if fmt == "int8" else 1.0   # the sampler's overflow handling (w8a8_matmul), exactly
    deq = dequantize(*quantize(rows / shift, fmt), fmt) * shift
    return x + (deq.reshape(x.shape).to(x.dtype) - x).detach()

def aligned_linear(lin: nn.Linear, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """QaRL's rollout-aligned linear: the value is the sampler's own layer (QuantLinear) on the codes of the current
    weights, so pi_prox equals pi_behav in any dtype; the gradient is the straight-through fake-quant path's."""
    with torch.no_grad():
        value = QuantLinear(lin, fmt)(x)
    x_q = x if fmt == "nf4" else fake_quant(x, fmt)              # W4A16 leaves activations alone
    ste = F.linear(x_q, fake_quant(lin.weight, fmt), lin.bias)   # carries the gradient only
    return value + (ste - ste.detach())                          # exactly the value, the gradient of ste

@contextlib.contextmanager
def rollout_aligned(model: nn.Module | None, fmt: str | None):
    """In this block the decoder linears compute in the sampler's numerics (`aligned_linear`); None: a no-op."""
    lins = [mod for _, mod in decoder_linears(model)] if fmt and model is not None else []
    for lin in lins:
        lin.forward = lambda x, lin=lin: aligned_linear(lin, fmt, x)
    try:
        yield model
    finally:
        for lin in lins:
            del lin.forward


# ============================================ THE METHOD, 3: rollout: a KV-cache sampler recording logp_behav =========
@dataclass
class Rollout:
    input_ids: torch.Tensor       # (B, P+R) left-padded prompt, then the response (pad after the first EOS)
    attention_mask: torch.Tensor  # (B, P+R) 0 on left padding
    response_mask: torch.Tensor   # (B, R) 1 on generated tokens up to and including the first EOS (by position)
    logp_behav: torch.Tensor      # (B, R) log-prob of each sampled token under the distribution it was drawn from
    prompt_len: int               # P, the padded prompt width; response token r sits at column P + r
    texts: list[str]              # decoded responses (up to the first EOS)
    truncated: torch.Tensor       # (B,) True where no EOS came within max_new_tokens

def _pick(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob under the distribution it is drawn from, softmax(logits / T): no top-k or top-p,
    which the training side would have to reproduce for the importance ratio to stay unbiased."""
    if temperature == 0:  # greedy; its log-prob is reported at T = 1 (a point mass has none worth training on)
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # one pass over the vocabulary
    tok = torch.multinomial(probs, 1, generator=generator)
    return tok.squeeze(-1), probs.gather(-1, tok).log().squeeze(-1)

def _prefill(model, tokenizer, ids: torch.Tensor, am: torch.Tensor, max_new_tokens: int):
    """The prompts' forward into a new KV cache: (last-position logits, the cache, the keyword passing it, stop ids)."""
    from transformers import DynamicCache
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and int(am.sum(-1).max()) + max_new_tokens > limit:
        raise ValueError(f"prompt of {int(am.sum(-1).max())} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"context of {limit}")
    cache = DynamicCache(config=model.config)
    # transformers >= 5.24 names the keyword `cache`, earlier releases `past_key_values`; each ignores the other's
    # silently (every decode step would then attend to its own token only), so ask the signature, then check
    kv = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                   logits_to_keep=1, **kv).logits[:, -1]
    if cache.get_seq_length() != ids.shape[1]:
        import transformers
        raise RuntimeError(f"sample: the model did not fill the KV cache (transformers {transformers.__version__}); "
                           f"tested with transformers 4.57 to 5.25")
    return logits, cache, kv, torch.tensor(stop_token_ids(model, tokenizer), device=ids.device)

@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
           generator: torch.Generator | None = None, ignore_eos: bool = False, drop_frac: float = 0.25) -> Rollout:
    """n samples of each prompt, one token per step for the whole batch with a KV cache: each distinct prompt is
    prefilled once and its cache expanded; rows leave the batch (cache included) once `drop_frac` of the live rows are
    done. Positions come from the cumulative attention mask, so left padding does not shift RoPE."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    ids, am = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    P, B, pad = ids.shape[1], len(prompts) * n, tokenizer.pad_token_id
    logits, cache, kv, stops = _prefill(model, tokenizer, ids, am, max_new_tokens)
    cache.batch_repeat_interleave(n)  # rows [i*n, (i+1)*n) are prompt i's samples
    logits, am = logits.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    next_pos = am.sum(-1)                                              # position of the next token
    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    logp_out = torch.zeros(B, max_new_tokens, device=device)
    end = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)   # index of the first EOS
    live = torch.arange(B, device=device)                              # batch row -> output row
    done = torch.zeros(B, dtype=torch.bool, device=device)
    R, sync_every = 0, 1 if device.type == "cpu" else 8
    for t in range(max_new_tokens):
        tok, lp = _pick(logits, temperature, generator)
        tok = torch.where(done, pad, tok)
        tokens[live, t], logp_out[live, t] = tok, lp
        R = t + 1
        if not ignore_eos:
            fin = torch.isin(tok, stops) & ~done
            end[live] = torch.where(fin, t, end[live])
            done = done | fin
        if t == max_new_tokens - 1:
            break
        # the one host sync of the loop: every step on CPU, every 8th on CUDA (it stalls the launch queue there)
        n_done = int(done.sum()) if not ignore_eos and t % sync_every == 0 else 0
        if n_done == len(live):
            break
        if n_done and n_done >= drop_frac * len(live):       # drop finished rows from the batch and the cache
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, tok, am, next_pos, done = live[keep], tok[keep], am[keep], next_pos[keep], done[keep]
        am = torch.cat([am, am.new_ones(len(live), 1)], dim=1)
        logits = model(input_ids=tok[:, None], attention_mask=am, position_ids=next_pos[:, None], use_cache=True,
                       **kv).logits[:, -1]
        next_pos = next_pos + 1
    response_mask = (torch.arange(R, device=device)[None, :] <= end[:, None]).float()
    tokens = tokens[:, :R].masked_fill(response_mask == 0, pad)
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(tokens, response_mask)],
                                   skip_special_tokens=True)
    return Rollout(input_ids=torch.cat([ids.repeat_interleave(n, 0), tokens], dim=1),
                   attention_mask=torch.cat([enc["attention_mask"].to(device).repeat_interleave(n, 0),
                                             torch.ones_like(tokens)], dim=1),
                   response_mask=response_mask, logp_behav=logp_out[:, :R] * response_mask, prompt_len=P,
                   texts=texts, truncated=end >= max_new_tokens)

def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids: the tokenizer's plus the generation config's (Qwen instruct stops on <|im_end|> too)."""
    g = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(g if isinstance(g, (list, tuple)) else [g])}
    return sorted(i for i in ids if i is not None)


# ============================================ THE METHOD, 4: log-probs: teacher-forced, same temperature ==============
def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   temperature: float = 1.0, micro_batch: int = 64) -> torch.Tensor:
    """(B, R) log-probs of the last R tokens under log_softmax(logits / T), in micro-batches, differentiable under grad.
    Only the R positions go through lm_head, and no (.., vocab) log-prob tensor is built: log p = z[tok] - lse(z)."""
    R = response_mask.shape[1]
    temp = temperature if temperature > 0 else 1.0  # greedy rollouts are scored at T = 1, as `sample` records them
    out = []
    for i in range(0, input_ids.shape[0], micro_batch):
        ids, am = input_ids[i:i + micro_batch], attention_mask[i:i + micro_batch]
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False,
                       logits_to_keep=R + 1).logits[:, :-1]    # position j predicts token j + 1
        z = logits.float() / temp if temp != 1.0 else logits.float()
        out.append(z.gather(-1, ids[:, -R:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1))
        del logits, z
    return torch.cat(out) * response_mask


# ============================================ THE METHOD, 5: advantages and losses ====================================
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a runaway log-ratio finite before exp

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (all of them, or along dim); 0 where the mask is empty."""
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    return total / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1.0)

def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from samples of p, with log_ratio = log q/p: e^r - 1 - r >= 0."""
    x = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return x.exp() - 1 - x

def group_advantages(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """GRPO: A_i = (R_i - mean_group R) / (std_group R + 1e-6), std unbiased (as TRL). Also counts the groups
    whose rewards are all equal: they carry no learning signal."""
    grouped = rewards.float().view(-1, group_size)
    std = grouped.std(dim=1, keepdim=True)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (std + 1e-6)
    return adv.view(-1), int((std.squeeze(1) == 0).sum())

def token_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
               mask: torch.Tensor, loss: str = "acr", eps_low: float = 0.2, eps_high: float = 0.28,
               is_cap: float = 2.0, denom: float | None = None) -> tuple[torch.Tensor, dict]:
    """The token-level PPO objectives over (B, T) log-probs, adv (B,) and mask (B, T), each a step from the last:
    naive clips pi_theta/pi_behav; tis clips R = pi_theta/pi_prox and weights by w = min(pi_prox/pi_behav, C);
    acr also widens the upper bound where w was truncated. A token mean over the mask (DAPO), or over `denom`."""
    logp_prox, logp_behav, adv = logp_prox.detach(), logp_behav.detach(), adv.detach().to(logp.dtype)
    mask = mask.to(logp.dtype)
    log_w = (logp_prox - logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)   # log pi_prox / pi_behav
    if loss == "naive":
        ratio = (logp - logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # pi_theta / pi_behav
        w, upper = torch.ones_like(ratio), torch.full_like(ratio, 1 + eps_high)
    else:
        ratio = (logp - logp_prox).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()   # R = pi_theta / pi_prox
        w = log_w.exp().clamp(max=is_cap)             # TIS (QuRL Eq. 5): w = min(pi_prox / pi_behav, C), no grad
        upper = torch.full_like(ratio, 1 + eps_high)
        if loss == "acr":
            r = (is_cap * (-log_w).exp()).clamp(max=1.0)  # QuRL Eq. 9: r = min(1, C pi_behav / pi_prox)
            upper = upper / r                             # QuRL Eq. 9: upper bound (1 + eps_high) / r
    adv = adv[:, None]                               # one advantage for every token of its sequence
    clipped = torch.minimum(torch.maximum(ratio, torch.full_like(ratio, 1 - eps_low)), upper)
    pg = -w * torch.minimum(ratio * adv, clipped * adv)  # PPO: -min(R A, clip(R, 1-eps_low, upper) A)
    out = (pg * mask).sum() / (denom or mask.sum().clamp(min=1.0))
    rd = ratio.detach()
    return out, {"loss/policy": float(out.detach()),   # clip fractions: tokens whose gradient the clip zeroes
                 "clip/low": float(masked_mean(((rd < 1 - eps_low) & (adv < 0)).to(mask.dtype), mask)),
                 "clip/high": float(masked_mean(((rd > upper) & (adv > 0)).to(mask.dtype), mask)),
                 "clip/acr_upper": float(masked_mean(upper, mask))}

def tbpo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, is_cap: float = 2.0, band: tuple[float, float, float] = (3e-4, 4e-4, 7e-4),
              max_mismatch: float | None = None, denom: float | None = None) -> tuple[torch.Tensor, dict]:
    """QaRL's Trust-Band Policy Optimization, at the sequence level, over (B, T) log-probs, adv (B,), mask (B, T).
    A >= 0 is PPO-clipped to [1 - LO, 1 + HI+], A < 0 held in the band [1 - LO, 1 + HI-]; sequences out of their band
    (or with w_i outside [1/M, M], M = max_mismatch) leave the loss and its denominator (kept ones, or `denom`)."""
    logp_prox, logp_behav, adv = logp_prox.detach(), logp_behav.detach(), adv.detach().to(logp.dtype)
    mask = mask.to(logp.dtype)
    lo, hi_pos, hi_neg = band
    live = mask.sum(1) > 0
    log_ratio = masked_mean(logp - logp_prox, mask, dim=1)  # QaRL TBPO: s_i = exp(mean_t log pi_theta/pi_prox)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # s_i, a geometric mean (GSPO; TRL #5814)
    log_w = masked_mean((logp_prox - logp_behav).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask, dim=1)
    w_hat = log_w.exp().clamp(max=is_cap)                        # w_hat_i = min(w_i, C), no grad
    pos = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi_pos) * adv)  # A >= 0: PPO clip [1-LO, 1+HI+]
    neg = ratio.clamp(1 - lo, 1 + hi_neg) * adv                             # A < 0: the band [1-LO, 1+HI-]
    rd = ratio.detach()
    below = (adv < 0) & (rd < 1 - lo)
    above = torch.where(adv >= 0, rd > 1 + hi_pos, rd > 1 + hi_neg)
    keep = live & ~below & ~above                                # out of band: out of the loss and its denominator
    if max_mismatch is not None:                                 # optional: drop w_i outside [1/M, M]
        keep &= log_w.abs() <= math.log(max_mismatch)
    kept = keep.to(logp.dtype)
    n_live = live.sum().clamp(min=1)
    out = -(kept * w_hat * torch.where(adv >= 0, pos, neg)).sum() / (denom or kept.sum().clamp(min=1.0))
    return out, {"loss/policy": float(out.detach()), "tbpo/kept": float(kept.sum() / n_live),
                 "tbpo/n_kept": float(kept.sum()), "clip/low": float((below & live).sum() / n_live),
                 "clip/high": float((above & live).sum() / n_live)}

def policy_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, loss: str = "acr", eps_low: float = 0.2, eps_high: float = 0.28,
                is_cap: float = 2.0, tbpo_eps: tuple[float, float, float] = (3e-4, 4e-4, 7e-4),
                tbpo_max_mismatch: float | None = None, denom: float | None = None) -> tuple[torch.Tensor, dict]:
    """The one entry point: `tbpo_loss` for loss="tbpo", else `token_loss`; adds the sampled-token entropy. Gradient
    flows only into logp. Metrics are fractions of this batch's tokens (sequences for tbpo)."""
    if loss == "tbpo":
        out, m = tbpo_loss(logp, logp_prox, logp_behav, adv, mask, is_cap, tbpo_eps, tbpo_max_mismatch, denom)
    else:
        out, m = token_loss(logp, logp_prox, logp_behav, adv, mask, loss, eps_low, eps_high, is_cap, denom)
    return out, {"loss/entropy": float(masked_mean(-logp.detach(), mask.to(logp.dtype))), **m}

def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, denom: float | None = None):
    """k3 estimate of KL(pi_theta || pi_ref), token mean (Schulman's k3, as GRPO); `denom` replaces the token count."""
    return (k3(logp_ref.detach() - logp) * mask).sum() / (denom or mask.sum().clamp(min=1.0))

def mismatch_metrics(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the sampler is from the fp actor on the sampled tokens: k3 KL(pi_behav || pi_prox) per token, mean
    |log pi_prox - log pi_behav|, and the largest token ratio pi_prox / pi_behav."""
    log_w = (logp_prox - logp_behav).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"mismatch/kl": float(masked_mean(k3(log_w), mask)),
            "mismatch/logp_absdiff": float(masked_mean(log_w.abs(), mask)),
            "mismatch/ratio_max": float(log_w.masked_fill(mask == 0, -math.inf).max().exp()) if mask.any() else 1.0}


# ============================================ THE METHOD, 6: one RL step ==============================================
METRIC_KEYS = ["step", "reward/mean", "reward/zero_std_groups", "rollout/len_mean", "rollout/truncated",
               "rollout/entropy", "mismatch/kl", "mismatch/logp_absdiff", "mismatch/ratio_max", "clip/low",
               "clip/high", "clip/acr_upper", "loss/policy", "loss/entropy", "loss/kl", "tbpo/kept",
               "quant/flip_rate", "guard/skipped", "opt/lr", "perf/rollout_tok_s", "perf/step_s", "perf/rollout_frac",
               "eval/acc", "eval/pass@k"]
UPDATE_KEYS = [k for k in METRIC_KEYS if k.split("/")[0] in ("clip", "loss", "tbpo")]  # what `update` measures
# gradient clipping; a progress line, a checkpoint (also on Ctrl-C/SIGTERM) every N steps; NaN guard; eval batch rows
MAX_GRAD_NORM, LOG_EVERY, SAVE_EVERY, MAX_BAD_STEPS, EVAL_BATCH = 1.0, 10, 50, 3, 256

@dataclass
class Learner:
    """What an RL step touches."""
    model: nn.Module             # the trainable actor: fp32 master weights
    opt: torch.optim.Optimizer   # AdamW over the masters, fp32 state
    actor: nn.Module             # the rollout actor: its own copy in the rollout precision (or the model itself)
    tok: object                  # the tokenizer
    gen: torch.Generator         # the sampler's random numbers
    dtype: torch.dtype           # compute dtype of every forward (torch.autocast; fp32 disables it)
    ref_model: nn.Module | None = None   # the KL reference (the actor at the start), with --kl-coef > 0

def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision the standard way: forwards compute in `dtype` on fp32 master weights; a no-op in fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

def make_rollout_actor(model: nn.Module, quant: str, dtype: torch.dtype) -> nn.Module:
    """The sampler's own copy of the actor, refreshed by `sync_weights` every step: quantized decoder linears with the
    rest a copy of the masters (run under the learner's autocast, so the aligned forward reproduces it bit for bit);
    with --quant none a copy in the compute dtype, as a bf16 engine holds it (fp32: the model itself)."""
    if quant != "none":
        return quantize_actor(model, quant)
    if dtype == torch.float32:
        return model
    # parameters only (buffers such as RoPE's inv_freq stay fp32, as engines keep them), cast one at a time
    memo = {id(param): nn.Parameter(param.detach().to(dtype), requires_grad=False) for param in model.parameters()}
    return copy.deepcopy(model, memo).eval()

def train_step(rl: Learner, args: Args, problems: list[dict], step: int, reward_fn=None,
               ignore_eos: bool = False) -> tuple[dict, float]:
    """One RL step: sync -> rollout -> reward -> advantages -> logp_prox -> PPO epochs; returns (metrics, rollout
    seconds), unmeasured metrics None. reward_fn defaults to `reward`; ignore_eos (benchmarks) fills every row."""
    t0, G = time.time(), args.group_size
    m = {"step": step, "quant/flip_rate": sync_weights(rl.actor, rl.model)}  # 1. re-quantize from the masters
    prompts = [format_prompt(p["question"], rl.tok) for p in problems]
    rl.model.eval()
    with autocast(rl.gen.device, rl.dtype):                                  # 2. rollout with the rollout actor
        ro = sample(rl.actor, rl.tok, prompts, n=G, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, generator=rl.gen, ignore_eos=ignore_eos)
    rl.model.train()
    t_roll = time.time() - t0
    golds = [p["gold"] for p in problems for _ in range(G)]
    rewards = torch.tensor([(reward_fn or reward)(t, g) for t, g in zip(ro.texts, golds)])
    adv, zero_groups = group_advantages(rewards, G)                          # 3. GRPO advantages
    n_tok = float(ro.response_mask.sum())
    m.update({"reward/mean": float(rewards.mean()), "reward/zero_std_groups": zero_groups,
              "rollout/len_mean": n_tok / len(ro.texts), "rollout/truncated": float(ro.truncated.float().mean())})
    trained = rewards.view(-1, G).std(1).repeat_interleave(G) > 0  # all-equal groups: no gradient, left out
    dev = ro.input_ids.device
    rows, rest = trained.nonzero().squeeze(1).to(dev), (~trained).nonzero().squeeze(1).to(dev)
    one_update = args.ppo_epochs * args.mini_batches == 1
    align = args.quant if args.align_forward else None
    batch = lambda r: (ro.input_ids[r], ro.attention_mask[r], ro.response_mask[r])  # noqa: E731
    with autocast(dev, rl.dtype), rollout_aligned(rl.model, align), rollout_aligned(rl.ref_model, align):
        # 4. logp_prox: the fp actor before this step's update, no grad, on every row (mismatch/* measures the
        #    sampler). With one update per rollout a trained row's training forward is that very value: reused.
        lp_prox = torch.zeros_like(ro.logp_behav)
        need = rest if one_update else torch.arange(len(rewards), device=dev)
        with torch.no_grad():
            if len(need):
                lp_prox[need] = token_logprobs(rl.model, *batch(need), args.temperature, args.micro_batch)
            lp_ref = (token_logprobs(rl.ref_model, *batch(rows), args.temperature, args.micro_batch)
                      if rl.ref_model is not None and len(rows) else None)
        # 5. PPO epochs over mini-batches, gradients accumulated over micro-batches
        lm, prox_seen = update(rl, args, *batch(rows), ro.logp_behav[rows], adv.to(dev)[rows],
                               None if one_update else lp_prox[rows], lp_ref)
        if prox_seen is not None:
            lp_prox[rows] = prox_seen
    m.update(mismatch_metrics(lp_prox, ro.logp_behav, ro.response_mask))
    m["rollout/entropy"] = float(masked_mean(-ro.logp_behav, ro.response_mask))  # sampled-token estimate, all rows
    m.update({k: lm.get(k) for k in UPDATE_KEYS}, **{"guard/skipped": lm.get("guard/skipped", 0)})
    dt = time.time() - t0
    m.update({"perf/rollout_tok_s": n_tok / max(t_roll, 1e-9), "perf/step_s": dt,
              "perf/rollout_frac": t_roll / max(dt, 1e-9)})
    return m, t_roll

def update(rl: Learner, args: Args, ids, am, mask, logp_behav, adv, logp_prox=None, logp_ref=None):
    """--ppo-epochs passes, --mini-batches optimizer steps each. logp_prox None (one update per rollout): pi_prox is
    pi_theta's own detached value, returned for the mismatch metrics. Returns (metrics averaged over the steps, it)."""
    logs, prox_seen, skipped = [], [], 0
    params = [param for param in rl.model.parameters() if param.requires_grad]
    for _ in range(args.ppo_epochs if len(ids) else 0):
        for mb in _batches(len(ids), args.mini_batches):
            rl.opt.zero_grad(set_to_none=True)
            lm, finite = backward_mini_batch(rl, args, ids[mb], am[mb], mask[mb], logp_behav[mb], adv[mb],
                                             None if logp_prox is None else logp_prox[mb],
                                             None if logp_ref is None else logp_ref[mb], prox_seen)
            gnorm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            if finite and torch.isfinite(gnorm):  # numeric guard: never step on NaN/inf
                rl.opt.step()
                torch.clear_autocast_cache()  # autocast keeps the bf16 copy of each weight until its block exits
            else:
                skipped += 1
                notice("non-finite loss or gradient: update skipped")
            rl.opt.zero_grad(set_to_none=True)
            logs.append(lm)
    out = {k: sum(lm[k] for lm in logs) / len(logs) for k in logs[0]} if logs else {}
    out["guard/skipped"] = skipped
    return out, (torch.cat(prox_seen) if prox_seen else None)

def backward_mini_batch(rl: Learner, args: Args, ids, am, mask, logp_behav, adv, logp_prox, logp_ref,
                        prox_seen: list) -> tuple[dict, bool]:
    """One mini-batch's gradient, accumulated over micro-batches of --micro-batch rows, each loss divided by the whole
    mini-batch's denominator: the single-pass gradient at --micro-batch's memory. Returns (metrics, all finite)."""
    kw = dict(loss=args.loss, eps_low=args.eps_low, eps_high=args.eps_high, is_cap=args.is_cap,
              tbpo_eps=tuple(args.tbpo_band))
    micro = [slice(i, i + args.micro_batch) for i in range(0, len(ids), args.micro_batch)]
    n_tok = float(mask.sum())
    denom = n_tok
    if args.loss == "tbpo":  # the kept count is known after the pass: sum now, divide the gradient then; a KL
        denom = 1.0          # term (a token mean of its own) needs it first: a no-grad pass counts it
        if logp_ref is not None:
            with torch.no_grad():
                denom = 0.0
                for sl in micro:
                    lp = token_logprobs(rl.model, ids[sl], am[sl], mask[sl], args.temperature, args.micro_batch)
                    prox = lp if logp_prox is None else logp_prox[sl]
                    denom += policy_loss(lp, prox, logp_behav[sl], adv[sl], mask[sl], **kw)[1]["tbpo/n_kept"]
                denom = max(denom, 1.0)
    parts, finite = [], True
    for sl in micro:
        logp = token_logprobs(rl.model, ids[sl], am[sl], mask[sl], args.temperature, args.micro_batch)
        prox = logp.detach() if logp_prox is None else logp_prox[sl]
        loss, lm = policy_loss(logp, prox, logp_behav[sl], adv[sl], mask[sl], denom=denom, **kw)
        if logp_ref is not None:
            kl = kl_penalty(logp, logp_ref[sl], mask[sl], denom=n_tok)
            loss = loss + args.kl_coef * kl
            lm["loss/kl"] = float(kl.detach())
        loss.backward()
        finite &= bool(torch.isfinite(loss.detach()))
        if logp_prox is None:
            prox_seen.append(prox)
        parts.append((lm, float(mask[sl].sum()), float((mask[sl].sum(1) > 0).sum())))
    lm = _combine_micro(parts)
    if args.loss == "tbpo" and logp_ref is None:
        kept = max(lm["tbpo/n_kept"], 1.0)
        lm["loss/policy"] /= kept
        for param in rl.model.parameters():
            if param.grad is not None:
                param.grad.div_(kept)
    return lm, finite

def lr_at(step: int, steps: int, lr: float, schedule: str) -> float:
    """Learning rate of step 1..steps. Cosine decay to 0 makes the last updates small, so the final policy (the one
    evaluated and saved) is not caught mid-oscillation; TRL's default decays linearly for the same reason."""
    if schedule == "constant":
        return lr
    return 0.5 * lr * (1 + math.cos(math.pi * (step - 1) / max(steps, 1)))


# ============================================ THE METHOD, 7: the training loop ========================================
def train(args: Args) -> dict:
    """The RL loop: train_step after train_step, an evaluation every --eval-every steps, a checkpoint every
    SAVE_EVERY steps and on Ctrl-C or SIGTERM. Set-up, evaluation, checkpoints and the summary are Appendix A's."""
    rl, run = start_run(args)
    with stop_requests(), tracking(args, run.dir) as track, open(run.dir / "metrics.jsonl", "a") as log:
        for step in range(run.step + 1, args.steps + 1):
            for group in rl.opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.lr_schedule)
            problems = [run.train_set[run.order[(run.data_pos + i) % len(run.order)]]
                        for i in range(args.prompts_per_step)]
            m, t_roll = train_step(rl, args, problems, step)
            run.step, run.data_pos = step, run.data_pos + args.prompts_per_step
            run.bad_in_row = run.bad_in_row + 1 if m["guard/skipped"] else 0
            run.skipped += m["guard/skipped"]
            if run.bad_in_row >= MAX_BAD_STEPS:
                raise QurlError(f"{run.bad_in_row} steps in a row with non-finite losses or gradients (step {step}): "
                                f"stopped; the last good checkpoint is in {run.dir}/ckpt (try a lower --lr)")
            m.update({"guard/skipped": run.skipped, "opt/lr": rl.opt.param_groups[0]["lr"]})
            run.rollout_s, run.step_s = run.rollout_s + t_roll, run.step_s + m["perf/step_s"]
            eval_now = step % args.eval_every == 0 or step == args.steps
            if eval_now:
                run.last_eval, run.last_pass = run_eval(rl, args, run)
            m.update({"eval/acc": run.last_eval if eval_now else None,
                      "eval/pass@k": run.last_pass if eval_now else None})
            log.write(json.dumps(m) + "\n")
            log.flush()
            track(m)
            if step % LOG_EVERY == 0 or step == args.steps:
                print_progress(run, m, args)
            if STOP:
                save_checkpoint(run.dir, checkpoint_state(rl, run, args))
                notice(f"stopped: checkpoint of step {step} written; continue with: python qurl.py --resume "
                       f"{run.dir}")
                raise SystemExit(128 + next(iter(STOP)))  # 130 after Ctrl-C, 143 after SIGTERM
            if step % SAVE_EVERY == 0 and step != args.steps:
                save_checkpoint(run.dir, checkpoint_state(rl, run, args))
    save_checkpoint(run.dir, checkpoint_state(rl, run, args))
    return finish_run(rl, run, args)


# ============================================ APPENDIX A: plumbing (arguments, data, model, run folders, signals) =====
def _parser(defaults: bool = True) -> argparse.ArgumentParser:
    """argparse from Args, each field's doc its --help. defaults=False leaves out the flags the user did not type."""
    parser = argparse.ArgumentParser(prog="qurl.py", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     argument_default=None if defaults else argparse.SUPPRESS)
    parser.error = lambda msg: _die(f"{msg} (see python qurl.py --help)")  # one line, no usage dump
    section = parser
    for f in dataclasses.fields(Args):
        name, meta, kind = "--" + f.name.replace("_", "-"), f.metadata, str(f.type)
        default = f.default if defaults else argparse.SUPPRESS
        section = parser.add_argument_group(meta["group"]) if "group" in meta else section
        if kind == "bool":
            section.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
        else:
            section.add_argument(name, type=float if "float" in kind else int if kind == "int" else str,
                                 default=default, help=meta["help"], choices=meta.get("choices"),
                                 nargs=meta.get("nargs"), metavar=meta.get("metavar"))
    return parser

def parse_args(argv=None) -> Args:
    """Parse and validate. With --resume DIR the run's args.json is the base and only the flags typed now override
    it: `python qurl.py --resume runs/x` continues the run as it was started."""
    args, typed = Args(**vars(_parser().parse_args(argv))), vars(_parser(defaults=False).parse_args(argv))
    if args.resume:
        saved = Path(args.resume) / "args.json"
        if not saved.is_file():
            _die(f"--resume {args.resume}: no checkpoint there (not a run folder: {saved} is missing)")
        names = {f.name for f in dataclasses.fields(Args)}
        args = Args(**{**{k: v for k, v in json.loads(saved.read_text()).items() if k in names}, **typed})
    if msg := validate_args(args):
        _die(msg)
    for line in flag_notices(args, set(typed)):
        notice(line)
    return args

def flag_notices(args: Args, typed: set[str]) -> list[str]:
    """Flags the user typed that do nothing: for the chosen loss, or with one update per rollout. One line each."""
    unused = {"naive": {"tbpo_band", "is_cap"}, "tis": {"tbpo_band"}, "acr": {"tbpo_band"},
              "tbpo": {"eps_low", "eps_high"}}[args.loss]
    out = [f"--{name.replace('_', '-')} does nothing with --loss {args.loss}" for name in sorted(unused & typed)]
    asked = typed & {"loss", "eps_low", "eps_high", "tbpo_band"}
    if args.ppo_epochs * args.mini_batches == 1 and args.loss != "naive" and asked and not args.plot:
        what = {"tis": "the PPO clip never binds", "acr": "the PPO clip never binds and ACR equals TIS bit for bit",
                "tbpo": "no sequence leaves TBPO's band (s = 1)"}[args.loss]
        out.append(f"with one update per rollout (--ppo-epochs 1 --mini-batches 1) pi_theta = pi_prox at the update, "
                   f"so R = 1: {what}; use --mini-batches > 1 or --ppo-epochs > 1 to see it act")
    return out

def validate_args(args: Args) -> str | None:
    """Return a one-line complaint about the first out-of-range value, or None."""
    at_least = {1: ("prompts_per_step", "max_new_tokens", "ppo_epochs", "mini_batches", "micro_batch", "eval_every"),
                0: ("temperature", "eps_high", "kl_coef", "steps", "eval_size", "eval_k")}
    for least, names in at_least.items():
        bad = next((name for name in names if getattr(args, name) < least), None)
        if bad:
            return f"--{bad.replace('_', '-')} must be >= {least}, got {getattr(args, bad)}"
    checks = [
        (args.group_size >= 2,
         f"--group-size must be >= 2 (a GRPO group needs two samples to compare), got {args.group_size}"),
        (args.temperature > 0 or args.steps == 0 or args.dry_run or args.plot,
         "--temperature 0 (greedy) cannot train: a greedy rollout has no distribution to compute a policy gradient "
         "of; use a temperature > 0 (1.0 is the default)"),
        (0 <= args.eps_low < 1, f"--eps-low must be in [0, 1), got {args.eps_low}"),
        (args.is_cap >= 1, f"--is-cap must be >= 1 (it truncates pi_prox/pi_behav; FlashRL uses 2), got {args.is_cap}"),
        (min(args.tbpo_band) > 0 and args.tbpo_band[0] < 1, "--tbpo-band values must be > 0 (and LO < 1)"),
        (args.invariant_scale is None or args.invariant_scale > 0,
         f"--invariant-scale must be > 0 (1 disables it; the paper uses 1.5), got {args.invariant_scale}"),
        (args.lr > 0, f"--lr must be > 0, got {args.lr}"),
        (args.mini_batches <= args.prompts_per_step * args.group_size, "--mini-batches exceeds the rows of a step"),
        (args.dtype != "float16", "--dtype float16 is not supported: fp16 autocast needs loss scaling, which qurl "
                                  "does not do; use bfloat16 (or float32 on a GPU without bf16)"),
        (args.dtype in ("auto", "float32", "bfloat16"), f"--dtype: unknown '{args.dtype}' (auto, float32 or bfloat16)"),
        (not (args.align_forward and args.quant == "none"), "--align-forward needs a quantizer: add --quant int8, fp8 "
                                                            "or nf4"),
        (len(args.fields.split(",")) == 2 and all(args.fields.split(",")),
         f"--fields must name two fields, QUESTION,ANSWER, got '{args.fields}'"),
        (args.run_name is None or (args.run_name not in ("", ".", "..") and not set(args.run_name) & set("/\\")),
         f"--run-name must be one folder name inside --out-dir (not empty, no / or \\, not . or ..), "
         f"got {args.run_name!r}"),
    ]
    return next((msg for ok, msg in checks if not ok), None)

def _die(msg: str) -> None:
    print(f"qurl: error: {msg}", file=sys.stderr)
    sys.exit(2)

def _batches(n_rows: int, n_mb: int) -> list[slice]:
    """n_mb contiguous slices of sizes that differ by at most one (fewer only when n_rows < n_mb)."""
    bounds = [round(i * n_rows / n_mb) for i in range(n_mb + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

def _combine_micro(parts: list[tuple[dict, float, float]]) -> dict:
    """One mini-batch's metrics from its micro-batches': losses add up (each was divided by the mini-batch's
    denominator), counts add up, fractions are weighted by tokens (token losses) or sequences (tbpo)."""
    out = {}
    for k in parts[0][0]:
        if k in ("loss/policy", "loss/kl", "tbpo/n_kept"):
            out[k] = sum(lm[k] for lm, _, _ in parts)
        else:
            counts = [(n_seq if k in ("tbpo/kept", "clip/low", "clip/high") and "tbpo/kept" in lm else n_tok)
                      for lm, n_tok, n_seq in parts]
            out[k] = sum(lm[k] * c for (lm, _, _), c in zip(parts, counts)) / max(sum(counts), 1.0)
    return out

def _require_bnb(fmt: str = "int8") -> None:
    try:
        from bitsandbytes import __version__ as version
    except ImportError:
        version = None
    if version is None or tuple(int(v) for v in version.split(".")[:2]) < (0, 46):
        raise QurlError(f"--quant {fmt} needs bitsandbytes >= 0.46 for its CPU ops, found {version} (pip install -U "
                        f"'bitsandbytes>=0.46'); or use --quant fp8")

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")

def _last_number(text: str) -> str | None:
    nums = _NUM.findall(text)
    return nums[-1] if nums else None

def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed")
    i, depth = text.find("{", start) if start >= 0 else -1, 0
    for j in range(i, len(text)) if i >= 0 else ():  # no brace: nothing to scan
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None

def _normalize(ans: str) -> str:
    """'$1,234.50' -> '1234.5', '\\frac{3}{4}' -> '3/4', '-12 apples' -> '-12'; non-numeric text -> lowercased."""
    text = ans.strip().replace("\\!", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text).replace("−", "-")
    frac = re.fullmatch(r"\s*\(?(-?[\d,]*\.?\d+)\)?\s*/\s*\(?(\d+)\)?\s*", text)
    num = (frac.group(1) + "/" + frac.group(2)) if frac else _last_number(text) if re.search(r"\d", text) else None
    if num is None:
        return re.sub(r"\s+", " ", text).strip().strip(".").lower()
    num = num.replace(",", "").replace(" ", "")
    value = _as_number(num)
    if value is None:
        return num
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}" if "/" in num else repr(float(value)).rstrip("0").rstrip(".")

def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None

def load_problems(spec: str, split: str = "train", fields: str = "question,answer") -> list[dict]:
    """[{"question", "gold"}] from a .jsonl (read line by line: an error names the line), .json or .parquet file, or
    a hub data set NAME[:CONFIG][@SPLIT]; the gold answer is `extract_answer` of the answer field."""
    path, (question_field, answer_field), rows = Path(spec), fields.split(","), []
    hub = not (path.suffix in (".jsonl", ".json", ".parquet") or path.exists() or spec.startswith((".", "/")))
    if not hub and not path.is_file():
        raise QurlError(f"data file not found: {spec}")
    if path.suffix == ".jsonl" and not hub:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rows += [(f"{spec}:{i}", json.loads(line))] if line.strip() else []
            except json.JSONDecodeError as e:
                raise QurlError(f"{spec}:{i}: malformed JSON line ({e.msg}); fix or delete that line") from None
    elif path.suffix in (".json", ".parquet") or hub:
        rows = _load_with_datasets(spec, split, hub)
    else:
        raise QurlError(f"{spec}: unknown data format '{path.suffix}'; use .jsonl, .json or .parquet")
    problems = []
    for where, r in rows:
        if not isinstance(r, dict):
            raise QurlError(f"{where}: expected a JSON object, got {type(r).__name__}")
        for key in (question_field, answer_field):
            if key not in r:
                raise QurlError(f"{where}: missing field '{key}' (has {sorted(r)}); set --fields QUESTION,ANSWER")
        gold = extract_answer(str(r[answer_field]))
        if gold is None:
            raise QurlError(f"{where}: gold answer does not parse: {str(r[answer_field])[-80:]!r}")
        problems.append({"question": str(r[question_field]), "gold": gold})
    if not problems:
        raise QurlError(f"{spec}: no problems found (empty data set)")
    return problems

def load_data(args: Args) -> tuple[list[dict], list[dict]]:
    """(training problems, held-out problems) from the files or hub data sets the flags name."""
    return load_problems(args.train_data, "train", args.fields), load_problems(args.test_data, "test", args.fields)

def _load_with_datasets(spec: str, split: str, hub: bool) -> list[tuple[str, dict]]:
    """Rows of a .json/.parquet file or hub set NAME[:CONFIG][@SPLIT] through `datasets`, silenced (gsm8k: 'main')."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    name, _, split = spec.partition("@") if "@" in spec else (spec, "", split)
    name, _, config = name.partition(":") if hub else (name, "", "")
    try:
        ds = (datasets.load_dataset(name, config or ("main" if name.endswith("gsm8k") else None), split=split) if hub
              else datasets.load_dataset(Path(spec).suffix[1:], data_files=spec, split="train"))
    except Exception as e:
        text = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if hub and any(word in text for word in ("Offline", "offline", "resolve", "Connection")):
            raise QurlError(f"cannot load hub data set '{name}': no network (offline); pass a local "
                            f".jsonl/.json/.parquet file, e.g. data/arith_train.jsonl") from None
        raise QurlError(f"{spec}: cannot be read as {Path(spec).suffix[1:]} ({text})" if not hub else
                        f"cannot load data set '{name}' (not a local file either): {text}") from None
    return [(f"{name}[{split}] row {i + 1}" if hub else f"{spec} row {i + 1}", r) for i, r in enumerate(ds)]

def resolve_device_dtype(dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """CUDA when torch sees it (CUDA_VISIBLE_DEVICES= forces the CPU); the compute dtype: bf16 on CUDA, else fp32."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
        if dev.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            dtype = "float32"
            notice("this GPU has no bf16 arithmetic: computing in float32")
    return dev, getattr(torch, dtype)

def load_model(name_or_path: str = "data/tiny-qwen", device="cpu", dtype=torch.float32, weights: bool = True):
    """(model, tokenizer) through AutoModelForCausalLM / AutoTokenizer; left padding and a pad token are ensured.
    weights=False builds the model from its config on the meta device: its shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not Path(name_or_path).is_dir() and (HERE / name_or_path).is_dir():
        name_or_path = str(HERE / name_or_path)
    local = Path(name_or_path).is_dir()
    if not local and (name_or_path.startswith((".", "/")) or name_or_path.count("/") != 1):
        raise QurlError(f"model not found: '{name_or_path}' is not a folder, nor a hub name like Qwen/Qwen2.5-0.5B")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype).to(device)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name_or_path))
    except OSError as e:
        if not local:
            raise QurlError(f"cannot load '{name_or_path}' from the hub (offline or no such model): use a local "
                            f"folder such as data/tiny-qwen") from None
        raise QurlError(f"cannot load model folder '{name_or_path}': {str(e).splitlines()[0][:200]}") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok

def prepare_actor(model: nn.Module, grad_checkpointing: bool = False) -> None:
    """The learner's forwards run in train mode (gradient checkpointing needs it). With dropout pi_prox and pi_theta
    would be noisy estimates of the same policy, so every dropout probability is set to 0."""
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
        for name in ("attention_dropout", "dropout"):   # transformers' attention modules keep a float
            if isinstance(getattr(mod, name, None), float):
                setattr(mod, name, 0.0)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

def check_prompt_lengths(model, tok, problems: list[dict], max_new_tokens: int) -> int:
    """The widest prompt in tokens; refuses, before anything is written, a prompt + response beyond the context."""
    lens = [len(x) for x in tok([format_prompt(p["question"], tok) for p in problems],
                                add_special_tokens=False)["input_ids"]]
    i, limit = max(range(len(lens)), key=lens.__getitem__), getattr(model.config, "max_position_embeddings", None)
    if limit is not None and lens[i] + max_new_tokens > limit:
        raise QurlError(f"problem {i + 1} ({problems[i]['question'][:40]!r}...): prompt of {lens[i]} tokens + "
                        f"--max-new-tokens {max_new_tokens} exceeds the model's context of {limit}; shorten or "
                        f"drop long problems, or lower --max-new-tokens")
    return lens[i]

RUN_MARKER = ".qurl-run"  # written into every run folder at creation: --overwrite deletes only folders that hold it

def is_qurl_run(d: Path) -> bool:
    """A folder qurl created: it holds the marker (or, for runs made before the marker, args.json + metrics.jsonl)."""
    return (d / RUN_MARKER).is_file() or ((d / "args.json").is_file() and (d / "metrics.jsonl").is_file())

def check_run_dir(args: Args) -> Path:
    """The run folder, checked without side effects (a run that fails later in set-up has destroyed nothing). A
    default name is numbered (-2, -3, ...) when taken, so a command runs twice; a chosen name never changes."""
    d = Path(args.resume or Path(args.out_dir) / (args.run_name or f"{args.quant}-{args.loss}-s{args.seed}"))
    if args.resume:
        if not (d / "ckpt" / "state.pt").is_file() and not (d / "ckpt.old" / "state.pt").is_file():
            raise QurlError(f"--resume {d}: no checkpoint there (expected {d}/ckpt/state.pt)")
        return d
    if args.run_name is None and not args.overwrite:
        d = next(c for c in (d.with_name(f"{d.name}-{i}" if i > 1 else d.name) for i in range(1, 10**6))
                 if not c.exists())
    if d.exists() and not d.is_dir():
        raise QurlError(f"run folder {d} is a file, not a folder: choose another --run-name or --out-dir")
    if d.is_dir() and any(d.iterdir()) and not args.overwrite:
        raise QurlError(f"run folder {d} already exists: pass --resume {d} to continue it, --overwrite to replace "
                        f"it, or --run-name NAME")
    if d.is_dir() and any(d.iterdir()) and not is_qurl_run(d):
        held = sorted(path.name for path in d.iterdir())
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise QurlError(f"--overwrite: {d} is not a qurl run folder (it holds {shown}; no {RUN_MARKER}), so qurl "
                        f"will not delete it: choose another --run-name or --out-dir")
    parent = next(path for path in [d, *d.parents] if path.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise QurlError(f"cannot write to {d} ({parent} is not a writable folder); choose another --out-dir")
    return d

def make_run_dir(d: Path) -> None:
    """Create the run folder (replacing an old qurl run under --overwrite, which check_run_dir allowed) and mark it."""
    if d.is_dir() and any(d.iterdir()):
        assert is_qurl_run(d), d  # check_run_dir refused anything else
        shutil.rmtree(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / RUN_MARKER).write_text("a qurl run folder: qurl --overwrite may delete it\n")
    except OSError as e:
        raise QurlError(f"cannot write to {d} ({e.strerror}); choose another --out-dir") from None

@dataclass
class RunState:
    """A run's bookkeeping between steps: its folder, data, position, and what it has measured so far."""
    dir: Path
    train_set: list[dict]
    test_set: list[dict]
    order: list[int]                  # the data order: a permutation of train_set's indices
    s: float                          # the invariant scale applied to the actor (folded back in final/)
    step: int = 0                     # the last step finished
    start_step: int = 0               # the step this process started from (0, or the resumed checkpoint's)
    data_pos: int = 0                 # problems consumed so far
    first_eval: float | None = None   # greedy accuracy and pass@k of the start, and of the last evaluation
    first_pass: float | None = None
    last_eval: float | None = None
    last_pass: float | None = None
    skipped: int = 0                  # updates skipped by the numeric guard, and how many in a row
    bad_in_row: int = 0
    rollout_s: float = 0.0
    step_s: float = 0.0
    t_start: float = 0.0

def start_run(args: Args) -> tuple[Learner, RunState]:
    """Check the model, data and run folder; build the learner (fp32 masters, invariant scaling, the KL reference,
    the rollout actor, AdamW); only then create or resume the run folder, and evaluate the start."""
    _tracker_module(args.track)  # a missing wandb/tensorboard package fails first
    device, dtype = resolve_device_dtype(args.dtype)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, device, torch.float32)  # fp32 master weights; forwards run in `dtype`
    prepare_actor(model, args.grad_checkpointing)
    train_set, test_set = load_data(args)
    test_set = test_set[:args.eval_size] if args.eval_size else test_set
    check_prompt_lengths(model, tok, train_set + test_set, args.max_new_tokens)
    d = check_run_dir(args)
    ckpt = load_checkpoint(d) if args.resume else None
    if ckpt is not None and ckpt["model_id"] != _model_id(model):
        raise QurlError(f"--resume {d}: checkpoint is of a different model ({ckpt['model_id']}) than "
                        f"--model {args.model} ({_model_id(model)})")
    s = args.invariant_scale if args.invariant_scale is not None else (1.0 if args.quant == "none" else 1.5)
    if s != 1.0:
        invariant_scale(model, s)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None  # the start
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    actor = make_rollout_actor(model, args.quant, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    rl = Learner(model, opt, actor, tok, torch.Generator(device=device).manual_seed(args.seed), dtype, ref_model)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    run = RunState(d, train_set, test_set, order, s)
    if ckpt is not None:
        resume_from(rl, run, ckpt)
    else:
        make_run_dir(d)  # every check has passed: only now may an old run be replaced
        (d / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        (d / "metrics.jsonl").write_text("")
    run.start_step, run.t_start = run.step, time.time()
    if ckpt is None:
        run.first_eval, run.first_pass = run_eval(rl, args, run)
        at_k = f", pass@{args.eval_k} {run.first_pass:.3f}" if args.eval_k else ""
        notice(f"step 0: eval/acc {run.first_eval:.3f}{at_k} on {len(test_set)} held-out problems")
    run.last_eval, run.last_pass = run.first_eval, run.first_pass
    return rl, run

def run_eval(rl: Learner, args: Args, run: RunState) -> tuple[float, float | None]:
    """Greedy held-out accuracy of the fp actor (and pass@k with --eval-k), in the learner's compute dtype."""
    rl.model.eval()
    with autocast(rl.gen.device, rl.dtype):
        res = evaluate(rl.model, rl.tok, run.test_set, max_new_tokens=args.max_new_tokens,
                       batch_size=EVAL_BATCH, k=args.eval_k, seed=args.seed)
    rl.model.train()
    return res["acc"], res.get(f"pass@{args.eval_k}")

@torch.no_grad()
def evaluate(model, tokenizer, problems: list[dict], max_new_tokens=32, batch_size=256, k=0, seed=0) -> dict:
    """Greedy accuracy and mean response length (tokens) on held-out problems; with k > 0 also pass@k from k samples
    per problem at T = 1 (Chen et al. 2021's unbiased estimator, which for n = k samples is "any of them right")."""
    correct, length, solved = 0.0, 0.0, 0.0
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [format_prompt(p["question"], tokenizer) for p in chunk]
        ro = sample(model, tokenizer, prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0)
        correct += sum(reward(t, p["gold"]) for t, p in zip(ro.texts, chunk))
        length += float(ro.response_mask.sum())
        per = max(1, batch_size // k) if k else 1   # problems per sampled batch of about batch_size rows
        for j in range(0, len(chunk), per) if k else []:
            sub = chunk[j:j + per]
            ro = sample(model, tokenizer, prompts[j:j + per], n=k, max_new_tokens=max_new_tokens, temperature=1.0,
                        generator=gen)
            right = torch.tensor([reward(t, p["gold"]) for t, p in zip(ro.texts, (p for p in sub for _ in range(k)))])
            solved += sum(pass_at_k(k, int(c), k) for c in right.view(-1, k).sum(1))
    out = {"acc": correct / len(problems), "len_mean": length / len(problems), "n": len(problems)}
    if k:
        out[f"pass@{k}"] = solved / len(problems)
    return out

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)

def save_final(path: Path, model, tok, s: float) -> None:
    """`final/`, a standard checkpoint: the fp32 masters (a bf16 export would round away most of an RL run's small
    updates) with invariant scaling folded back. The model is left on the original scale."""
    if s != 1.0:
        invariant_scale(model, 1.0 / s)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "qurl.json").write_text(json.dumps({"invariant_scale_folded_back": s, "dtype": "float32"}) + "\n")

def checkpoint_state(rl: Learner, run: RunState, args: Args) -> dict:
    """What a run resumes from: weights, optimizer, the actor's codes (flips count from them), RNGs, position."""
    quantized = any(isinstance(mod, QuantLinear) for mod in rl.actor.modules())
    return {"step": run.step, "data_pos": run.data_pos, "model": rl.model.state_dict(),
            "optimizer": rl.opt.state_dict(), "q_model": rl.actor.state_dict() if quantized else None,
            "rng_python": random.getstate(), "rng_torch": torch.get_rng_state(), "rng_sampler": rl.gen.get_state(),
            "args": dataclasses.asdict(args), "model_id": _model_id(rl.model), "first_eval": run.first_eval,
            "first_pass": run.first_pass, "skipped": run.skipped}

def resume_from(rl: Learner, run: RunState, ckpt: dict) -> None:
    rl.opt.load_state_dict(ckpt["optimizer"])
    if ckpt["q_model"] is not None and rl.actor is not rl.model:
        rl.actor.load_state_dict(ckpt["q_model"])
    run.step, run.data_pos, run.skipped = ckpt["step"], ckpt["data_pos"], ckpt.get("skipped", 0)
    run.first_eval, run.first_pass = ckpt.get("first_eval"), ckpt.get("first_pass")
    random.setstate(ckpt["rng_python"])
    torch.set_rng_state(ckpt["rng_torch"])
    rl.gen.set_state(ckpt["rng_sampler"])
    log = run.dir / "metrics.jsonl"
    if log.exists():  # lines logged after the checkpoint would be written twice: drop them
        keep = [l for l in log.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= run.step]
        log.write_text("".join(l + "\n" for l in keep))
    notice(f"resumed {run.dir} at step {run.step}")

def _model_id(model) -> dict:
    c = model.config
    return {"arch": type(model).__name__, "hidden": c.hidden_size, "layers": c.num_hidden_layers,
            "vocab": c.vocab_size, "params": sum(param.numel() for param in model.parameters())}

def save_checkpoint(d: Path, state: dict) -> None:
    """Atomic: ckpt.tmp/ is written, then renamed to ckpt/; a crash at any point leaves a whole ckpt/ or ckpt.old/."""
    tmp, cur, old = d / "ckpt.tmp", d / "ckpt", d / "ckpt.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if cur.exists():
        shutil.rmtree(old, ignore_errors=True)
        cur.rename(old)
    tmp.rename(cur)
    shutil.rmtree(old, ignore_errors=True)

def load_checkpoint(d: Path) -> dict:
    f = next((d / sub / "state.pt" for sub in ("ckpt", "ckpt.old") if (d / sub / "state.pt").is_file()), None)
    if f is None:
        raise QurlError(f"--resume {d}: no checkpoint there")
    return torch.load(f, map_location="cpu", weights_only=False)

def print_progress(run: RunState, m: dict, args: Args) -> None:
    el = time.time() - run.t_start
    eta = el / max(run.step - run.start_step, 1) * (args.steps - run.step)
    ev = f"{run.last_eval:.3f}" if run.last_eval is not None else "-"
    print(f"step {run.step:4d}/{args.steps} reward {m['reward/mean']:.3f} eval {ev} kl {m['mismatch/kl']:.1e} "
          f"flip {m['quant/flip_rate']:.2%} tok/s {m['perf/rollout_tok_s']:.0f} [{el:.0f}s<{eta:.0f}s]", flush=True)

def finish_run(rl: Learner, run: RunState, args: Args) -> dict:
    """final/ (a standard checkpoint), summary.json (torch's thread count too: a seed replays a run only with it)."""
    save_final(run.dir / "final", rl.model, rl.tok, run.s)
    wall = time.time() - run.t_start
    summary = {"start_eval_acc": run.first_eval, "final_eval_acc": run.last_eval, "wall_s": round(wall, 1),
               "rollout_frac": run.rollout_s / max(run.step_s, 1e-9), "steps": args.steps,
               "skipped_updates": run.skipped, "invariant_scale": run.s, "eval_k": args.eval_k,
               "start_pass_at_k": run.first_pass, "final_pass_at_k": run.last_pass,
               "torch_threads": torch.get_num_threads()}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    start_txt = f"{run.first_eval:.3f}" if run.first_eval is not None else "-"
    print(f"done: eval/acc {start_txt} -> {run.last_eval:.3f} in {wall:.0f}s (rollout {summary['rollout_frac']:.0%} "
          f"of step time); run folder {run.dir}", flush=True)
    return summary

def _tracker_module(kind: str | None):
    """The package --track needs, imported only when asked for; a missing one is a one-line error."""
    try:
        if kind == "wandb":
            import wandb
            return wandb
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            return SummaryWriter
    except ImportError:
        raise QurlError(f"--track {kind} needs the {kind} package: pip install {kind} (or drop --track)") from None

@contextlib.contextmanager
def tracking(args: Args, d: Path):
    """--track: a function that sends each metrics.jsonl row to wandb or tensorboard (else does nothing)."""
    module, log, close = _tracker_module(args.track), (lambda m, step: None), (lambda: None)
    if args.track == "wandb":  # a resumed run continues the same wandb run: its id is kept in the run folder
        id_file = d / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else module.util.generate_id()
        id_file.write_text(run_id + "\n")
        run = module.init(project="qurl", name=d.name, id=run_id, resume="allow", dir=str(d),
                          config=dataclasses.asdict(args))
        log, close = lambda m, step: run.log(m, step=step), run.finish
    elif args.track == "tensorboard":
        writer = module(log_dir=str(d / "tensorboard"))
        log, close = lambda m, step: [writer.add_scalar(k, v, step) for k, v in m.items()], writer.close
    try:
        yield lambda m: log({k: v for k, v in m.items() if v is not None and k != "step"}, m["step"])
    finally:
        close()

STOP: set = set()  # the signals received: non-empty once Ctrl-C or SIGTERM asked the loop to stop after this step

@contextlib.contextmanager
def stop_requests():
    """Within this block Ctrl-C and SIGTERM (how clusters and rented GPUs preempt a job) ask the loop to finish the
    step, write a checkpoint and exit; a second signal aborts at once. Outside the main thread: a no-op."""
    import threading
    STOP.clear()
    sigs = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    old = {sig: signal.signal(sig, _request_stop) for sig in sigs}
    try:
        yield STOP
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)

def _request_stop(signum, frame):
    name = signal.Signals(signum).name
    if STOP:  # a second signal: stop now, without a checkpoint of this step
        notice(f"{name} again: aborting now; the last checkpoint written is kept")
        raise SystemExit(128 + signum)
    STOP.add(signum)
    notice(f"{name}: finishing this step, then writing a checkpoint (send it again to abort at once)")


# ============================================ APPENDIX B: tools (memory estimate, dry run, plots) ====================
def estimate_memory(model, rows: int, prompt_len: int, new_tokens: int, micro_batch: int, grad_ckpt: bool,
                    quant: str, dtype: torch.dtype, device_type: str = "cuda", kl: bool = False) -> dict:
    """Estimated peak GiB of a training step's update and of its rollout from the model's shapes (meta-device will
    do). Held: fp32 masters and AdamW's moments (12 B per parameter), the rollout actor, the KL reference. The update
    adds fp32 gradients, autocast's bf16 weight copies, what one micro-batch keeps for backward (per token and layer
    36h + 8i bytes in bf16, 44h + 16i in fp32: Qwen2's saved tensors, counted) and 16 B per response logit. The
    rollout adds the KV cache and one decode step's logits."""
    c = model.config
    h, n_layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv_dim = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    n_par = sum(param.numel() for param in model.parameters())
    n_lin = sum(mod.weight.numel() for _, mod in decoder_linears(model))
    bf16, b = dtype == torch.bfloat16, 2 if dtype == torch.bfloat16 else 4
    actor = 2 * n_par * bf16 if quant == "none" else 4 * (n_par - n_lin) + n_lin * (
        0.5 + 4 / NF4_BLOCK if quant == "nf4" else 1) + 4 * n_lin * (device_type == "cpu" and quant != "int8")
    held = 12 * n_par + actor + 4 * n_par * kl
    mb, T = min(micro_batch, rows), prompt_len + new_tokens
    per_layer = 36 * h + 8 * inter if bf16 else 44 * h + 16 * inter
    acts = mb * T * (8 * h + (n_layers * 4 * h + per_layer if grad_ckpt else n_layers * per_layer))
    logits = 16 * mb * (new_tokens + 1) * vocab
    train = held + 4 * n_par + 2 * (n_lin + vocab * h) * bf16 + acts + logits
    rollout = held + rows * T * n_layers * 2 * kv_dim * b + rows * vocab * (b + 8)
    return {k: v / 2**30 for k, v in dict(train=train, rollout=rollout, held=held, activations=acts,
                                          logits=logits, actor=actor).items()}

def dry_run(args: Args) -> None:
    """Config, model size, data, one prompt and the estimated peak memory, without loading weights (meta device)."""
    device, dtype = resolve_device_dtype(args.dtype)
    model, tok = load_model(args.model, weights=False)
    train_set, test_set = load_data(args)
    P = check_prompt_lengths(model, tok, train_set, args.max_new_tokens)
    rows = args.prompts_per_step * args.group_size
    est = estimate_memory(model, rows, P, args.max_new_tokens, args.micro_batch, args.grad_checkpointing,
                          args.quant, dtype, device.type, args.kl_coef > 0)
    print(json.dumps(dataclasses.asdict(args), indent=1))
    print(f"model {args.model}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters; rollout actor ({args.quant}) {est['actor']:.3g} GiB")
    print(f"estimated peak on {device.type} in {str(dtype)[6:]}: update {est['train']:.3g} GiB (held "
          f"{est['held']:.3g}, activations {est['activations']:.3g}, logits {est['logits']:.3g}), rollout "
          f"{est['rollout']:.3g} GiB; {rows} rows of {P} + {args.max_new_tokens} tokens, --micro-batch "
          f"{args.micro_batch}{' with --grad-checkpointing' if args.grad_checkpointing else ''}")
    print(f"problems: {len(train_set)} train, {len(test_set)} test")
    print(f"one formatted prompt:\n{format_prompt(train_set[0]['question'], tok)}\n(gold: {train_set[0]['gold']})")

def plot_runs(run_dirs: list[str], out: str = "assets/runs.png") -> None:
    """Reward, accuracy, mismatch KL, entropy, clip fraction and flip rate per step of several runs (smoothed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise QurlError("--plot needs matplotlib: pip install matplotlib") from None
    panels = {"reward/mean": "reward (train)", "eval/acc": "held-out accuracy (greedy)", "mismatch/kl":
              "mismatch KL(pi_behav||pi_prox)", "rollout/entropy": "entropy (sampled tokens)", "clip/low":
              "clip/low (gradient zeroed)", "quant/flip_rate": "quant flip rate"}
    fig, axes = plt.subplots(2, 3, figsize=(16, 7.2))
    for rd in run_dirs:
        f, summary = Path(rd) / "metrics.jsonl", Path(rd) / "summary.json"
        if not f.is_file():
            raise QurlError(f"--plot: {f} not found (is {rd} a run folder?)")
        rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
        start = json.loads(summary.read_text()).get("start_eval_acc") if summary.is_file() else None  # the warm start
        for ax, (key, title) in zip(axes.flat, panels.items()):
            pts = [(0, start)] if key == "eval/acc" and start is not None else []
            pts += [(row["step"], max(row[key], 1e-12)) for row in rows if row.get(key) is not None]  # log axis
            win = max(1, len(pts) // 25) if key != "eval/acc" and len(pts) > 20 else 0  # smooth per-step series
            pts = [(x, sum(v for _, v in pts[max(0, i - win):i + 1]) / len(pts[max(0, i - win):i + 1]))
                   for i, (x, _) in enumerate(pts)]
            if pts:
                ax.plot(*zip(*pts), label=Path(rd).name, marker="o" if key == "eval/acc" else None, markersize=3)
            ax.set(title=title, xlabel="step", yscale="log" if key == "mismatch/kl" else "linear")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")

_format_warning = warnings.formatwarning

def main(argv=None) -> None:
    # the method warns with warnings.warn (copyable, filterable); the command line prints them as its other notices
    warnings.formatwarning = lambda msg, cat, file, *rest: (f"qurl: {msg}\n" if file == __file__
                                                             else _format_warning(msg, cat, file, *rest))
    args = parse_args(argv)
    try:
        if args.plot:
            plot_runs(args.plot, args.out)
        elif args.dry_run:
            dry_run(args)
        else:
            train(args)
    except QurlError as e:
        _die(str(e))

if __name__ == "__main__":
    main()
