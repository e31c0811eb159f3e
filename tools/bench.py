"""Benchmarks of qurl.py: developer tools, not the method (they run its functions and time them).

    python tools/bench.py rollout [--model-config SHAPE] [--bench-batch 64,256] [qurl flags]
        tokens/s of every sampler precision (built as in training: from fp32 masters, run under
        autocast), eager and with --compile, and of transformers' model.generate on the same rows
    python tools/bench.py train [--model-config SHAPE] [qurl flags: --quant, --prompts-per-step,
        --group-size, --max-new-tokens, --micro-batch, --grad-checkpointing, --dtype]
        seconds and peak memory of whole RL steps, beside tools/dry_run.py's `estimate_memory`
    python tools/bench.py profile --model-config SHAPE   (CUDA)
        milliseconds per kernel of one compiled decode step
    python tools/bench.py kernels --model-config SHAPE
        kernels per decode token, eager and compiled
    python tools/bench.py gemm --model-config SHAPE [--bench-batch 64,256,1024]
        milliseconds of each decode GEMM, bf16 and every FP8 way (row-wise, fast accumulation,
        tensor-wise with the scales after, operands swapped, inductor-tuned), fused and separate

--model-config builds a published architecture with random weights (no download); --out FILE appends
each row as a JSON line; the other flags are qurl.py's. On a CPU, run `train` with
MALLOC_MMAP_THRESHOLD_=131072 so that freed memory leaves the resident set that is measured.
"""

import argparse
import contextlib
import json
import random
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(Path(__file__).resolve().parent)]
import torch  # noqa: E402

import qurl  # noqa: E402
from dry_run import estimate_memory  # noqa: E402
from qurl import (  # noqa: E402
    Args,
    Learner,
    QurlError,
    check_prompt_lengths,
    format_prompt,
    load_model,
    load_problems,
    make_sampler,
    parse_args,
    prepare_actor,
    resolve_device_dtype,
    sample,
    train_step,
)

# Published architectures (config.json of each hub model), built with random weights: model_type,
# hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings (+ head_dim if it differs)
MODEL_CONFIGS = {
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 3072, 151936, True, 128),
    "qwen2-h512-l8": ("qwen2", 512, 8, 8, 2, 2048, 151936, True),
}


def _bench_model(args: Args, opts, device):
    """fp32 masters of --model, or of a published architecture with random weights (and the tiny
    tokenizer)."""
    if not opts.model_config:
        return load_model(args.model, device, torch.float32)
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, h, n_layers, heads, kv, inter, vocab, tied, *head_dim = MODEL_CONFIGS[opts.model_config]
    shape = dict(hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=heads)
    shape |= dict(num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab)
    shape |= {"head_dim": head_dim[0]} if head_dim else {}
    cfg = AutoConfig.for_model(kind, **shape, tie_word_embeddings=tied,
                               max_position_embeddings=32768, rope_theta=1e6)
    torch.manual_seed(0)
    # initialized where it runs: a 7B model's random init on a CPU takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model, load_model(str(HERE / "data/tiny-qwen"))[1]


def _timed(fn, device, runs=3) -> tuple[float, object]:
    """Median seconds of `runs` calls of fn (after one warm-up call), and the last result."""
    times, out = [], None
    for i in range(runs + 1):
        seconds, out = _clocked(fn, device)
        times += [seconds] if i else []
    return sorted(times)[len(times) // 2], out


def _clocked(fn, device) -> tuple[float, object]:
    """The seconds of one call of fn, the device synced before and after, and its result."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _report(row: dict, device, out: str | None = None) -> dict:
    """Name the device, print the row as key=value pairs, append it as a JSON line to `out`."""
    row = {
        "device": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu x{torch.get_num_threads()}"
        ),
        **row,
    }
    print(
        " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
        flush=True,
    )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def bench_rollout(args: Args, opts) -> list[dict]:
    """Rollout tokens/s of each sampler precision in --precisions, as in training (built from
    fp32 masters, run under autocast, or a half copy without), for each --bench-batch: eager
    (`sample`) and, with --compile, compiled (`compiled_sample`; its first call, compilation and
    graph capture included, is compile_s); the seconds of a weight sync (sync_s); and
    transformers' model.generate on the bf16 copy, the same rows. EOS ignored: every row samples
    --max-new-tokens tokens, as random weights would stop at random."""
    device, dtype = resolve_device_dtype(args.dtype)
    model, tok = _bench_model(args, opts, device)
    problems, rows = load_problems(args.test_data, "test"), []
    for fmt in opts.precisions.split(","):
        sampler = make_sampler(model, fmt, dtype)
        sync_s, _ = _timed(lambda: qurl.sync_weights(sampler, model), device, opts.runs)
        for batch in (int(b) for b in opts.bench_batch.split(",")):
            prompts = [
                format_prompt(problems[i % len(problems)]["question"], tok) for i in range(batch)
            ]
            gen, n = torch.Generator(device=device).manual_seed(args.seed), args.max_new_tokens
            row = {
                "model": opts.model_config or Path(args.model).name,
                "quant": fmt,
                "dtype": str(dtype)[6:],
                "batch": batch,
                "len": n,
                "sync_s": sync_s,
            }
            _memory(device, reset=True)
            with qurl.rollout_autocast(fmt, device, dtype):
                if not opts.no_eager:
                    t, _ = _timed(
                        lambda: sample(sampler, tok, prompts, 1, n, generator=gen),
                        device,
                        opts.runs,
                    )
                    row["tok_s"] = batch * n / t
                if args.compile:
                    row["compile_s"], _ = _clocked(  # the first call compiles
                        lambda: qurl.compiled_sample(sampler, tok, prompts, 1, n, generator=gen),
                        device,
                    )
                    t, _ = _timed(
                        lambda: qurl.compiled_sample(sampler, tok, prompts, 1, n, generator=gen),
                        device,
                        opts.runs,
                    )
                    row["compiled_tok_s"] = batch * n / t
                    row["compiled"] = None not in qurl.DECODERS.get(sampler, {None: None}).values()
                    with _rollout_parts(device) as parts:  # one more rollout, synced in parts
                        qurl.compiled_sample(sampler, tok, prompts, 1, n, generator=gen)
                    row |= parts
                    row["step_ms"] = 1e3 * parts["decode_s"] / max(n - 1, 1)
                    if opts.model_config:  # beside the H200's limit at the mean context
                        P = check_prompt_lengths(model, tok, problems[:batch], n)
                        row["limit_step_ms_h200"] = step_limit_ms(opts.model_config, batch,
                                                                  P + n / 2, fmt)
                if fmt == "bf16" and not opts.no_eager:  # transformers' own loop on the same rows
                    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
                    t, _ = _timed(
                        lambda: sampler.generate(
                            **enc,
                            do_sample=True,
                            top_k=0,
                            max_new_tokens=n,
                            min_new_tokens=n,
                            pad_token_id=tok.pad_token_id,
                        ),
                        device,
                        opts.runs,
                    )
                    row["generate_tok_s"] = batch * n / t
            row["peak_gib"] = _memory(device) / 2**30
            rows.append(_report(row, device, opts.out))
        sampler = None  # (not del: the lambdas above name it)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _rollout_parts(device):
    """The seconds of a compiled rollout in this block, in parts: prefill_s (the prompts through
    the compiled layers, their K, V copied to each group's rows, the first tokens), finish_s
    (bookkeeping: `_finish`'s masks and texts) and decode_s (the rest: the steps, tokenizing)."""
    real_prefill, real_finish, parts = qurl.StaticDecoder.prefill, qurl._finish, {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            spent, out = _clocked(lambda: fn(*a, **kw), device)
            parts[name] = parts.get(name, 0.0) + spent
            return out
        return wrapper

    qurl.StaticDecoder.prefill = timed("prefill_s", real_prefill)
    qurl._finish = timed("finish_s", real_finish)
    _sync(device)
    start = time.perf_counter()
    try:
        yield parts
        _sync(device)
        total = time.perf_counter() - start
        parts["decode_s"] = total - parts.get("prefill_s", 0.0) - parts.get("finish_s", 0.0)
    finally:
        qurl.StaticDecoder.prefill, qurl._finish = real_prefill, real_finish


def bench_profile(args: Args, opts) -> list[dict]:
    """GPU time of one compiled decode step (without its graph replay, so each kernel is seen)
    per sampler precision, from torch.profiler: milliseconds in GEMMs, in attention and in
    everything else, and the top kernels; it says where a quantized step's time goes."""
    device, dtype = resolve_device_dtype(args.dtype)
    model, tok = _bench_model(args, opts, device)
    problems, rows = load_problems(args.test_data, "test"), []
    batch = int(opts.bench_batch.split(",")[0])
    prompts = [format_prompt(problems[i % len(problems)]["question"], tok) for i in range(batch)]
    for fmt in opts.precisions.split(","):
        sampler = make_sampler(model, fmt, dtype)
        with qurl.rollout_autocast(fmt, device, dtype), torch.no_grad():
            qurl.compiled_sample(sampler, tok, prompts, 1, args.max_new_tokens)
            decoder = next(iter(qurl.DECODERS[sampler].values()))
            # the first decode step's inputs, run again and again (it rewrites one cache column)
            long = {"dtype": torch.long, "device": device}
            column = torch.full((1,), decoder.prompt_len, **long)
            inputs = (torch.zeros(batch, **long), column, torch.full((batch,), -1, **long),
                      torch.full((batch,), args.max_new_tokens, **long),
                      torch.zeros(batch, dtype=torch.bool, device=device))  # token .. done
            decoder.decode_one_token(sampler, *inputs)
            _sync(device)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(opts.runs):
                    decoder.decode_one_token(sampler, *inputs)
                _sync(device)
        kernels = sorted(
            (
                (getattr(e, "device_time_total", 0) / opts.runs / 1e3, e.key)
                for e in prof.key_averages()
            ),
            reverse=True,
        )

        def kind(name: str) -> str:
            """cuBLASLt's Hopper GEMMs are "nvjet_*"; triton kernels are fused glue."""
            name = name.lower()
            gemm = any(w in name for w in ("nvjet", "gemm", "cutlass", "xmma"))
            if gemm and not name.startswith("triton"):
                return "gemm"
            attention = any(w in name for w in ("attention", "fmha", "flash", "sdpa"))
            return "attention" if attention else "other"

        row = {
            "model": opts.model_config or Path(args.model).name,
            "quant": fmt,
            "batch": batch,
            **{
                f"{k}_ms": sum(ms for ms, name in kernels if kind(name) == k)
                for k in ("gemm", "attention", "other")
            },
            "top": [(name[:60], round(ms, 3)) for ms, name in kernels[:8]],
        }
        rows.append(_report(row, device, opts.out))
        del sampler, decoder
        torch.cuda.empty_cache()
    return rows


def bench_kernels(args: Args, opts) -> list[dict]:
    """Kernels launched per decode token by each sampler precision, counted on the CPU with the
    CUDA branches forced (FP8 through torch._scaled_mm): eager, the aten ops `sample` dispatches
    for one more token (views, which launch nothing, aside); compiled, the kernel calls in
    inductor's code for a step: the decoder layer's graph times the layers, the other graphs once
    (a step runs nothing eagerly but the loop over layers)."""
    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            returns = func._schema.returns  # a view returns an alias it does not write: no kernel
            view = (
                bool(returns)
                and returns[0].alias_info is not None
                and not returns[0].alias_info.is_write
            )
            self.n += not view and func.__name__.split(".")[0] not in (
                "empty",
                "empty_strided",
                "_local_scalar_dense",
            )
            return func(*args, **(kwargs or {}))

    device, dtype = resolve_device_dtype(args.dtype)
    model, tok = _bench_model(args, opts, device)
    problems, rows = load_problems(args.test_data, "test"), []
    prompts = [
        format_prompt(problems[i]["question"], tok)
        for i in range(int(opts.bench_batch.split(",")[0]))
    ]
    for fmt in opts.precisions.split(","):
        sampler = make_sampler(model, fmt, dtype)
        for module in sampler.modules():
            if isinstance(module, qurl.QuantLinear) and module.fmt == "fp8":
                module.kernel, module.weight_deq = "scaled_mm", None
        counts = []
        with qurl.rollout_autocast(fmt, device, dtype), torch.no_grad():
            for n in (2, 3):
                with Count() as count:
                    sample(sampler, tok, prompts, 1, n, 1.0, torch.Generator().manual_seed(0))
                counts.append(count.n)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            _, codes = run_and_get_code(
                lambda: qurl.compiled_sample(
                    sampler, tok, prompts, 1, 4, 1.0, torch.Generator().manual_seed(0)
                )
            )
        layers = len(sampler.model.layers)
        call = re.compile(
            r"^\s+(?:\w+ = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.[\w.]+|"
            r"torch\.ops\.[\w.]+)\(",
            re.M,
        )
        calls = [len(call.findall(code[code.find("def call(") :])) for code in codes]
        # in the order they compile: the prefill's embed and layer graphs, the draw (the prefill's
        # and each decode step's), the decode step's embed and layer graphs; a layer graph runs
        # once per layer
        assert len(codes) == 5 and all("scaled_dot_product" in codes[i] for i in (1, 4)), calls
        embed, layer, draw, step_embed, step_layer = calls
        row = {
            "model": opts.model_config or Path(args.model).name,
            "quant": fmt,
            "eager_kernels_per_token": counts[1] - counts[0],
            "compiled_kernels_per_token": step_embed + step_layer * layers + draw,
            "compiled_layer_kernels": step_layer,
            "compiled_prefill_kernels": embed + layer * layers + draw,
            "compiled_graphs": len(codes),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        }
        rows.append(_report(row, device, opts.out))
    return rows


# H200 (SXM): HBM bandwidth and dense tensor-core peaks, for the roofline columns
H200_BYTES_S, H200_FLOPS = 4.8e12, {"bf16": 989e12, "fp8": 1979e12}


def roofline_ms(nbytes: float, flops: float, flops_s: float = H200_FLOPS["bf16"]) -> float:
    """The H200's floor on a kernel: its bytes over the bandwidth or its flops over the peak."""
    return 1e3 * max(nbytes / H200_BYTES_S, flops / flops_s)


def decode_linears(config_name: str) -> dict[str, tuple[int, int]]:
    """(K, N) of a decoder layer's linears at a published shape, and of the fused ones a sampler
    may hold instead (q/k/v one linear, gate/up one linear)."""
    _, h, _, heads, kv, inter, _, _, *head_dim = MODEL_CONFIGS[config_name]
    d = head_dim[0] if head_dim else h // heads
    return {"q": (h, heads * d), "k": (h, kv * d), "v": (h, kv * d), "o": (heads * d, h),
            "gate": (h, inter), "up": (h, inter), "down": (inter, h),
            "qkv": (h, (heads + 2 * kv) * d), "gate_up": (h, 2 * inter)}


def step_limit_ms(config_name: str, rows: int, context: float, quant: str) -> float:
    """The H200's physical limit on one decode step of `rows` rows at a published shape, each
    reading `context` cached tokens: for the decoder linears, the bf16 lm_head and attention, the
    larger of bytes over bandwidth and flops over the dense peak, summed (they run one after the
    other). Weights: 1 byte (FP8, INT8: their GEMMs at the 8-bit peak), 0.5 + 4/64 (NF4, computed
    in bf16), 2 (bf16, fp16), 4 (the fp32 actor under bf16 autocast); the KV cache in bf16."""
    _, h, layers, heads, kv, _, vocab, _, *head_dim = MODEL_CONFIGS[config_name]
    d = head_dim[0] if head_dim else h // heads
    linears = decode_linears(config_name)
    separate = [shape for name, shape in linears.items() if name not in ("qkv", "gate_up")]
    params = layers * sum(K * N for K, N in separate)
    weight_bytes = {"fp8": 1, "int8": 1, "nf4": 0.5 + 4 / 64, "none": 4}.get(quant, 2)
    peak = H200_FLOPS["fp8" if quant in ("fp8", "int8") else "bf16"]
    kv_bytes = layers * 2 * rows * kv * d * context * 2
    return (roofline_ms(params * weight_bytes, 2 * rows * params, peak)  # the decoder linears
            + roofline_ms(2 * vocab * h, 2 * rows * vocab * h)  # lm_head
            + roofline_ms(kv_bytes, 4 * rows * layers * heads * d * context))  # attention


def gemm_variants(x, w, device, tune: bool = False) -> dict:
    """One decode GEMM y = x W^T, (M, K) activations, (N, K) weights, each way qurl could run it
    in FP8, beside bf16. The FP8 ones include quantizing the activations per token (as the sampler
    does at every call); each returns the (M, N) product (bf16 on CUDA), but fp8_act_quant_only,
    the activation codes."""
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    w8, w_scale = qurl.quantize_fp8(w)
    w8t, w_scale_row = w8.t(), w_scale[None, :]
    one = torch.ones((), device=device)
    out = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rowwise(fast=False):
        x8, x_scale = qurl.quantize_fp8(x)
        return torch._scaled_mm(x8, w8t, x_scale[:, None], w_scale_row, out_dtype=out,
                                use_fast_accum=fast)

    def tensorwise():  # unit scales in the GEMM, the row and channel scales after it
        x8, x_scale = qurl.quantize_fp8(x)
        y = torch._scaled_mm(x8, w8t, one, one, out_dtype=torch.float32)
        return (y * x_scale[:, None] * w_scale_row).to(out)

    def swapped():  # (W x^T)^T: N, the large side, fills the kernel's row tiles
        x8, x_scale = qurl.quantize_fp8(x)
        y = torch._scaled_mm(w8, x8.t(), w_scale[:, None], x_scale[None, :], out_dtype=out)
        return y.t()

    def quantize_only():
        return qurl.quantize_fp8(x)[0]

    variants = {"bf16": lambda: xb @ wb.t(), "fp8_rowwise": rowwise,
                "fp8_rowwise_fast_accum": lambda: rowwise(True), "fp8_tensorwise": tensorwise,
                "fp8_swapped": swapped, "fp8_act_quant_only": quantize_only}
    if tune:  # inductor's scaled-mm templates, autotuned at this shape (minutes: one M only)
        variants["fp8_inductor"] = torch.compile(rowwise, mode="max-autotune-no-cudagraphs",
                                                 dynamic=False)
    return variants


def _gemm_ms(fn, device, runs: int) -> tuple[float, object]:
    """Milliseconds per call of `runs` calls back to back (CUDA events: a launch's host time hides
    behind the previous call, as in a captured decode step), after a warm-up; the last output. On
    a CPU, `_timed`'s median."""
    if device.type != "cuda":
        seconds, out = _timed(fn, device, runs)
        return seconds * 1e3, out
    out = fn()  # the warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync(device)
    start.record()
    for _ in range(runs):
        out = fn()
    end.record()
    _sync(device)
    return start.elapsed_time(end) / runs, out


def _kernel_name(fn, device) -> str:
    """The longest kernel of one call (CUDA), or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    events = [(getattr(e, "device_time_total", 0), e.key) for e in prof.key_averages()]
    return max(events)[1][:70] if events else "?"


def bench_gemm(args: Args, opts) -> list[dict]:
    """Milliseconds of each decode GEMM of --model-config (the 7 linears of a layer and the fused
    qkv, gate_up) at each --bench-batch row count, every way of `gemm_variants`, with the kernel it
    ran, its error against fp64, and the H200 roofline (bytes over bandwidth, flops over the dense
    peak)."""
    device, _ = resolve_device_dtype(args.dtype)
    rows = []
    for M in map(int, opts.bench_batch.split(",")):
        for name, (K, N) in decode_linears(opts.model_config).items():
            gen = torch.Generator(device=device).manual_seed(M * 7 + N)
            x = torch.randn(M, K, device=device, generator=gen)
            w = torch.randn(N, K, device=device, generator=gen) / K**0.5
            ref = x.double() @ w.double().t()
            tune = device.type == "cuda" and M == 256
            for variant, fn in gemm_variants(x, w, device, tune).items():
                row = {"model": opts.model_config, "linear": name, "M": M, "K": K, "N": N,
                       "variant": variant}
                try:
                    row["ms"], y = _gemm_ms(fn, device, opts.runs)
                except Exception as e:  # noqa: BLE001 (a variant this build or device lacks)
                    rows.append(_report(row | {"error": f"{type(e).__name__}: {e}"[:120]},
                                        device, opts.out))
                    continue
                row["kernel"] = _kernel_name(fn, device)
                if "quant" not in variant:
                    row["rel_err"] = float((y.double() - ref).norm() / ref.norm())
                fp8 = variant.startswith("fp8")
                weight_bytes = K * N * (1 if fp8 else 2)
                bytes_moved = weight_bytes + M * K * (1 if fp8 else 2) + 2 * M * N
                flops = 2 * M * N * K
                row["roofline_ms_h200"] = roofline_ms(bytes_moved, flops,
                                                      H200_FLOPS["fp8" if fp8 else "bf16"])
                rows.append(_report(row, device, opts.out))
    return rows


@contextlib.contextmanager
def random_rewards(seed: int):
    """In this block qurl's reward is a fair coin, so that random weights (or a model that gets
    every answer wrong) still update: a group of equal rewards would not. Restored after."""
    coin, real = random.Random(seed), qurl.reward
    qurl.reward = lambda text, gold: float(coin.random() < 0.5)
    try:
        yield
    finally:
        qurl.reward = real


@contextlib.contextmanager
def _step_parts(device):
    """In this block qurl's sync, decode, log-prob and update functions, as train_step calls them,
    add their seconds to the dict it yields: no-grad log-probs are pi_prox's forwards (taken out of
    the update's time when the update runs them), log-probs with grad the update's own. The real
    functions come back after."""
    parts = {"sync_weights": "sync_s", "sample": "rollout_s", "compiled_sample": "rollout_s",
             "batch_logprobs": "prox_s", "update": "update_s"}
    real = {name: getattr(qurl, name) for name in parts}
    seconds = dict.fromkeys(parts.values(), 0.0)
    updating = []

    def timed(name):
        def wrapper(*a, **kw):
            if name == "batch_logprobs" and torch.is_grad_enabled():  # a training forward
                return real[name](*a, **kw)
            updating.append(name == "update")
            try:
                spent, out = _clocked(lambda: real[name](*a, **kw), device)
            finally:
                updating.pop()
            seconds[parts[name]] += spent
            if name == "batch_logprobs" and any(updating):
                seconds["update_s"] -= spent
            return out
        return wrapper

    for name in parts:
        setattr(qurl, name, timed(name))
    try:
        yield seconds
    finally:
        for name, fn in real.items():
            setattr(qurl, name, fn)


def bench_train(args: Args, opts) -> dict:
    """Whole RL steps at the real sizes: a warm-up (it allocates AdamW's state), a rollout alone,
    then BENCH_RUNS steps of train_step with --prompts-per-step x --group-size rows of
    --max-new-tokens tokens (EOS ignored: random weights stop at random) and random 0/1 rewards.
    Reports the median seconds per step, rollout tokens/s, and the peak memory of the rollout and
    of a whole step beside `estimate_memory`'s (CPU: resident memory above what the process held
    before the model)."""
    device, dtype = resolve_device_dtype(args.dtype)
    base = _memory(device, reset=True)
    model, tok = _bench_model(args, opts, device)
    prepare_actor(model.train(), args.grad_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rl = Learner(model, optimizer, make_sampler(model, args.quant, dtype), tok, generator, dtype)
    problems = load_problems(args.test_data, "test")[: args.prompts_per_step]
    prompts = [format_prompt(p["question"], tok) for p in problems]
    times, tok_s = [], []
    with random_rewards(args.seed), _step_parts(device) as parts:  # random weights: random rewards
        for step in range(opts.runs + 1):
            if step == 1:
                _memory(device, reset=True)
                decode = qurl.compiled_sample if args.compile else sample
                with qurl.rollout_autocast(args.quant, device, dtype):
                    decode(rl.sampler, tok, prompts, args.group_size, args.max_new_tokens,
                           generator=rl.generator)
                roll_peak = _memory(device) - base
                _memory(device, reset=True)
                parts.update(dict.fromkeys(parts, 0.0))  # each timed step's parts from here
            m = train_step(rl, args, problems, step)
            if step > 0:  # step 0 warms up
                times.append(m["perf/step_s"])
                tok_s.append(m["perf/rollout_tok_s"])
    step_peak = _memory(device) - base
    P = check_prompt_lengths(model, tok, problems, args.max_new_tokens)
    sizes = len(prompts) * args.group_size, P, args.max_new_tokens, args.micro_batch
    kept = args.align_forward and args.mini_batches * args.ppo_epochs > 1
    est = estimate_memory(model, *sizes, args.grad_checkpointing, args.quant, dtype, device.type,
                          args.compile, kept)
    return _report(
        {
            "model": opts.model_config or Path(args.model).name,
            "quant": args.quant,
            "dtype": str(dtype)[6:],
            "rows": len(prompts) * args.group_size,
            "prompt_len": P,
            "new_tokens": args.max_new_tokens,
            "micro_batch": args.micro_batch,
            "grad_ckpt": args.grad_checkpointing,
            "step_s": sorted(times)[len(times) // 2],
            **{key: value / len(times) for key, value in parts.items()},  # the mean step's parts
            "tok_s": sorted(tok_s)[len(tok_s) // 2],
            "rollout_peak_gib": roll_peak / 2**30,
            "rollout_est_gib": est["rollout"],
            "step_peak_gib": step_peak / 2**30,
            "step_est_gib": max(est["train"], est["rollout"]),
        },
        device,
        opts.out,
    )


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _memory(device, reset: bool = False) -> float:
    """Peak bytes since the last reset (CUDA: allocated tensors; CPU: resident memory, Linux);
    reset=True starts a new window and returns the bytes held now."""
    _sync(device)
    if device.type == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return float(torch.cuda.memory_allocated() if reset else torch.cuda.max_memory_allocated())
    if reset:
        # resets the resident-memory high-water mark (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    status = dict(
        l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l
    )
    return float(status["VmRSS" if reset else "VmHWM"].split()[0]) * 1024


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="tools/bench.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("mode", choices=["rollout", "train", "profile", "kernels", "gemm"])
    parser.add_argument(
        "--model-config", choices=list(MODEL_CONFIGS), help="a published shape, random weights"
    )
    parser.add_argument(
        "--bench-batch", default="128", help="rows per rollout batch, comma separated"
    )
    parser.add_argument("--out", help="also append each row as a JSON line to this file")
    parser.add_argument(
        "--precisions", default="none,fp16,bf16,int8,fp8,nf4", help="rollout: the samplers"
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed repetitions after one warm-up (the median)"
    )
    parser.add_argument("--no-eager", action="store_true", help="rollout: only the compiled decode")
    opts, rest = parser.parse_known_args(argv)
    # EOS ignored: every row samples --max-new-tokens tokens
    qurl.stop_token_ids = lambda model, tokenizer: []
    if not all(b.strip().isdigit() and int(b) > 0 for b in opts.bench_batch.split(",")):
        parser.error(
            f"--bench-batch must be positive integers separated by commas, got '{opts.bench_batch}'"
        )
    try:
        modes = {
            "train": bench_train,
            "rollout": bench_rollout,
            "profile": bench_profile,
            "kernels": bench_kernels,
            "gemm": bench_gemm,
        }
        modes[opts.mode](parse_args(rest), opts)
    except QurlError as e:
        sys.exit(f"bench: error: {e}")


if __name__ == "__main__":
    main()
