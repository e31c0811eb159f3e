"""Tests for qurl.py: offline, on the tiny model in data/, the whole suite in a few minutes on 2
CPU cores.

Numbers are checked against independent references: teacher-forced log-probs, model.generate, a
plain fp32 nn.Linear, hand-computed loss values and the recorded warm-up accuracy."""
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qurl  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY = str(HERE / "data" / "tiny-qwen")
TEST = str(HERE / "data" / "arith_test.jsonl")
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)"
)


@functools.cache
def _train_head(n=512):
    """The first n training problems as a file, for short runs: a run checks every prompt's length
    before it starts, about 2 s for all 20,000 on 2 cores."""
    path = Path(tempfile.mkdtemp()) / f"arith_train_{n}.jsonl"
    lines = (HERE / "data" / "arith_train.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:n]))
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    model, tok = qurl.load_model(TINY, "cpu", torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def problems():
    return qurl.load_problems(TEST)


@pytest.fixture(autouse=True)
def _checkpoint_every_step(monkeypatch):
    """Small runs write a checkpoint and a progress line at every step (the resume tests need
    checkpoints)."""
    monkeypatch.setattr(qurl, "SAVE_EVERY", 1)
    monkeypatch.setattr(qurl, "LOG_EVERY", 1)


def run_cli(*argv, fresh=False, wait=True, **env_extra):
    """`python qurl.py ARGV`: in this process through qurl.main (fast), or with fresh=True (or an
    environment variable to set) in a new process: the real entry point, its own peak memory, and
    every library's log line on its stderr (in this process a library's log handler keeps the
    stream it was created with). wait=False: the process started, a function that waits for its
    result (several at once: a new process spends ~5-10 s importing, on one core)."""
    if fresh or env_extra:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env_extra)
        process = subprocess.Popen([sys.executable, str(HERE / "qurl.py"), *argv], cwd=HERE,
                                   env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)

        def result():
            try:
                out, err = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:  # as subprocess.run does: none left behind
                process.kill()
                process.wait()
                raise
            return subprocess.CompletedProcess(argv, process.returncode, out, err)
        return result() if wait else result
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            qurl.main(list(argv))
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def assert_one_line_error(res, *needles):
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.startswith("qurl: error")]
    assert len(lines) == 1, res.stderr
    # no library's log lines
    assert all(l.startswith("qurl: ") for l in res.stderr.strip().splitlines()), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]

# ==================================================================================================
# The method, 1: the loop and one RL step (end to end, evaluation)
# ==================================================================================================
def _small_args(tmp_path, **kw):
    base = dict(
        train_data=_train_head(),
        steps=2,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=24,
        eval_every=2,
        eval_size=20,
        out_dir=str(tmp_path),
    )
    base.update(kw)
    return qurl.Args(**base)


@pytest.mark.parametrize(
    "quant,loss,extra",
    [
        ("none", "tis", {}),
        ("int8", "acr", {}),
        ("fp8", "acr", {}),
        ("fp8", "naive", {}),
        ("fp8", "tis", {}),
        ("fp8", "tbpo", {}),
        ("fp8", "tbpo", {"align_forward": True}),
        ("nf4", "naive", {}),
        ("nf4", "tbpo", {"align_forward": True, "mini_batches": 2, "dtype": "bfloat16"}),
        ("int8", "acr", {"ppo_epochs": 2, "mini_batches": 2, "lr": 1e-3}),
    ],
)
def test_end_to_end(tmp_path, tiny, quant, loss, extra):
    args = _small_args(tmp_path, quant=quant, loss=loss, run_name="r", **extra)
    qurl.train(args)
    rows = [json.loads(l) for l in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # every metric, and only those
        assert set(r) == set(qurl.METRIC_KEYS), set(r) ^ set(qurl.METRIC_KEYS)
        assert all(v is None or math.isfinite(v) for v in r.values())
    assert rows[-1]["eval/acc"] is not None
    # cosine, 2 steps: cos(0), cos(pi/2)
    assert [r["opt/lr"] for r in rows] == pytest.approx([args.lr, args.lr / 2])
    final = torch.load(tmp_path / "r/ckpt.pt", weights_only=False)["actor"]
    init = tiny[0].state_dict()
    assert any(not torch.equal(final[k], init[k]) for k in init)  # the weights moved
    if quant != "none":
        # synced before each rollout
        assert rows[0]["quant/flip_rate"] == 0.0 and rows[1]["quant/flip_rate"] > 0


@CUDA
@pytest.mark.parametrize("quant", ["fp8", "int8", "nf4", "none"])
def test_cuda_two_step_rl(tmp_path, quant):
    qurl.train(_small_args(tmp_path, run_name="c", quant=quant))
    rows = [json.loads(l) for l in (tmp_path / "c/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(v is None or math.isfinite(v) for r in rows for v in r.values())


def test_bf16_keeps_small_updates_and_final_is_a_standard_checkpoint(tmp_path, tiny, problems):
    """bf16 compute on fp32 masters: lr 1e-6 moves nearly every weight (bf16 parameters would
    keep ~98 % of them), and final/ is an fp32 model on the original scale (invariant scaling
    folded back) with the actor's function."""
    from transformers import AutoModelForCausalLM
    kw = dict(quant="fp8", dtype="bfloat16", lr=1e-6, lr_schedule="constant", eval_every=100)
    qurl.train(_small_args(tmp_path, run_name="b3", steps=3, **kw))
    qurl.train(_small_args(tmp_path, run_name="b0", steps=0, **kw))
    f3, f0 = (AutoModelForCausalLM.from_pretrained(tmp_path / n / "final") for n in ("b3", "b0"))
    dec = [n for n, _ in f3.named_parameters() if ".layers." in n and n.endswith("proj.weight")]
    p3, p0 = dict(f3.named_parameters()), dict(f0.named_parameters())
    moved = sum(int((p3[n] != p0[n]).sum()) for n in dec) / sum(p3[n].numel() for n in dec)
    assert moved >= 0.9 and p3[dec[0]].dtype == torch.float32, moved
    orig = dict(tiny[0].named_parameters())
    for n in (
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ):
        assert _rel_err(p3[n].detach(), orig[n].detach()) < 0.01  # original scale, not 1.5x
    # the training actor: scaled, at the last step
    actor = qurl.load_model(TINY, "cpu", torch.float32)[0]
    qurl.invariant_rescale(actor, 1.5)
    actor.load_state_dict(torch.load(tmp_path / "b3/ckpt.pt", weights_only=False)["actor"])
    enc = tiny[1](
        [qurl.format_prompt(p["question"], tiny[1]) for p in problems[:8]],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        assert _rel_err(f3(**enc).logits, actor(**enc).logits) < 1e-5


def test_non_finite_updates_are_skipped(tmp_path, tiny, monkeypatch):
    """A non-finite loss never reaches the weights: the update is skipped and counted."""
    real = qurl.token_loss

    def nan_loss(*a, **k):
        loss, m = real(*a, **k)
        return loss * float("nan"), m
    monkeypatch.setattr(qurl, "token_loss", nan_loss)
    qurl.train(_small_args(tmp_path, run_name="nan", steps=3, quant="none", prompts_per_step=8))
    rows = _metrics(tmp_path / "nan/metrics.jsonl")
    assert [row["guard/skipped"] for row in rows] == [1, 2, 3]
    state = torch.load(tmp_path / "nan/ckpt.pt", weights_only=False)
    init = tiny[0].state_dict()
    assert state["step"] == 3 and all(torch.equal(state["actor"][k], init[k]) for k in init)


def test_evaluate_reproduces_warmup_record(tiny, problems):
    model, tok = tiny
    rec = json.loads((HERE / "data/tiny-qwen/warmup.json").read_text())
    acc = qurl.evaluate(model, tok, problems, max_new_tokens=rec["max_new_tokens"], batch_size=100)
    assert abs(acc - rec["heldout_acc_500"]) <= 2 / 500, (acc, rec["heldout_acc_500"])


# ==================================================================================================
# The method, 2: the sampler (against bitsandbytes' own dequantize, a hand NF4 table and a plain
# fp32 linear; the aligned forward's quantizer)
# ==================================================================================================
def quant_bytes(q_model) -> tuple[int, int]:
    """(bytes of weight codes + their scales (row scales, or NF4's block absmax), weights they
    replace)."""
    qls = [mod for mod in q_model.modules() if isinstance(mod, qurl.QuantLinear)]
    codes = sum(
        q.weight_q.numel() * q.weight_q.element_size() + q.weight_scale.numel() * 4 for q in qls
    )
    return codes, sum(q.in_features * q.out_features for q in qls)


def _realistic_linear(K=512, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.02)
        lin.bias.copy_(torch.randn(N, generator=g) * 0.01)
    x = torch.randn(64, K, generator=g)
    x[:, :4] *= 8.0  # a few outlier channels, as in real activations
    return lin, x


def _rel_err(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


# Bounds (relative Frobenius error of the output, excluding the exact bias):
#  FP8 e4m3: 3 mantissa bits, so round-to-nearest leaves a relative error uniform within +-2^-4 of
# the binade base,
#  RMS about 2^-4/sqrt(3) * 0.75 ~ 2.7 % per factor; weight and activation errors add in quadrature:
# ~3.8 %. Bound 5 %.
#  INT8 absmax: step = absmax/127, RMS error step/sqrt(12); a Gaussian row of 512 has absmax ~3.3
# sigma, so ~0.75 %
#  per factor of the typical entry; activation outlier channels raise the activation step (absmax
# ~8x3 sigma):
#  ~2 %, in quadrature ~2.2 %. Bound 3 %. Each also has a floor: no quantization at all would fail
# it.
@pytest.mark.parametrize("fmt,bound,floor", [("fp8", 0.05, 0.005), ("int8", 0.03, 0.002)])
def test_quantlinear_vs_fp32(fmt, bound, floor):
    """`QuantLinear` (through `fp8_matmul`, `int8_matmul`) against a plain fp32 linear."""
    lin, x = _realistic_linear()
    ref = lin(x)
    q = qurl.QuantLinear(lin, fmt)
    y = q(x)
    err = _rel_err(y - lin.bias, ref - lin.bias)
    assert floor < err < bound, err
    assert q.weight_q.element_size() == 1


def _fp8(lin, kernel):
    q = qurl.QuantLinear(lin, "fp8")
    q.kernel = kernel
    return q


def test_fp8_matmul_scaled_mm_and_emulation_agree():
    lin, x = _realistic_linear()
    a, b = _fp8(lin, "scaled_mm"), qurl.QuantLinear(lin, "fp8")
    assert b.kernel == "emulate"  # the CPU's choice: the faster one here
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)
    b.weight_deq = None  # the per-call dequantization (CUDA without _scaled_mm) is the same math
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)
    c = qurl.QuantLinear(lin, "fp8")  # the cached dequantized weights follow a weight sync
    with torch.no_grad():
        lin.weight.mul_(-0.5)
    c.load_weight(lin.weight)
    torch.testing.assert_close(c(x), _fp8(lin, "scaled_mm")(x), rtol=1e-5, atol=1e-6)


@CUDA
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_cuda_quantlinear_matches_cpu_reference(fmt):
    lin, x = _realistic_linear()
    ref = qurl.QuantLinear(lin, fmt)(x)                      # CPU, fp32: the reference math
    lin_c = torch.nn.Linear(lin.in_features, lin.out_features).cuda().to(torch.bfloat16)
    with torch.no_grad():
        lin_c.weight.copy_(lin.weight)
        lin_c.bias.copy_(lin.bias)
    q = qurl.QuantLinear(lin_c, fmt)
    y = q(x.cuda().to(torch.bfloat16)).float().cpu()
    if fmt == "fp8" and torch.cuda.get_device_capability() >= (8, 9):
        assert q.kernel == "scaled_mm"  # chosen, and not refused at the call
    # bf16 weights and inputs (8 mantissa bits) and a bf16 output: about 0.5 % relative, bound 2 %
    assert _rel_err(y, ref) < 0.02


def test_quantize_fp8_and_quantize_int8_by_hand():
    w = torch.tensor([[1000.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    w8, s = qurl.quantize_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and torch.isfinite(w8.float()).all()
    assert (
        math.isclose(s[0].item(), 1000.0 / 448, rel_tol=1e-6) and w8[0, 0].float().item() == 448.0
    )
    assert (w8[1].float() == 0).all()
    # LLM.int8: code = round(127 x / absmax) per row
    codes, absmax = qurl.quantize_int8(torch.tensor([[254.0, -1.0, 100.0], [0.5, 0.25, -0.125]]))
    assert codes.tolist() == [[127, 0, 50], [127, 64, -32]] and absmax.tolist() == [254.0, 0.5]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_copy_of_the_tiny_model_is_close(tiny, problems, fmt):
    """`quantized_copy` swaps exactly the `decoder_linears`, and stays close to the actor."""
    model, tok = tiny
    q = qurl.quantized_copy(model, fmt)
    # 7 linears x 2 layers; lm_head stays
    assert sum(isinstance(m, qurl.QuantLinear) for m in q.modules()) == 14
    enc = tok(
        [qurl.format_prompt(p["question"], tok) for p in problems[:16]],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        lf, lq = model(**enc).logits, q(**enc).logits
    m = enc["attention_mask"].bool()
    assert _rel_err(lq[m], lf[m]) < 0.05
    ro_f = qurl.sample(
        model, tok, [qurl.format_prompt(p["question"], tok) for p in problems[:100]], 1, 32, 0
    )
    ro_q = qurl.sample(
        q, tok, [qurl.format_prompt(p["question"], tok) for p in problems[:100]], 1, 32, 0
    )
    agree = sum(a == b for a, b in zip(ro_f.texts, ro_q.texts))
    assert agree >= 80, agree
    codes, n = quant_bytes(q)
    assert n > 4e5 and codes < 1.05 * n  # 1 byte per weight plus per-row scales


# NF4 levels as QLoRA publishes them (normal quantiles scaled to [-1, 1]); written out, not taken
# from bitsandbytes
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0])


def _ref_nf4(w):
    """Blocks of 64 weights (row-major), each scaled by its absmax and rounded to the nearest NF4
    level."""
    blocks = w.detach().reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    idx = ((blocks / absmax)[..., None] - NF4_LEVELS).abs().argmin(-1)
    return (NF4_LEVELS[idx] * absmax).reshape(w.shape)


def test_nf4_equals_bitsandbytes_per_layer(tiny, problems):
    import bitsandbytes.functional as bnbF
    model, tok = tiny
    q = qurl.quantized_copy(model, "nf4")
    fp = dict(model.named_modules())
    qls = [(n, m) for n, m in q.named_modules() if isinstance(m, qurl.QuantLinear)]
    assert len(qls) == 14 and all(m.fmt == "nf4" for _, m in qls)
    for name, ql in qls:
        w = fp[name].weight.detach()
        packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4")
        # bitsandbytes' own dequantize
        assert torch.equal(ql.weight_deq, bnbF.dequantize_4bit(packed, state))
        # the format by hand
        ref = _ref_nf4(w)
        assert (ql.weight_deq != ref).float().mean() < 1e-3 and _rel_err(ql.weight_deq, ref) < 1e-3
        xi = torch.randn(5, ql.in_features)
        torch.testing.assert_close(
            ql(xi), torch.nn.functional.linear(xi, ref, fp[name].bias), rtol=1e-2, atol=1e-3
        )
    # 4 bits: ~9 % error
    assert 0.05 < _rel_err(qls[0][1].weight_deq, fp[qls[0][0]].weight.detach()) < 0.15
    codes, n = quant_bytes(q)
    # half a byte per weight plus one fp32 absmax per block of 64
    assert codes == n // 2 + n // 64 * 4


@CUDA
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_nf4_dequantizes_into_the_compute_dtype(autocast):
    """On CUDA bitsandbytes dequantizes NF4 per call, straight into the compute dtype: bf16 out,
    with and without autocast, equal to the CPU layer (fp32 dequantized weights) to bf16
    rounding."""
    lin, x = _realistic_linear()
    ref = qurl.QuantLinear(lin, "nf4")(x)
    q = qurl.QuantLinear(lin.cuda(), "nf4")
    x_c = x.cuda() if autocast else x.cuda().to(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = q(x_c)
    assert y.dtype == torch.bfloat16 and _rel_err(y.float().cpu(), ref) < 0.02


def test_nf4_flip_rate_counts_codes_not_values():
    lin = torch.nn.Linear(128, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 0.02)
    q = qurl.QuantLinear(lin, "nf4")
    before = q.weight_deq.clone()
    with torch.no_grad():
        i = lin.weight[0, :64].abs().argmax()
        # the block's absmax moves by 1 %: every value of the block moves, few codes
        lin.weight[0, i] *= 1.01
    flipped = q.load_weight(lin.weight)
    # (codes at level 0 stay 0)
    assert (q.weight_deq != before).sum() >= 50 and flipped <= 4, flipped
    assert q.load_weight(lin.weight) == 0


def _adam_step(model, lr, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (4, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()


@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_sync_weights_flip_rate(tiny, fmt):
    import copy
    model = copy.deepcopy(tiny[0])
    q = qurl.quantized_copy(model, fmt)
    assert qurl.sync_weights(q, model) == 0.0
    _adam_step(model, 1e-3)
    flip = qurl.sync_weights(q, model)
    assert 0 < flip < 1
    fresh = qurl.quantized_copy(model, fmt)
    for (n1, b1), (n2, b2) in zip(q.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(
            b1.view(torch.uint8) if b1.dtype == torch.float8_e4m3fn else b1,
            b2.view(torch.uint8) if b2.dtype == torch.float8_e4m3fn else b2,
        ), n1
    assert qurl.sync_weights(q, model) == 0.0


def test_invariant_rescale_preserves_function_and_raises_flip_rate(tiny, problems):
    import copy
    model, tok = tiny
    enc = tok(
        [qurl.format_prompt(p["question"], tok) for p in problems[:8]],
        return_tensors="pt",
        padding=True,
    )
    scaled = copy.deepcopy(model)
    qurl.invariant_rescale(scaled, 1.5)
    q_w = lambda m: m.model.layers[0].self_attn.q_proj.weight  # noqa: E731
    assert not torch.equal(q_w(scaled), q_w(model))
    with torch.no_grad():
        ref, out = model(**enc).logits, scaled(**enc).logits
        assert _rel_err(out, ref) <= 1e-5
        q_ref, q_out = (
            qurl.quantized_copy(model, "fp8")(**enc).logits,
            qurl.quantized_copy(scaled, "fp8")(**enc).logits,
        )
        assert _rel_err(q_out, q_ref) < 2e-3  # same codes; only rounding of W/s and s*x differs
    flips = []
    for m in (copy.deepcopy(model), scaled):
        q = qurl.quantized_copy(m, "fp8")
        _adam_step(m, 1e-5)
        flips.append(qurl.sync_weights(q, m))
    assert flips[1] > 1.2 * flips[0] > 0, flips


def test_invariant_rescale_refuses_unknown_layers():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(qurl.QurlError, match="invariant-scale 1"):
        qurl.invariant_rescale(m, 1.5)


def _ref_fake_quant(x, fmt):
    """Quantize-dequantize written from the formats' definitions, per row, in float64 where it is
    exact."""
    if fmt == "fp8":
        s = x.double().abs().amax(-1, keepdim=True).clamp(min=1e-12).float() / 448.0
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()
    xh = x.to(torch.float16).double()
    absmax = xh.abs().amax(-1, keepdim=True)
    return torch.round(xh * 127 / absmax) * absmax / 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_aligned_linear_is_the_straight_through_fake_quant_linear(fmt, dtype):
    """`aligned_linear`: F.linear on the fake-quantized activations and weights (from the formats'
    definitions), in the autocast dtype; its gradient passes the quantizers as identity."""
    lin, x = _realistic_linear()
    x = x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
        y_a = qurl.aligned_linear(lin, fmt, x)
    want = _ref_fake_quant(x.detach(), fmt) @ _ref_fake_quant(lin.weight.detach(), fmt).T
    want = want + lin.bias.detach().double()
    bound = 1e-2 if dtype != torch.float32 else 1e-6 if fmt == "fp8" else 1e-3  # as below
    assert y_a.dtype == dtype and _rel_err(y_a.double(), want) < bound
    y_a.double().sum().backward()
    # straight-through: d sum(y) / dW = sum_rows fq(x), d sum(y) / dx = sum_out fq(W)
    gw = _ref_fake_quant(x.detach(), fmt).sum(0).expand_as(lin.weight)
    gx = _ref_fake_quant(lin.weight.detach(), fmt).sum(0).expand_as(x)
    # bf16 autocast rounds the gradient matmuls' operands; bnb's INT8 rounding differs from round-
    # half-even on a few codes (one step of a code is ~1 % of it: an un-quantized gradient fails)
    tol = 2e-2 if dtype != torch.float32 else 1e-5 if fmt == "fp8" else 1e-3
    assert _rel_err(lin.weight.grad.double(), gw) < tol and _rel_err(x.grad.double(), gx) < tol


def test_int8_matmul_and_int8_shift_keep_massive_activations_finite():
    """Real checkpoints carry activations of 1e4-1e5 in a few channels; bitsandbytes takes fp16
    (max 65504)."""
    lin, x = _realistic_linear()
    x[:3, 7] = torch.tensor([7e4, -2e5, 1e6])
    y, ref = qurl.QuantLinear(lin, "int8")(x), lin(x)
    assert torch.isfinite(y).all() and _rel_err(y - lin.bias, ref - lin.bias) < 0.03
    # other tokens: bnb's plain path
    torch.testing.assert_close(y[3:], qurl.QuantLinear(lin, "int8")(x[3:]))


def test_int8_aligned_forward_survives_massive_activations():
    """The aligned forward's straight-through path quantizes activations as the sampler does
    (power-of-2 shift into fp16's range): an activation of 1.5e5 gives the sampler's value within
    bitsandbytes' rounding, and a finite gradient."""
    lin, x = _realistic_linear()
    x[0, 5] = 1.5e5
    x.requires_grad_(True)
    y = qurl.aligned_linear(lin, "int8", x)
    sampler = qurl.QuantLinear(lin, "int8")(x.detach())
    assert torch.isfinite(y).all() and _rel_err(y.detach(), sampler) < 1e-3
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()
    # d sum(y) / dW = sum over rows of fq(x): row 0 quantized at 4 times its scale (shift 4 =
    # 2^ceil(log2(1.5e5/2^14)))
    # rather than overflowing fp16, so it matches the definition applied to x / 4
    fq0 = _ref_fake_quant(x.detach()[:1] / 4, "int8") * 4
    want = fq0 + _ref_fake_quant(x.detach()[1:], "int8").sum(0, keepdim=True)
    assert _rel_err(lin.weight.grad[0].double(), want[0]) < 1e-3


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fmt", ["none", "fp8", "int8", "nf4"])
def test_sample_in_bf16_with_every_quantized_copy(tiny, problems, fmt, autocast):
    """The sampler's actor in bf16: a bf16 model (no autocast, as --bench-quant ran it) or fp32
    masters under bf16 autocast (training). Its log-probs agree with the fp32 actor's teacher
    forcing to quantization noise."""
    import copy
    model, tok = tiny
    base = copy.deepcopy(model) if autocast else copy.deepcopy(model).to(torch.bfloat16)
    actor = base if fmt == "none" else qurl.quantized_copy(base, fmt)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ro = qurl.sample(actor, tok, _mixed_prompts(tok, problems), n=2, max_new_tokens=16,
                         generator=torch.Generator().manual_seed(0))
    lp = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask)
    assert torch.isfinite(ro.logp_behav).all() and ro.response_mask.sum() > 20
    kl = qurl.masked_mean(qurl.k3(lp - ro.logp_behav), ro.response_mask)
    assert kl < 0.02, (fmt, float(kl))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_rollout_aligned_forward_computes_through_the_samplers_quantizer(tiny, problems, fmt,
                                                                          autocast):
    """In `rollout_aligned` the fp actor computes through the sampler's quantizer: its logits are
    the quantized copy's bit for bit for FP8 and NF4 in fp32 (both dequantize), else closer to
    them than the plain actor's (other kernels' rounding crosses code boundaries, layer after
    layer: why qurl takes the value from the decode); the straight-through gradient reaches the
    fp weights; the context restores the plain forward."""
    import copy
    model, tok = tiny
    model = copy.deepcopy(model)
    q = qurl.quantized_copy(model, fmt)
    enc = tok(
        [qurl.format_prompt(p["question"], tok) for p in problems[:8]],
        return_tensors="pt",
        padding=True,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            lq, lf = q(**enc).logits, model(**enc).logits
        with qurl.rollout_aligned(model, fmt):
            la = model(**enc).logits
            la.float().logsumexp(-1).sum().backward()
    m = enc["attention_mask"].bool()
    la, lq, lf = la.detach()[m].float(), lq[m].float(), lf[m].float()
    if fmt in ("fp8", "nf4") and not autocast:
        assert torch.equal(la, lq)
    assert _rel_err(la, lq) < _rel_err(lf, lq) and _rel_err(lf, lq) > 1e-3  # code crossings
    g = model.model.layers[0].mlp.down_proj.weight.grad
    assert g is not None and g.abs().sum() > 0  # straight-through gradient reaches the fp weights
    assert type(model.model.layers[0].mlp.down_proj).forward is torch.nn.Linear.forward
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # the context restored the plain forward
        torch.testing.assert_close(model(**enc).logits[m].float(), lf)


@pytest.fixture(scope="module")
def wide():
    """A random Llama as wide as SmolLM2 (576), 2 layers, the tiny tokenizer: wide enough that the
    CPU's GEMMs sum a one-token decode step and a full forward in other orders, and a W8A8
    sampler's per-token activation codes cross apart (its FP8 decode against its own full
    forward: 2.2e-2 at most here; a real checkpoint's: RESULTS 17)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = qurl.load_model(TINY)[1]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval(), tok


@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_aligned_value_is_the_decodes_bit_for_bit_where_a_full_forward_is_not(wide, problems,
                                                                              fmt):
    """--align-forward: a full forward through the sampler's own layers (QaRL's value, and qurl's
    before #38) is not its decode; the aligned logp is: its value equals logp_behav (torch.equal),
    pi_prox is logp_behav, and its gradient is autograd's through the straight-through forward,
    weighted by the loss's gradient at that value (computed apart)."""
    import copy
    model, tok = copy.deepcopy(wide[0]).train(), wide[1]
    sampler = qurl.make_sampler(model, fmt, torch.float32)
    prompts = _mixed_prompts(tok, problems, 8)
    ro = qurl.sample(sampler, tok, prompts, 2, 16, 1.0, torch.Generator().manual_seed(0))
    mask = ro.response_mask
    full = qurl.token_logprobs(sampler, ro.input_ids, ro.attention_mask, mask)
    gap = float(((full - ro.logp_behav) * mask).abs().max())
    assert not torch.equal(full, ro.logp_behav) and (fmt != "fp8" or gap > 1e-3), gap

    adv = torch.linspace(-1.5, 1.5, len(mask))
    batch = _batch(ro, adv)
    learner = qurl.Learner(model, torch.optim.SGD(model.parameters()), sampler, tok,
                           torch.Generator(), torch.float32)
    args = qurl.Args(quant=fmt, align_forward=True, loss="tis", micro_batch=5)
    with qurl.rollout_aligned(model, fmt):
        _, finite, logp = qurl.backward_mini_batch(learner, args, batch, ro.logp_behav,
                                                   ro.logp_behav)
    assert finite and torch.equal(logp, ro.logp_behav)
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model.zero_grad()
    value = ro.logp_behav.clone().requires_grad_(True)
    qurl.token_loss(value, ro.logp_behav, ro.logp_behav, adv, mask, "tis", 0.2, 0.28,
                    2.0)[0].backward()
    with qurl.rollout_aligned(model, fmt):
        ste = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, mask)
    (ste * value.grad).sum().backward()
    want = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(want) and sum(float(g.abs().sum()) for g in want) > 0
    assert max(_rel_err(g, w) for g, w in zip(got, want)) < 1e-5  # per tensor (micro-batches)

    with qurl.rollout_aligned(model, fmt):
        _, logp_prox = qurl.update(learner, args, batch)
    assert torch.equal(logp_prox, ro.logp_behav)


@pytest.mark.parametrize("quant", ["fp8", "int8", "nf4", "bf16"])
def test_decode_fed_its_own_tokens_reproduces_logp_behav(wide, problems, quant):
    """`decode` fed the tokens it drew (the same prompts, n and steps): every log-prob again,
    bit for bit: what the aligned value takes after an optimizer step, from a re-synced
    sampler."""
    model, tok = wide
    sampler = qurl.make_sampler(model, quant, torch.float32)
    prompts = _mixed_prompts(tok, problems, 8)
    with qurl.rollout_autocast(quant, torch.device("cpu"), torch.float32):
        ro = qurl.sample(sampler, tok, prompts, 2, 16, 1.0, torch.Generator().manual_seed(0))
        ids, prompt_mask = qurl.encode(tok, prompts, "cpu")
        again = qurl.decode(sampler, tok, ids, prompt_mask, 2, 16, 1.0,
                            forced=ro.input_ids[:, ro.prompt_len:])
    assert torch.equal(again.input_ids, ro.input_ids) and torch.equal(again.logp_behav,
                                                                      ro.logp_behav)


def test_buffers_take_forced_tokens_in_their_columns_and_draw_the_rest():
    """Both decodes' outputs start as padding, zero log-probs, no EOS (end = R), none done; the
    tokens to take are `forced` in its first columns and -1 (draw) elsewhere."""
    forced = torch.tensor([[5, 6], [7, 8]])
    tokens, logp, fed, end, done = qurl._buffers(2, 4, 9, forced, "cpu")
    assert fed.tolist() == [[5, 6, -1, -1], [7, 8, -1, -1]] and tokens.tolist() == [[9] * 4] * 2
    assert logp.dtype == torch.float32 and logp.shape == (2, 4) and not logp.any()
    assert end.tolist() == [4, 4] and done.dtype == torch.bool and not done.any()
    assert qurl._buffers(3, 5, 0, None, "cpu")[2].tolist() == [[-1] * 5] * 3


@pytest.fixture(scope="module")
def wide_head(wide):
    """`wide` with a 16,384-token head (ids past the tiny tokenizer's decode to nothing): its
    lm_head's GEMM, like a real vocabulary's, rounds by how many rows share it on a CPU."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    config = wide[0].config.__class__(**{**wide[0].config.to_dict(), "vocab_size": 16384})
    return LlamaForCausalLM(config).eval(), wide[1]


def _aligned_step(model, tok, problems, quant, monkeypatch, **kw):
    """One --align-forward train_step at a learning rate that moves no weight (1e-30), with
    --mini-batches 2 --ppo-epochs 2 and a reward of 1 for every second sample (every group has
    signal). Returns each loss call's (logp, logp_behav), whether autocast was on in each
    training forward, and the rollout."""
    device = next(model.parameters()).device
    dtype = kw.pop("dtype", torch.float32)
    args = qurl.Args(quant=quant, align_forward=True, mini_batches=2, ppo_epochs=2, lr=1e-30,
                     prompts_per_step=len(problems), group_size=4, max_new_tokens=12, **kw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    learner = qurl.Learner(model, optimizer, qurl.make_sampler(model, quant, dtype), tok,
                           torch.Generator(device).manual_seed(0), dtype)
    rewards = iter([1.0, 0.0] * len(problems) * 2)
    calls, autocast_on, rollouts = [], [], []
    plain_loss, plain_logprobs = qurl.token_loss, qurl.token_logprobs
    plain_generate = qurl.compiled_sample if args.compile else qurl.sample

    def loss(logp, logp_prox, logp_behav, *a, **kw):
        calls.append((logp.detach().clone(), logp_behav.clone()))
        return plain_loss(logp, logp_prox, logp_behav, *a, **kw)

    def logprobs(*a, **kw):
        autocast_on.append(torch.is_autocast_enabled(device.type))
        return plain_logprobs(*a, **kw)
    monkeypatch.setattr(qurl, "reward", lambda text, gold: next(rewards))
    monkeypatch.setattr(qurl, "token_loss", loss)
    monkeypatch.setattr(qurl, "token_logprobs", logprobs)
    monkeypatch.setattr(qurl, "compiled_sample" if args.compile else "sample",
                        lambda *a: rollouts.append(plain_generate(*a)) or rollouts[-1])
    qurl.train_step(learner, args, problems, 1)
    return calls, autocast_on, rollouts[0], learner


@pytest.mark.parametrize("quant", ["fp8", "int8", "nf4", "bf16", "fp16"])
def test_aligned_logp_is_logp_behav_at_every_mini_batch(wide_head, problems, quant,
                                                        monkeypatch):
    """--align-forward --mini-batches 2 --ppo-epochs 2, no weight moved: every loss call (four
    mini-batches, three after an optimizer step; each micro-batch's and the metrics') sees logp
    equal to its rows' logp_behav bit for bit, on a model whose decode of some rows alone rounds
    apart from the rollout's (ef539de's second sampler decoding a mini-batch's 4 of 8 rows: off
    by 5e-3 under FP8, 5e-4 fp16, 1e-6 NF4 on a 2-core AVX2 CPU; INT8's integer GEMM is exact).
    The straight-through forwards run in the compute dtype, fp32 here, never under a half copy's:
    fp16 would need loss scaling."""
    import copy
    model = copy.deepcopy(wide_head[0]).train()
    calls, autocast_on, _, _ = _aligned_step(model, wide_head[1], problems[:2], quant,
                                             monkeypatch)
    assert len(calls) == 8
    assert [float((logp - behav).abs().max()) for logp, behav in calls] == [0.0] * 8
    assert all(torch.equal(logp, behav) for logp, behav in calls)
    assert autocast_on and not any(autocast_on)


def test_compiled_aligned_logp_is_logp_behav_at_every_mini_batch(tiny, problems, monkeypatch):
    """Under --compile, for every --quant: the rollout and the sampler's decode after each
    optimizer step are one `StaticDecoder`'s graphs (drawing, then fed), so every loss call's
    logp is logp_behav bit for bit (the eager decode's numbers are not: float sums). Each sampler
    is copied from an actor whose own decode compiled first (its log-probs teacher-forced ones
    within 1e-5): the copy fuses its own q/k/v and gate/up (its parts views of its own fused
    tensors, not the actor's), and where it computes in fp32 (fp8, int8, nf4) its compiled
    log-probs are its eager decode's fed the same tokens up to float sums, nearer than the
    mismatch. (A half copy's compiled and eager roundings differ by the CPU: 2e-2 under bf16 on
    one with AVX2, as far as its mismatch; there the layout is the check.)"""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    prompts = [qurl.format_prompt(p["question"], tok) for p in problems[:4]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no precision falls back to eager
        ro = qurl.compiled_sample(model, tok, prompts, 4, 12, 1.0, torch.Generator().manual_seed(0))
        lp = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask)
        assert ((lp - ro.logp_behav) * ro.response_mask).abs().max() < 1e-5
        assert ro.response_mask.sum() > 100
        for quant in ("fp8", "int8", "nf4", "bf16", "fp16"):
            calls, _, ro, learner = _aligned_step(model, tok, problems[:4], quant, monkeypatch,
                                                  compile=True)
            assert len(calls) == 8 and all(torch.equal(logp, behav) for logp, behav in calls)
            P = ro.prompt_len
            with qurl.rollout_autocast(quant, torch.device("cpu"), torch.float32):
                eager = qurl.decode(learner.sampler, tok, ro.input_ids[::4, :P],
                                    ro.attention_mask[::4, :P], 4, 12, 1.0,
                                    forced=ro.input_ids[:, P:])
            diff = (eager.logp_behav - ro.logp_behav).abs()
            assert quant in HALF_COPIES or 0 < float(diff.max()) < 1e-3, (quant, diff.max())
            for layer, own in zip(learner.sampler.model.layers, model.model.layers):
                qkv, _ = qurl.FUSED[layer]
                assert _storage(layer.self_attn.k_proj) == _storage(qkv), quant
                assert _storage(qkv) != _storage(qurl.FUSED[own][0]), quant


HALF_COPIES = ("bf16", "fp16")


def _storage(linear):
    """Where the tensor a decode reads lives: a QuantLinear's codes, an nn.Linear's weight."""
    tensor = linear.weight_q if isinstance(linear, qurl.QuantLinear) else linear.weight
    return tensor.untyped_storage().data_ptr()


@CUDA
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_aligned_logp_is_logp_behav_at_every_mini_batch(problems, compile, monkeypatch):
    """On a GPU (bf16 compute, cuBLAS picking kernels by row count), eager and compiled (CUDA
    graphs, drawing and fed): every loss call's logp is logp_behav bit for bit, every --quant."""
    model, tok = qurl.load_model(TINY, "cuda", torch.float32)
    for quant in ("fp8", "int8", "nf4", "bf16", "fp16"):
        calls, _, _, _ = _aligned_step(model, tok, problems[:4], quant, monkeypatch,
                                       dtype=torch.bfloat16, compile=compile)
        assert len(calls) == 8 and all(torch.equal(logp, behav) for logp, behav in calls), quant


def test_aligned_update_resyncs_the_rollouts_sampler_and_counts_flips_from_the_rollout(
        tiny, problems, monkeypatch):
    """--align-forward --mini-batches 2 at lr 1e-2: the first mini-batch's value is logp_behav;
    the second's (`sampler_logprobs`), after an optimizer step, the rollout's decode run again over
    all its rows, fed its tokens, by the rollout's own sampler re-synced in place (a fresh sampler
    of the weights after that step gives it bit for bit); no second sampler is made; the next
    step's flip rate counts the codes changed since the rollout (by hand), not since the re-sync."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    sampler = qurl.make_sampler(model, "fp8", torch.float32)
    learner = qurl.Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sampler, tok,
                           torch.Generator().manual_seed(0), torch.float32)
    args = qurl.Args(quant="fp8", align_forward=True, mini_batches=2, prompts_per_step=4,
                     group_size=4, max_new_tokens=12)
    rewards, rollouts = iter([1.0, 0.0] * 8), []
    values, states, plain_backward, plain_sample = [], [], qurl.backward_mini_batch, qurl.sample
    monkeypatch.setattr(qurl, "reward", lambda text, gold: next(rewards))
    monkeypatch.setattr(qurl, "backward_mini_batch", lambda *a: (
        values.append(a[4]), states.append(copy.deepcopy(model.state_dict())),
        plain_backward(*a))[2])
    monkeypatch.setattr(qurl, "sample", lambda *a: rollouts.append(plain_sample(*a)) or
                        rollouts[-1])
    monkeypatch.setattr(qurl, "make_sampler", None)  # no second sampler
    at_rollout = {k: v.clone() for k, v in sampler.state_dict().items() if "weight_q" in k}
    qurl.train_step(learner, args, problems[:4], 1)

    ro, P = rollouts[0], rollouts[0].prompt_len
    assert torch.equal(values[0], ro.logp_behav[:8])
    fresh = copy.deepcopy(tiny[0])
    fresh.load_state_dict(states[1])
    fresh_sampler = qurl.quantized_copy(fresh, "fp8")
    want = qurl.decode(fresh_sampler, tok, ro.input_ids[::4, :P], ro.attention_mask[::4, :P], 4,
                       12, 1.0, forced=ro.input_ids[:, P:])
    assert torch.equal(values[1], want.logp_behav[8:])
    assert not torch.equal(values[1], ro.logp_behav[8:])
    assert all(torch.equal(v, fresh_sampler.state_dict()[k]) for k, v in
               sampler.state_dict().items() if "weight_q" in k)  # re-synced in place

    final = qurl.quantized_copy(model, "fp8").state_dict()
    changed = sum(int((final[k].view(torch.uint8) != v.view(torch.uint8)).sum())
                  for k, v in at_rollout.items())
    total = sum(v.numel() for v in at_rollout.values())
    since_resync = qurl.sync_weights(copy.deepcopy(sampler), model)
    monkeypatch.setattr(qurl, "reward", lambda text, gold: 0.0)  # the next step: its sync alone
    flip_rate = qurl.train_step(learner, args, problems[:4], 2)["quant/flip_rate"]
    assert flip_rate == changed / total and flip_rate > since_resync > 0
    assert all(torch.equal(v, final[k]) for k, v in sampler.state_dict().items())


@pytest.mark.parametrize("quant", ["fp8", "bf16"])
def test_align_forward_run_logs_no_mismatch_and_keeps_every_update(tmp_path, quant):
    """An --align-forward run (two mini-batches a step: a re-synced value each second one): its
    mismatch is exactly 0, no update is skipped, the clip acts after the first optimizer step."""
    args = _small_args(tmp_path, run_name="a", quant=quant, align_forward=True, mini_batches=2,
                       steps=3)
    qurl.train(args)
    rows = _metrics(tmp_path / "a/metrics.jsonl")
    assert [r["mismatch/kl"] for r in rows] == [0.0] * 3
    assert all(r["mismatch/ratio_max"] == 1.0 and r["guard/skipped"] == 0 for r in rows)
    assert rows[1]["quant/flip_rate"] > 0 and rows[0]["clip/low"] is not None


def test_make_sampler_lm_head_in_the_compute_dtype_is_exact(tiny, problems):
    """The quantized sampler holds lm_head in the compute dtype (cast once per sync): under bf16
    autocast its log-probs equal bit for bit those of an fp32 lm_head cast at every step."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    fast, plain = qurl.make_sampler(model, "fp8", torch.bfloat16), qurl.quantized_copy(model, "fp8")
    assert fast.lm_head.weight.dtype == torch.bfloat16
    assert fast.model.embed_tokens.weight.dtype == torch.float32
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # the tiny model ties them
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # a sync reaches the untied head
    qurl.sync_weights(fast, model)
    qurl.sync_weights(plain, model)
    with qurl.autocast(torch.device("cpu"), torch.bfloat16):
        a, b = (qurl.sample(s, tok, _mixed_prompts(tok, problems, 8), 2, 16, 1.0,
                            torch.Generator().manual_seed(0)) for s in (fast, plain))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logp_behav, b.logp_behav)


def test_precision_ladder_mismatch_and_flips_under_rollout_autocast(tiny, problems):
    """--quant none is the actor itself; bf16 and fp16 are half copies refreshed in place. Their
    mismatch to the fp32 actor's teacher forcing orders as their mantissas do (fp16 has 10 bits,
    bf16 7), and the flip rate counts the half-precision values a sync changes."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    assert qurl.make_sampler(model, "none", torch.bfloat16) is model
    kl = {}
    for quant in ("none", "fp16", "bf16"):
        sampler = qurl.make_sampler(model, quant, torch.float32)
        ro = qurl.sample(sampler, tok, _mixed_prompts(tok, problems, 16), 4, 24, 1.0,
                         torch.Generator().manual_seed(0))
        lp = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask)
        kl[quant] = float(qurl.masked_mean(qurl.k3(lp.detach() - ro.logp_behav), ro.response_mask))
    assert kl["none"] < 1e-8 < kl["fp16"] < kl["bf16"] / 4 < 1e-3, kl
    sampler = qurl.make_sampler(model, "bf16", torch.float32)
    up_half = dict(sampler.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert up_half.dtype == torch.bfloat16
    assert sampler.model.rotary_emb.inv_freq.dtype == torch.float32
    assert qurl.sync_weights(sampler, model) == 0.0
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # 1 % moves most bf16 values
    flip = qurl.sync_weights(sampler, model)
    n_lin = sum(m.weight.numel() for _, m in qurl.decoder_linears(model))
    up = model.model.layers[0].mlp.up_proj.weight
    assert 0.5 * up.numel() / n_lin < flip <= up.numel() / n_lin
    assert torch.equal(up_half, up.to(torch.bfloat16))  # refreshed in place


# ==================================================================================================
# The method, 3: the rollout and its log-probs (against teacher-forced log-probs and model.generate)
# ==================================================================================================
def _mixed_prompts(tok, problems, k=6):
    prompts = [qurl.format_prompt(p["question"], tok) for p in problems[:k]]
    prompts[0] = "Q: What is 1 + 2?\nA: "  # a short prompt among long ones: real left padding
    assert len(set(len(p) for p in prompts)) > 1
    return prompts


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_logp_behav_equals_token_logprobs(tiny, problems, temperature):
    model, tok = tiny
    prompts = _mixed_prompts(tok, problems)
    ro = qurl.sample(model, tok, prompts, n=4, max_new_tokens=32, temperature=temperature,
                     generator=torch.Generator().manual_seed(0))
    assert (ro.attention_mask[:, :ro.prompt_len] == 0).any()  # some rows are left-padded
    lp = qurl.token_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.response_mask, temperature, micro_batch=7
    )
    diff = ((lp - ro.logp_behav) * ro.response_mask).abs().max().item()
    assert diff < 1e-5, diff
    assert ro.response_mask.sum() > 100


@CUDA
def test_cuda_sample_logprobs_bf16(problems):
    model, tok = qurl.load_model(TINY, "cuda", torch.bfloat16)
    model.eval()
    prompts = _mixed_prompts(tok, problems, 8)
    ro = qurl.sample(model, tok, prompts, n=4, max_new_tokens=32, temperature=1.0,
                     generator=torch.Generator(device="cuda").manual_seed(0))
    lp = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask, 1.0)
    diff = ((lp - ro.logp_behav) * ro.response_mask).abs()
    # bf16 logits: cached decode and a full forward differ by a few bf16 ulps of the logits
    assert diff.sum() / ro.response_mask.sum() < 0.02 and diff.max() < 0.25


def test_greedy_matches_generate(tiny, problems):
    model, tok = tiny
    prompts = _mixed_prompts(tok, problems, k=32)
    ro = qurl.sample(model, tok, prompts, n=1, max_new_tokens=32, temperature=0)
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=32, pad_token_id=tok.pad_token_id)
    ref = out[:, enc["input_ids"].shape[1]:]
    for i in range(len(prompts)):
        L = int(ro.response_mask[i].sum())
        assert ro.input_ids[i, ro.prompt_len:ro.prompt_len + L].tolist() == ref[i, :L].tolist()
        assert ref[i, L - 1] == tok.eos_token_id or L == 32


def test_stop_token_ids_join_the_tokenizers_and_the_generation_configs(tiny):
    """Qwen's instruct models end a turn with <|im_end|>, which only generation_config lists."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    model.generation_config.eos_token_id = [7, tok.eos_token_id, 5]
    assert qurl.stop_token_ids(model, tok) == sorted({5, 7, tok.eos_token_id})
    model.generation_config.eos_token_id = None
    assert qurl.stop_token_ids(model, tok) == [tok.eos_token_id]


def test_prefill_refuses_a_model_that_ignores_the_cache(tiny, problems):
    """transformers releases before 5.24 ignore `cache=`, later ones may drop `past_key_values=`:
    a decode without its cache would be garbage with no error, so the sampler checks the cache
    after prefill and names the version."""
    import transformers
    model, tok = tiny

    class NoCache(torch.nn.Module):  # a forward that swallows both cache keywords, as **kwargs do
        def __init__(self):
            super().__init__()
            self.inner, self.config, self.generation_config = (
                model,
                model.config,
                model.generation_config,
            )

        def forward(self, **kw):
            kw.pop("cache", None), kw.pop("past_key_values", None)
            return self.inner(**kw)

    with pytest.raises(
        RuntimeError, match=f"did not fill the KV cache \\(transformers {transformers.__version__}"
    ):
        qurl.sample(
            NoCache(), tok, _mixed_prompts(tok, problems), n=2, max_new_tokens=4, temperature=0
        )


def test_finish_masks_by_the_first_eos_position(tiny, problems):
    model, tok = tiny
    ro = qurl.sample(
        model,
        tok,
        _mixed_prompts(tok, problems, 8),
        n=8,
        max_new_tokens=40,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
    )
    resp = ro.input_ids[:, ro.prompt_len:]
    lengths = ro.response_mask.sum(1).long()
    # rows finished at different steps (some were dropped early)
    assert lengths.min() < lengths.max()
    eos = tok.eos_token_id
    for i in range(resp.shape[0]):
        L = int(lengths[i])
        assert ro.response_mask[i, :L].eq(1).all() and ro.response_mask[i, L:].eq(0).all()
        if not ro.truncated[i]:
            # the EOS itself is in the mask (pad == eos)
            assert resp[i, L - 1] == eos
            assert eos not in resp[i, :L - 1].tolist()      # and it is the first one
            assert ro.logp_behav[i, L - 1] < 0              # with its log-prob recorded
        assert ro.logp_behav[i, L:].eq(0).all()
    assert not ro.truncated.all()


def test_same_seed_same_samples(tiny, problems):
    model, tok = tiny
    prompts = _mixed_prompts(tok, problems, 4)
    a, b, c = (
        qurl.sample(
            model, tok, prompts, n=4, max_new_tokens=24, generator=torch.Generator().manual_seed(s)
        )
        for s in (5, 5, 6)
    )
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logp_behav, b.logp_behav)
    assert a.input_ids.shape != c.input_ids.shape or not torch.equal(a.input_ids, c.input_ids)


def test_advance_pads_finished_rows_and_ends_each_at_its_first_stop():
    """`_advance`, both decodes' step: greedy picks by hand; a row already done gets the pad token
    and keeps its end; a row that draws a stop token ends there (t) and is done; the others go on;
    the log-probs are those of the picked tokens. Fed a token (>= 0) a row takes it, stop or not,
    with its log-prob under the same distribution; -1 draws."""
    logits = torch.full((4, 6), -5.0)
    logits[torch.arange(4), torch.tensor([2, 5, 5, 3])] = 5.0  # picks 2, 5 (a stop), 5, 3
    done, end = torch.tensor([False, False, True, False]), torch.tensor([9, 9, 1, 9])
    stop_ids, pad, draw = torch.tensor([4, 5]), 0, torch.full((4,), -1)
    for T in (0.0, 1.0):
        token, logp, end_t, done_t = qurl._advance(logits, T, 1.0, draw, done, end, 3, stop_ids,
                                                   pad)
        assert token.tolist() == [2, 5, 0, 3] and end_t.tolist() == [9, 3, 1, 9]
        assert done_t.tolist() == [False, True, True, False]
        want = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor([2, 5, 5, 3])]
        torch.testing.assert_close(logp, want)

        fed = torch.tensor([4, -1, 1, 0])  # row 0 fed a stop token, row 1 draws
        token, logp, end_t, done_t = qurl._advance(logits, T, 1.0, fed, done, end, 3, stop_ids,
                                                   pad)
        assert token.tolist() == [4, 5, 0, 0] and end_t.tolist() == [3, 3, 1, 9]
        assert done_t.tolist() == [True, True, True, False]
        want = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor([4, 5, 0, 0])]
        torch.testing.assert_close(logp[[0, 1, 3]], want[[0, 1, 3]])


def test_pick_draws_what_multinomial_draws():
    """_pick samples argmax(p / E), E ~ Exponential(1): torch.multinomial's own one-sample
    algorithm, so the same generator state gives the same tokens, with no host sync."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    for temperature in (1.0, 0.7):
        probs = torch.softmax(logits / temperature, -1)
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5)).squeeze(1)
        noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(5))
        token, logp = qurl._pick(logits, temperature, noise, torch.full((64,), -1))
        assert torch.equal(token, want)
        torch.testing.assert_close(logp, probs.gather(1, want[:, None]).log().squeeze(1))


def test_first_token_distribution(tiny):
    """8000 first tokens vs softmax(logits / T): every frequent token within 5 sigma and the
    total variation small, while the distribution at the wrong temperature is clearly rejected."""
    model, tok = tiny
    # the first digit of the product is uncertain
    prompt, T, N = "Q: What is 57 * 8?\nA: 57*8=", 2.0, 8000
    ro = qurl.sample(model, tok, [prompt], n=N, max_new_tokens=1, temperature=T,
                     generator=torch.Generator().manual_seed(0))
    first = ro.input_ids[:, ro.prompt_len]
    emp = torch.bincount(first, minlength=len(tok)).double() / N
    with torch.no_grad():
        logits = model(**tok([prompt], return_tensors="pt")).logits[0, -1].double()
    p = torch.softmax(logits / T, -1)
    # a spread distribution: the test cannot pass by accident
    assert p.max() < 0.8 and (p > 0.02).sum() >= 3
    sigma = (p * (1 - p) / N).sqrt()
    big = p > 0.005
    assert ((emp - p).abs()[big] <= 5 * sigma[big]).all()
    def tv(a, b):  # total variation over the frequent tokens plus one bucket for the long tail
        return 0.5 * ((a - b).abs()[big].sum() + (a[~big].sum() - b[~big].sum()).abs()).item()
    tv, tv_wrong = tv(emp, p), tv(emp, torch.softmax(logits, -1))
    assert tv < 0.03 and tv_wrong > 3 * tv, (tv, tv_wrong)


def test_prepare_actor_checkpointing_changes_no_gradient_and_warns_nothing(tiny, problems):
    """`prepare_actor` with --grad-checkpointing (the README's SmolLM2 recipe): the gradient of a
    loss bit for bit as without it, and no deprecation warning from transformers."""
    import copy
    import warnings
    tok = tiny[1]
    ids, mask = qurl.encode(tok, _mixed_prompts(tok, problems, 4), "cpu")
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(tiny[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qurl.prepare_actor(model, checkpointing)
        assert not [w for w in caught if "checkpointing" in str(w.message)], caught
        model.train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.float().logsumexp(-1).mean().backward()
        grads.append([param.grad for param in model.parameters()])
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # it is on
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_sample_pads_left_whatever_the_tokenizer_says(tiny, problems):
    """`encode` pads on the left for a tokenizer set to pad on the right: the same samples."""
    import copy
    model, tok = tiny
    right = copy.deepcopy(tok)
    right.padding_side = "right"
    prompts = _mixed_prompts(tok, problems, 4)
    a, b = (
        qurl.sample(
            model, t, prompts, n=2, max_new_tokens=8, generator=torch.Generator().manual_seed(1)
        )
        for t in (tok, right)
    )
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logp_behav, b.logp_behav)

# ==================================================================================================
# The method, 4: the task and its reward (data format, answers)
# ==================================================================================================
REWARD_CASES = [
    ("37+48=85\n#### 85", "85", 1.0),
    ("37+48=85\n#### 86", "85", 0.0),
    ("#### -11", "-11", 1.0),
    ("5-16=-11\n#### -11", "-11", 1.0),
    ("5-16=11\n#### 11", "-11", 0.0),
    ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0),
    ("#### $1,234.00", "1234", 1.0),
    ("#### 3.50", "3.5", 1.0),
    ("#### 3.5", "3.50", 1.0),
    ("#### 3.51", "3.5", 0.0),
    ("She earns $18 a day.\n#### 18 dollars", "18", 1.0),
    ("#### 18 eggs", "18", 1.0),
    ("So the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "2/4", 1.0),
    ("First 2, then 7, so \\boxed{7}", "7", 1.0),
    ("\\boxed{x+1}", "x + 1", 1.0),
    ("\\boxed{\\text{Monday}}", "monday", 1.0),
    ("The answer is 17.", "17", 1.0),
    ("the answer is: -4", "-4", 1.0),
    ("The answer is $25.", "25", 1.0),
    ("I think 3 + 4 = 7, and 7 * 2 = 14", "14", 1.0),    # last number
    ("There were 12 apples, 5 eaten, so 7 remain", "7", 1.0),
    # distractor number before the answer
    ("There were 12 apples, 5 eaten, so 7 remain", "12", 0.0),
    ("We have 10 and 20 and then #### 30", "30", 1.0),         # '####' wins over earlier numbers
    ("#### 30\nbut actually 31", "30", 1.0),                   # only the '####' line counts
    ("I don't know.", "5", 0.0),                               # no answer at all
    ("", "5", 0.0),
    ("####", "5", 0.0),                                        # marker without a value
    ("#### 1/2", "0.5", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("#### 100%", "100", 1.0),
    ("#### 7.0", "7", 1.0),
    ("Total: 2,000,000\n#### 2,000,000", "2000000", 1.0),
    ("#### -0.25", "-1/4", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", REWARD_CASES)
def test_reward(completion, gold, expected):
    """`reward` through `extract_answer`'s three tiers, `_normalize` and `_last_number`."""
    assert qurl.reward(completion, gold) == expected


# Five lines in GSM8K's real format (the test split: worked solution with <<calculator>> tags, '####
# value').
GSM8K_FIXTURE = [
    {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning "
                 "and bakes muffins for her friends every day with four. She sells the remainder "
                 "at the farmers' market daily for $2 per fresh duck egg. How much in dollars does "
                 "she make every day at the farmers' market?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = "
               "$<<9*2=18>>18 every day at the farmer's market.\n#### 18"},
    {"question": "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts "
                 "in $50,000 in repairs.  This increased the value of the house by 150%.  How much "
                 "profit did he make?",
     "answer": "The cost of the house and repairs came out to "
               "80,000+50,000=$<<80000+50000=130000>>130,000\nHe increased the value of the house "
               "by 80,000*1.5=<<80000*1.5=120000>>120,000\nSo the new value of the house is "
               "120,000+80,000=$<<120000+80000=200000>>200,000\nSo he made a profit of "
               "200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many "
                 "bolts in total?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is "
               "2+1=<<2+1=3>>3 bolts of fabric\n#### 3"},
    {"question": "A shop sells pens at $1.25 each. How much do 6 pens cost?",
     "answer": "6 pens cost 6*1.25=<<6*1.25=7.5>>7.5\n#### 7.5"},
    {"question": "The temperature was 5 degrees and fell by 12 degrees. What is it now?",
     "answer": "5-12=<<5-12=-7>>-7\n#### -7"},
]


def test_gsm8k_format_golds_parse(tmp_path):
    f = tmp_path / "gsm8k_sample.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_FIXTURE))
    probs = qurl.load_problems(str(f))
    assert [p["gold"] for p in probs] == ["18", "70000", "3", "7.5", "-7"]
    # the full worked solution earns the reward against its own gold
    for p, r in zip(probs, GSM8K_FIXTURE):
        assert qurl.reward(r["answer"], p["gold"]) == 1.0


def test_embedded_data_format():
    for name, n in (("arith_train.jsonl", 20_000), ("arith_test.jsonl", 500)):
        rows = [json.loads(l) for l in (HERE / "data" / name).read_text().splitlines()]
        assert len(rows) == n and all("####" in r["answer"] for r in rows)
    train_q = {
        json.loads(l)["question"]
        for l in (HERE / "data/arith_train.jsonl").read_text().splitlines()
    }
    test_q = {
        json.loads(l)["question"] for l in (HERE / "data/arith_test.jsonl").read_text().splitlines()
    }
    assert not train_q & test_q
    kinds = {q.count("+") * 10 + q.count("-") + 100 * q.count("*") for q in test_q}
    assert kinds == {10, 1, 100, 11}  # a+b, a-b, a*b, a+b-c


def _script(path: Path, name: str):
    """A script of the project (not a package) imported as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mt():
    return _script(HERE / "data" / "make_tiny.py", "make_tiny")


def test_slipped_demonstrations_are_the_classic_carry_and_borrow_errors(mt):
    assert mt.slip("What is 48 + 26?") == ("48+26=64", 64)            # 8+6=14: the 1 is not carried
    # 2-7 needs a borrow: the 5 stays a 5
    assert mt.slip("What is 52 - 27?") == ("52-27=35", 35)
    assert mt.slip("What is 27 - 52?") == ("27-52=-35", -35)          # same slip on the magnitude
    assert mt.slip("What is 47 * 6?") == ("47*6=242", 242)            # 7*6=42: the 4 is not carried
    assert mt.slip("What is 58 + 15 - 9?") == ("58+15=63, 63-9=54", 54)
    for q in ("What is 12 + 7?", "What is 57 - 23?", "What is 41 * 2?", "What is 12 + 7 - 50?"):
        # no carry or borrow: nothing to slip
        assert mt.slip(q) is None
    train = [json.loads(l) for l in (HERE / "data/arith_train.jsonl").read_text().splitlines()]
    demos = mt.noisy_demonstrations(train)
    eligible = [i for i, p in enumerate(train) if mt.slip(p["question"])]
    slipped = [i for i in eligible if demos[i]["answer"] != train[i]["answer"]]
    assert abs(len(slipped) / len(eligible) - mt.P_SLIP) < 0.02
    assert all(d == p for d, p in zip(demos, train) if mt.slip(p["question"]) is None)
    for i in slipped[:50]:  # a slipped demonstration fails the reward that RL later uses
        assert qurl.reward(demos[i]["answer"], qurl.extract_answer(train[i]["answer"])) == 0.0


def test_warm_start_answers_with_the_slip(tiny, problems, mt):
    """The documented starting point: on problems with a carry or a borrow, the warm start's
    greedy answer is mostly the slipped one, so RL has an error to remove (README: 64 % of them
    at the warm start)."""
    model, tok = tiny
    elig = [p for p in problems if mt.slip(p["question"])][:100]
    ro = qurl.sample(
        model,
        tok,
        [qurl.format_prompt(p["question"], tok) for p in elig],
        n=1,
        max_new_tokens=32,
        temperature=0.0,
    )
    as_slip = sum(
        qurl.reward(t, str(mt.slip(p["question"])[1])) for t, p in zip(ro.texts, elig)
    ) / len(elig)
    right = sum(qurl.reward(t, p["gold"]) for t, p in zip(ro.texts, elig)) / len(elig)
    assert as_slip > 0.4 and right < 0.2, (as_slip, right)


def test_tiny_model_offline_roundtrip_and_band(tiny, problems):
    model, tok = tiny
    text = "Q: What is 12 + 7?\nA: 12+7=19\n#### 19 \u00e9"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.pad_token_id == tok.eos_token_id  # the pitfall the masks must survive
    assert 3e5 <= sum(p.numel() for p in model.parameters()) <= 3e6
    acc = qurl.evaluate(model, tok, problems[:100], max_new_tokens=32)
    assert 0.20 <= acc <= 0.60, acc


def test_format_prompt_plain_and_chat(tiny):
    _, tok = tiny
    assert qurl.format_prompt("What is 1 + 1?", tok) == "Q: What is 1 + 1?\nA: "

    class Chat:
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in msgs) + "|assistant:"

    out = qurl.format_prompt("What is 1 + 1?", Chat())
    assert (
        out.startswith("system:")
        and "####" in out
        and out.endswith("user:What is 1 + 1?|assistant:")
    )

# ==================================================================================================
# The method, 5: the update (gradient accumulation, mini-batches, the learning rate)
# ==================================================================================================
def test_lr_schedule_cosine_by_hand():
    # cos(0) = 1: the full rate first
    assert qurl.lr_at(1, 900, 1e-4, "cosine") == pytest.approx(1e-4)
    # cos(pi/2) = 0: half way
    assert qurl.lr_at(451, 900, 1e-4, "cosine") == pytest.approx(0.5e-4)
    assert qurl.lr_at(901, 900, 1e-4, "cosine") == pytest.approx(0.0, abs=1e-20)  # cos(pi) = -1
    # cos(pi/4)
    assert qurl.lr_at(226, 900, 1e-4, "cosine") == pytest.approx(0.5e-4 * (1 + math.sqrt(0.5)))
    assert all(qurl.lr_at(k, 10, 3e-4, "constant") == 3e-4 for k in range(1, 11))
    lrs = [qurl.lr_at(k, 50, 1e-4, "cosine") for k in range(1, 51)]
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 1e-6


class _CaptureGrads(torch.optim.Optimizer):
    """An optimizer that records the gradient it is asked to step on, and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = []

    def step(self, closure=None):
        self.grads.append(
            [p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        )


def _batch(rollout, adv):
    return {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
            "response_mask": rollout.response_mask, "logp_behav": rollout.logp_behav, "adv": adv}


@pytest.mark.parametrize("loss", ["acr", "tbpo"])
def test_backward_mini_batch_accumulation_equals_single_pass(tiny, problems, loss):
    """--micro-batch 3 gives the gradient of the whole mini-batch's loss (float64, to 1e-6), with
    TBPO's denominator counted over the mini-batch (sequences in band, above it, below it)."""
    import copy
    model, tok = copy.deepcopy(tiny[0]).double(), tiny[1]
    ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=16,
                     generator=torch.Generator().manual_seed(0))
    batch = _batch(ro, torch.tensor([1.0, -1.0, 0.5, -0.5] * 4, dtype=torch.float64))
    batch["logp_behav"] = batch["logp_behav"].double()
    mask = ro.response_mask.double()
    with torch.no_grad():
        lp_now = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, mask)
    shifts = torch.tensor([0.0, -1e-4, -2e-3, 2e-3] * 4, dtype=torch.float64)  # in, above, below
    prox = (lp_now + shifts[:, None]) * mask
    args = qurl.Args(loss=loss, micro_batch=3)
    rl = qurl.Learner(model, torch.optim.SGD(model.parameters()), model, tok, torch.Generator(),
                      torch.float64)
    m, finite, _ = qurl.backward_mini_batch(rl, args, batch, prox)
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    lp = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, mask, micro_batch=16)
    policy_loss(lp, prox, batch["logp_behav"], batch["adv"], mask, loss,
                     **LOSS_OPTIONS)[0].backward()
    want = [p.grad for p in model.parameters() if p.grad is not None]
    assert finite and len(got) == len(want) and sum(float(g.abs().sum()) for g in want) > 0
    # per tensor, relative to its norm: Qwen2's RMSNorm computes in float32 even in a float64
    # model, so gradients carry float32 rounding (~1e-7) wherever they pass a norm
    assert max(_rel_err(g, w) for g, w in zip(got, want)) < 1e-6
    if loss == "tbpo":  # the case has sequences out of band on both sides
        assert m["tbpo/kept"] == 0.5 and m["clip/low"] == 0.25 and m["clip/high"] == 0.25


def test_update_returns_pi_prox_of_the_actor_before_its_first_step(tiny, problems):
    """update() returns the actor's log-probs before any optimizer step, for every row, with one
    update per rollout (the training forward's own values) and with several (a no-grad forward),
    while the weights do move."""
    import copy
    for mini_batches, epochs in ((1, 1), (4, 2)):
        model, tok = copy.deepcopy(tiny[0]), tiny[1]
        ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=12,
                         generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask)
        args = qurl.Args(loss="tis", mini_batches=mini_batches, ppo_epochs=epochs, micro_batch=5)
        rl = qurl.Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), model, tok,
                          torch.Generator(), torch.float32)
        _, logp_prox = qurl.update(rl, args, _batch(ro, torch.tensor([1.0, -1.0] * 8)))
        with torch.no_grad():
            after = qurl.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.response_mask)
        torch.testing.assert_close(logp_prox, before, rtol=0, atol=1e-6)
        assert (after - before).abs().max() > 0.01


def test_bf16_autocast_updates_see_fresh_weights_after_each_optimizer_step(tiny, problems,
                                                                           monkeypatch):
    """torch.autocast caches the bf16 copy of each weight until its block exits: with several
    mini-batches the forwards after the first optimizer step must see the updated weights, as a
    fresh forward of that model does."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=16,
                     generator=torch.Generator().manual_seed(0))
    args = qurl.Args(loss="tis", mini_batches=2, micro_batch=8)
    rl = qurl.Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), model, tok,
                      torch.Generator(), torch.bfloat16)
    seen, after_first = [], []
    plain_loss, plain_step = qurl.token_loss, rl.optimizer.step
    monkeypatch.setattr(qurl, "token_loss", lambda logp, *a, **kw: (
        seen.append(logp.detach()), plain_loss(logp, *a, **kw))[1])
    rl.optimizer.step = lambda *a: (plain_step(*a), after_first or after_first.append(
        copy.deepcopy(model.state_dict())))
    before = copy.deepcopy(model)
    with qurl.autocast(torch.device("cpu"), torch.bfloat16):
        qurl.update(rl, args, _batch(ro, torch.tensor([1.0, -1.0] * 8)))
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(after_first[0])
    rows = slice(8, 16)  # the second mini-batch, after the first optimizer step
    with torch.no_grad(), qurl.autocast(torch.device("cpu"), torch.bfloat16):
        want, stale = (qurl.token_logprobs(m, ro.input_ids[rows], ro.attention_mask[rows],
                                           ro.response_mask[rows]) for m in (fresh, before))
    trained = seen[2]  # per mini-batch: its micro-batch's training forward, then its metrics
    assert torch.equal(trained, want)  # the updated model, bit for bit
    assert (trained - stale).abs().max() > 0.05  # and not the weights before the step


def test_bf16_clip_fraction_with_several_updates_tracks_fp32(tmp_path):
    """With 4 mini-batches at a high lr the PPO clip acts; bf16 must clip about as often as fp32
    (stale weights under autocast clipped ~8x less: 3.1 % against 26 %)."""
    clip = {}
    for dtype in ("float32", "bfloat16"):
        qurl.train(_small_args(tmp_path, run_name=dtype, quant="none", loss="tis", mini_batches=4,
                               lr=3e-3, eps_low=0.02, eps_high=0.02, steps=1, dtype=dtype,
                               prompts_per_step=16, group_size=8, max_new_tokens=32, eval_size=8))
        row = json.loads((tmp_path / dtype / "metrics.jsonl").read_text())
        clip[dtype] = row["clip/low"] + row["clip/high"]
    assert clip["float32"] > 0.1 and 0.5 < clip["bfloat16"] / clip["float32"] < 2, clip


def test_mini_batches_split_exactly():
    for n, k in ((10, 4), (9, 4), (128, 3), (7, 7)):
        sizes = [b.stop - b.start for b in qurl._batches(n, k)]
        assert len(sizes) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1, (n, k, sizes)
    # fewer rows than mini-batches
    assert [b.stop - b.start for b in qurl._batches(3, 4)] == [1, 1, 1]


def test_update_forwards_at_most_micro_batch_rows(tiny, problems):
    """`update` forwards `select`ed rows by `batch_logprobs`, never more than --micro-batch."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=8,
                     generator=torch.Generator().manual_seed(0))
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    args = qurl.Args(loss="tis", micro_batch=5, mini_batches=2, ppo_epochs=2)
    rl = qurl.Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-4), model, tok,
                      torch.Generator(), torch.float32)
    qurl.update(rl, args, _batch(ro, torch.ones(16)))
    hook.remove()
    # pi_prox of the second mini-batch (8 rows, no grad), then two epochs over 16 rows, <= 5 at once
    assert max(seen) <= 5 and sum(seen) == 8 + 2 * 16


def test_update_steps_once_per_mini_batch_on_its_own_rows(tiny, problems):
    """A `Learner` at --mini-batches 4 --ppo-epochs 2: eight optimizer steps, step k on the
    clipped gradient of mini-batch k mod 4 alone (the optimizer changes nothing here, so each is
    the on-policy gradient of its rows, computed independently by `policy_loss`)."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=8,
                     generator=torch.Generator().manual_seed(0))
    batch = _batch(ro, torch.linspace(-1.5, 1.5, 16))
    optimizer = _CaptureGrads(model.parameters())
    rl = qurl.Learner(model, optimizer, model, tok, torch.Generator(), torch.float32)
    qurl.update(rl, qurl.Args(loss="tis", mini_batches=4, ppo_epochs=2, micro_batch=3), batch)
    assert len(optimizer.grads) == 8
    for k, grads in enumerate(optimizer.grads):
        rows = slice(4 * (k % 4), 4 * (k % 4) + 4)
        model.zero_grad()
        lp = qurl.token_logprobs(model, ro.input_ids[rows], ro.attention_mask[rows],
                                 ro.response_mask[rows])
        policy_loss(lp, lp.detach(), batch["logp_behav"][rows], batch["adv"][rows],
                         ro.response_mask[rows], "tis", **LOSS_OPTIONS)[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), qurl.MAX_GRAD_NORM)
        want = [p.grad for p in model.parameters() if p.grad is not None]
        for got, ref in zip(grads, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)


def test_backward_mini_batch_tbpo_counts_its_band_after_the_forwards(tiny, problems):
    """TBPO's denominator is the in-band count, known only after the micro-batches' forwards:
    the summed gradient is divided by it then, with no counting pass, whether pi_prox is the
    forward's own (None) or given. Both give the same gradient when pi_prox equals the actor."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    ro = qurl.sample(model, tok, _mixed_prompts(tok, problems, 4), n=4, max_new_tokens=8,
                     generator=torch.Generator().manual_seed(0))
    batch = _batch(ro, torch.linspace(-1.5, 1.5, 16))
    rl = qurl.Learner(model, torch.optim.SGD(model.parameters()), model, tok, torch.Generator(),
                      torch.float32)
    args = qurl.Args(loss="tbpo", micro_batch=5)
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    metrics, _, logp = qurl.backward_mini_batch(rl, args, batch, None)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert seen == [5, 5, 5, 1]  # the training forwards alone
    model.zero_grad()
    seen.clear()
    again, _, _ = qurl.backward_mini_batch(rl, args, batch, logp)
    hook.remove()
    assert seen == [5, 5, 5, 1]  # no counting pass
    assert metrics == again and metrics["tbpo/kept"] == 1.0
    for got, ref in zip(grads, [p.grad for p in model.parameters() if p.grad is not None]):
        torch.testing.assert_close(got, ref)


def test_train_step_without_trainable_rows_logs_null_and_measures_the_sampler(tiny, problems,
                                                                       monkeypatch):
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    sampler = qurl.quantized_copy(model, "fp8")
    rl = qurl.Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-4), sampler, tok,
                      torch.Generator(), torch.float32)
    args = qurl.Args(quant="fp8", prompts_per_step=4, group_size=4, max_new_tokens=16)
    monkeypatch.setattr(qurl, "reward", lambda text, gold: 0.0)  # every group all-equal
    m = qurl.train_step(rl, args, problems[:4], 1)
    assert m["reward/zero_std_groups"] == 4 and m.get("loss/policy") is None
    assert m["mismatch/kl"] > 0 and m["mismatch/ratio_max"] > 1  # measured on every row

# ==================================================================================================
# The method, 6: advantages and the losses (hand-computed references and an independent oracle)
# ==================================================================================================
def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv, has_signal = qurl.group_advantages(r, 4)
    s = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1): sqrt(4 * 0.25 / 3)
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert adv[4:8].eq(0).all() and has_signal.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    # (0, 0, 0, 1): mean 0.25, unbiased variance (3 * 0.0625 + 0.5625) / 3
    m, sd = 0.25, math.sqrt(0.75 / 3)
    torch.testing.assert_close(adv[8:], torch.tensor([-m, -m, -m, 1 - m]) / (sd + 1e-6))


LP_BEHAV = [[-1.0, -1.0], [-1.0, -2.0]]


LP_PROX = [[-0.5, -1.0], [-1.0, -1.0]]


LP = [[-0.2, -1.2], [-1.5, -1.0]]


ADV = [1.0, -1.0]


# the losses' options as qurl.py's flags set them
LOSS_OPTIONS = {name: getattr(qurl.Args(), name)
                for name in ("eps_low", "eps_high", "is_cap", "tbpo_band")}


def policy_loss(logp, logp_prox, logp_behav, adv, mask, kind, eps_low, eps_high, is_cap,
                tbpo_band, denom=None):
    """`backward_mini_batch`'s choice: `tbpo_loss` or `token_loss` with the flags' options."""
    if kind == "tbpo":
        return qurl.tbpo_loss(logp, logp_prox, logp_behav, adv, mask, is_cap, tbpo_band, denom)
    return qurl.token_loss(logp, logp_prox, logp_behav, adv, mask, kind, eps_low, eps_high, is_cap,
                           denom)


def _loss(kind, lp=LP, prox=LP_PROX, behav=LP_BEHAV, adv=ADV, mask=None, **kw):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    lp = t(lp).requires_grad_(True)
    mask = torch.ones_like(lp) if mask is None else t(mask)
    loss, m = policy_loss(lp, t(prox), t(behav), t(adv), mask, kind, **LOSS_OPTIONS | kw)
    loss.backward()
    return loss.item(), lp.grad, m


def test_token_loss_tis_by_hand():
    e = math.exp
    # token (0,0): w = min(e^0.5, 2), R = e^0.3 > 1.28 and A > 0: clipped at 1.28
    # token (0,1): w = 1, R = e^-0.2 (unclipped), A = 1
    # token (1,0): w = 1, R = e^-0.5 < 0.8 and A < 0: clipped at 0.8 -> -min(-R, -0.8) = 0.8
    # token (1,1): w = min(e^1, 2) = 2, R = 1, A = -1 -> 2 * 1
    expected = (-e(0.5) * 1.28 - e(-0.2) + 0.8 + 2.0) / 4
    loss, grad, m = _loss("tis")
    assert math.isclose(loss, expected, rel_tol=1e-9)
    # clipped tokens get no gradient; unclipped: d/dlogp of -w R A = -w R A / 4
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, -e(-0.2) / 4], [0.0, 2.0 / 4]], dtype=torch.float64)
    )
    assert m["clip/high"] == 0.25 and m["clip/low"] == 0.25


def test_token_loss_naive_by_hand():
    e = math.exp
    # ratio = pi_theta / pi_behav: e^0.8 (clip 1.28), e^-0.2, e^-0.5 (A<0, clip 0.8), e^1 (A<0:
    # -min(-e, -1.28) = e)
    expected = (-1.28 - e(-0.2) + 0.8 + e(1.0)) / 4
    loss, grad, _ = _loss("naive")
    assert math.isclose(loss, expected, rel_tol=1e-9)
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, -e(-0.2) / 4], [0.0, e(1.0) / 4]], dtype=torch.float64)
    )


def test_token_loss_acr_widens_upper_bound_only_where_truncated():
    e = math.exp
    # one token: pi_prox / pi_behav = e > C = 2 (w truncated to 2), R = e^0.5 = 1.6487 > 1.28, A =
    # +1
    kw = dict(lp=[[-0.5]], prox=[[-1.0]], behav=[[-2.0]], adv=[1.0])
    tis, _, _ = _loss("tis", **kw)
    acr, g, m = _loss("acr", **kw)
    assert math.isclose(tis, -2 * 1.28, rel_tol=1e-9)
    upper = 1.28 / (2 * e(-1.0))              # (1 + eps_high) / r, r = C pi_behav / pi_prox = 2/e
    assert math.isclose(m["clip/acr_upper"], upper, rel_tol=1e-9)
    assert math.isclose(acr, -2 * e(0.5), rel_tol=1e-9)  # 1.6487 < 1.7396: not clipped under ACR
    assert g.item() != 0


def test_token_loss_acr_equals_tis_within_cap():
    g = torch.Generator().manual_seed(0)
    behav = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    # ratio <= 2
    prox = (
        behav + torch.rand(4, 6, generator=g, dtype=torch.float64) * math.log(2) * 2 - math.log(2)
    )
    lp = prox + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = [1.0, -1.0, 0.5, -2.0]
    a, ga, _ = _loss("acr", lp=lp.tolist(), prox=prox.tolist(), behav=behav.tolist(), adv=adv)
    t, gt, _ = _loss("tis", lp=lp.tolist(), prox=prox.tolist(), behav=behav.tolist(), adv=adv)
    assert a == t and torch.equal(ga, gt)


def test_masked_mean_masked_tokens_leave_the_loss_and_mismatch_metrics():
    """Masked tokens leave `token_loss`'s denominator; `mismatch_metrics` by `k3` by hand."""
    e = math.exp
    loss, grad, _ = _loss("tis", mask=[[1.0, 0.0], [0.0, 1.0]])
    assert math.isclose(loss, (-e(0.5) * 1.28 + 2.0) / 2, rel_tol=1e-9)
    assert grad[0, 1] == 0 and grad[1, 0] == 0
    loss, grad, m = _loss("acr", mask=[[0.0, 0.0], [0.0, 0.0]])  # all masked: no division by zero
    assert loss == 0.0 and grad.abs().sum() == 0 and m["clip/low"] == 0.0
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    mm = qurl.mismatch_metrics(t(LP_PROX), t(LP_BEHAV), t([[1.0, 0.0], [0.0, 1.0]]))
    # w = e^0.5 stays under C = 2, e^1 does not; under C = 1.5 neither does
    assert mm["mismatch/w_truncated"] == 0.5 and qurl.mismatch_metrics(
        t(LP_PROX), t(LP_BEHAV), t([[1.0, 0.0], [0.0, 1.0]]), 1.5)["mismatch/w_truncated"] == 1.0
    # tokens (0,0) and (1,1): r = log pi_prox/pi_behav = 0.5 and 1.0; KL(pi_behav || pi_prox) from
    # samples of
    # pi_behav by k3 = e^r - 1 - r
    assert math.isclose(
        mm["mismatch/kl"], ((e(0.5) - 1 - 0.5) + (e(1.0) - 1 - 1.0)) / 2, rel_tol=1e-9
    )
    assert (
        math.isclose(mm["mismatch/ratio_max"], e(1.0), rel_tol=1e-9)
        and mm["mismatch/logp_absdiff"] == 0.75
    )


def test_tbpo_loss_and_tbpo_ratio_by_hand():
    # seq 0: A=+1, s = 1 (in band), w = 1: l = 1, contributes -1
    # seq 1: A=-1, s = e^0.1 > 1 + 7e-4: out of the trust band, dropped from the loss and the
    # denominator
    # seq 2: A=+1, s = 1, w = e^1 capped at C = 2: contributes -2 (the cap binds)
    # seq 3: fully masked: no sequence at all
    # seq 4: A=-1, s = e^2e-4 inside [1 - 3e-4, 1 + 7e-4]: l = -s, contributes +s
    lp = [[-1.0, -1.0], [-0.9, -0.9], [-1.0, -1.0], [-1.0, -1.0], [-1.0 + 2e-4, -1.0 + 2e-4]]
    prox = [[-1.0, -1.0]] * 5
    behav = [[-1.0, -1.0], [-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]]
    mask = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    loss, grad, m = _loss(
        "tbpo", lp=lp, prox=prox, behav=behav, adv=[1.0, -1.0, 1.0, 1.0, -1.0], mask=mask
    )
    s4 = math.exp(2e-4)
    assert math.isclose(loss, (-1.0 - 2.0 + s4) / 3, rel_tol=1e-9)
    # d/dlogp_t of -w_hat s A / n_kept, s = exp(mean_t log ratio): -w_hat A s / (T n_kept)
    ref = torch.tensor(
        [[-1 / 6] * 2, [0.0] * 2, [-2 / 6] * 2, [0.0] * 2, [s4 / 6] * 2], dtype=torch.float64
    )
    torch.testing.assert_close(grad, ref)
    assert m["tbpo/kept"] == 0.75 and m["clip/high"] == 0.25 and m["clip/low"] == 0.0


def test_tbpo_loss_negative_band_zero_gradient_both_sides():
    for shift in (+0.5, -0.5):  # exploding or vanishing ratio of a negative-advantage sequence
        _, grad, _ = _loss(
            "tbpo",
            lp=[[-1.0 + shift, -1.0 + shift]],
            prox=[[-1.0, -1.0]],
            behav=[[-1.0, -1.0]],
            adv=[-1.0],
        )
        assert grad.abs().sum() == 0


@pytest.mark.parametrize("kind", ["naive", "tis", "acr", "tbpo"])
def test_on_policy_gradient_is_plain_policy_gradient(kind):
    g = torch.Generator().manual_seed(1)
    lp0 = torch.randn(3, 5, generator=g, dtype=torch.float64) - 1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5, 0.7], dtype=torch.float64)
    _, grad, _ = _loss(
        kind,
        lp=lp0.tolist(),
        prox=lp0.tolist(),
        behav=lp0.tolist(),
        adv=adv.tolist(),
        mask=mask.tolist(),
    )
    if kind == "tbpo":  # -A_i * mean_t grad logp, averaged over sequences
        ref = -adv[:, None] * mask / mask.sum(1, keepdim=True) / 3
    else:               # -A_i * grad logp, token mean over the batch
        ref = -adv[:, None] * mask / mask.sum()
    torch.testing.assert_close(grad, ref)


def _oracle(
    kind, lp, prox, behav, adv, mask, eps_low=0.2, eps_high=0.28, C=2.0, band=(3e-4, 4e-4, 7e-4)
):
    """The four objectives written from their formulas, one token or sequence at a time (float64
    scalars)."""
    B, T = lp.shape
    prox, behav = prox.tolist(), behav.tolist()
    clip = lambda x, lo, hi: torch.clamp(x, lo, hi)  # noqa: E731
    if kind == "tbpo":
        lo, hi_pos, hi_neg = band
        terms = []
        for i in range(B):
            toks = [t for t in range(T) if mask[i][t]]
            if not toks:
                continue
            s = torch.exp(sum(lp[i, t] - prox[i][t] for t in toks) / len(toks))
            w = math.exp(sum(prox[i][t] - behav[i][t] for t in toks) / len(toks))
            A = adv[i]
            if A >= 0:
                if s.item() > 1 + hi_pos:
                    continue
                ell = torch.minimum(s * A, clip(s, 1 - lo, 1 + hi_pos) * A)
            else:
                if not 1 - lo <= s.item() <= 1 + hi_neg:
                    continue
                ell = clip(s, 1 - lo, 1 + hi_neg) * A
            terms.append(min(w, C) * ell)
        return -sum(terms) / max(len(terms), 1) if terms else lp.sum() * 0
    total, n = lp.sum() * 0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            n += 1
            A = adv[i]
            if kind == "naive":
                r, w, upper = torch.exp(lp[i, t] - behav[i][t]), 1.0, 1 + eps_high
            else:
                r, w, upper = (
                    torch.exp(lp[i, t] - prox[i][t]),
                    min(math.exp(prox[i][t] - behav[i][t]), C),
                    1 + eps_high,
                )
                if kind == "acr":
                    upper = (1 + eps_high) / min(1.0, C * math.exp(behav[i][t] - prox[i][t]))
            total = total - w * torch.minimum(r * A, clip(r, 1 - eps_low, upper) * A)
    return total / max(n, 1)


def _oracle_cases():
    g = torch.Generator().manual_seed(7)
    B, T = 8, 6
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[3] = 0.0                                                  # an empty row
    behav = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # pi_prox/pi_behav beyond C = 2 often
    prox = behav + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    adv = torch.tensor([1.2, -0.7, 0.4, 1.0, -1.5, 0.9, -0.3, 0.0], dtype=torch.float64)
    # token losses: clips bind
    lp_tok = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    # tbpo: per-sequence shifts in band, above it and below it, for both signs of A (mean log-ratio
    # = shift)
    shifts = torch.tensor([1e-4, 2e-3, -2e-3, 0.0, 5e-4, -1e-4, 1e-3, 3e-4], dtype=torch.float64)
    lp_seq = prox + shifts[:, None] + torch.randn(B, T, generator=g, dtype=torch.float64) * 1e-5
    return lp_tok, lp_seq, prox, behav, adv, mask


@pytest.mark.parametrize("kind", ["naive", "tis", "acr", "tbpo"])
@pytest.mark.parametrize("C", [2.0, 1.2])
def test_policy_loss_matches_independent_oracle(kind, C):
    lp_tok, lp_seq, prox, behav, adv, mask = _oracle_cases()
    lp0 = lp_seq if kind == "tbpo" else lp_tok
    kw = LOSS_OPTIONS | dict(kind=kind, is_cap=C)
    # old log-probs passed with requires_grad: no gradient may reach them
    for old_grad in (False, True):
        lp = lp0.clone().requires_grad_(True)
        p, b = prox.clone().requires_grad_(old_grad), behav.clone().requires_grad_(old_grad)
        loss, _ = policy_loss(lp, p, b, adv, mask, **kw)
        loss.backward()
        lo = lp0.clone().requires_grad_(True)
        ref = _oracle(kind, lo, prox, behav, adv.tolist(), mask.tolist(), C=C)
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item())), (
            loss.item(),
            ref.item(),
        )
        torch.testing.assert_close(lp.grad, lo.grad, rtol=1e-6, atol=1e-9)
        assert lp.grad.abs().sum() > 0
        assert p.grad is None and b.grad is None


@pytest.mark.parametrize("kind", ["naive", "tis", "acr", "tbpo"])
def test_on_policy_call_trains(kind):
    """policy_loss(logp, logp, logp, ...): the natural on-policy call gives the plain policy
    gradient."""
    lp_tok, _, _, _, adv, mask = _oracle_cases()
    lp = lp_tok.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, lp, lp, adv, mask, kind, **LOSS_OPTIONS)
    loss.backward()
    lo = lp_tok.clone().requires_grad_(True)
    _oracle(kind, lo, lp_tok, lp_tok, adv.tolist(), mask.tolist()).backward()
    assert lp.grad.abs().sum() > 0
    torch.testing.assert_close(lp.grad, lo.grad, rtol=1e-6, atol=1e-9)

# ==================================================================================================
# Appendix A: plumbing (bad input, run folders, checkpoints and resume, signals, run tracking)
# ==================================================================================================
@pytest.mark.parametrize(
    "content,needles",
    [
        (
            '{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "x", "answer": \n',
            [":2:", "malformed"],
        ),
        ("", ["no problems", "empty"]),
        (
            '{"question": "What is 1 + 1?", "answer": "#### 2"}\n'
            '{"prompt": "x", "answer": "#### 1"}\n',
            [":2:", "not an object with a question and an answer"],
        ),
        ('{"question": "What is 1 + 1?", "answer": "no number here"}\n', [":1:", "does not parse"]),
    ],
)
def test_bad_data_file(tmp_path, content, needles):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    res = run_cli("--steps", "0", "--train-data", str(f), "--out-dir", str(tmp_path))
    assert_one_line_error(res, str(f), *needles)


def test_missing_or_unknown_data_file(tmp_path):
    missing = run_cli("--steps", "0", "--train-data", str(tmp_path / "nope.jsonl"))
    assert_one_line_error(missing, "not found")
    (tmp_path / "data.csv").write_text("question,answer\n")
    unknown = run_cli("--steps", "0", "--train-data", str(tmp_path / "data.csv"))
    assert_one_line_error(unknown, "neither a .jsonl file nor a hub name")


@pytest.mark.parametrize("argv,needles", [
    (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    (["--lr", "abc"], ["--lr", "invalid float value"]),
    (["--group-size", "1"], ["--group-size must be >= 2"]),
    (["--temperature", "-1"], ["--temperature must be > 0"]),
    (["--micro-batch", "0"], ["--micro-batch must be > 0"]),
    (["--invariant-scale", "0"], ["--invariant-scale must be > 0"]),
    (["--is-cap", "0.5"], ["--is-cap must be >= 1"]),
    (["--quant", "int4"], ["invalid choice: 'int4'"]),
    (["--steps", "0", "--model", "no/such/dir"], ["cannot load model 'no/such/dir'"]),
    (["--align-forward", "--quant", "none"], ["--align-forward needs a sampler"]),
    (["--temperature", "0"], ["--temperature must be > 0", "greedy"]),
    (["--dtype", "float16"], ["invalid choice: 'float16'", "bfloat16"]),
])
def test_bad_cli_input_one_line(tmp_path, argv, needles):
    assert_one_line_error(run_cli(*argv, "--out-dir", str(tmp_path)), *needles)


def test_hub_names_offline_say_so_in_one_line(tmp_path):
    """A hub model or data set, offline: fresh processes (at once), each with an empty Hugging
    Face cache of its own, so that a machine that once downloaded them must still see "offline"."""
    runs = {("--model", "Qwen/Qwen2.5-0.5B-Instruct"): ["offline", "data/tiny-qwen"],
            ("--train-data", "openai/gsm8k"): ["offline", "local"]}
    pending = {flags: run_cli("--steps", "0", *flags, "--out-dir", str(tmp_path), wait=False,
                              HF_HOME=str(tmp_path / f"hf{i}")) for i, flags in enumerate(runs)}
    for flags, needles in runs.items():
        assert_one_line_error(pending[flags](), *needles)


@pytest.mark.parametrize("argv,expect", [
    (["--loss", "tbpo", "--eps-high", "0.3"], "--eps-high does nothing with --loss tbpo"),
    (["--loss", "naive", "--is-cap", "3"], "--is-cap does nothing with --loss naive"),
    (["--loss", "acr", "--tbpo-band", "1e-3", "1e-3", "1e-3"],
     "--tbpo-band does nothing with --loss acr"),
])
def test_flags_that_do_not_act_say_so(capsys, argv, expect):
    qurl.parse_args(argv)
    assert expect in capsys.readouterr().err
    qurl.parse_args(["--loss", argv[1]])
    assert "does nothing" not in capsys.readouterr().err


def test_run_dir_rules(tmp_path, tiny):
    long_q = tmp_path / "long.jsonl"
    long_q.write_text(
        json.dumps({"question": "What is " + "1 + " * 80 + "1?", "answer": "#### 81"}) + "\n"
    )
    out = str(tmp_path / "runs")
    common = ["--out-dir", out, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
              "--eval-size", "4", "--quant", "none", "--train-data", _train_head()]
    # a fresh process (its result read last): the tokenizer's own "longer than the maximum" log
    # line must not reach the user
    long_run = run_cli(*common, "--train-data", str(long_q), "--run-name", "long", fresh=True,
                       wait=False)
    assert run_cli(*common, "--run-name", "a").returncode == 0
    before = (Path(out) / "a/metrics.jsonl").read_text()
    assert_one_line_error(run_cli(*common, "--run-name", "a"), "exists", "--resume")
    assert (Path(out) / "a/metrics.jsonl").read_text() == before  # nothing overwritten
    assert run_cli(*common).returncode == 0  # a default name, refused as well once it exists
    assert_one_line_error(run_cli(*common), "none-acr-s1 exists", "--resume")
    assert {p.name for p in Path(out).iterdir()} - {"long"} == {"a", "none-acr-s1"}
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert_one_line_error(run_cli(*common, "--resume", str(empty)), "not a run folder")
    (empty / "args.json").write_text((Path(out) / "a/args.json").read_text())
    assert_one_line_error(run_cli(*common, "--resume", str(empty)), "no checkpoint")
    # --resume alone continues with the run's saved flags (--quant none, 2 prompts); typed flags win
    res = run_cli("--resume", str(Path(out) / "a"), "--steps", "2")
    assert res.returncode == 0, res.stderr
    rows = _metrics(Path(out) / "a/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["quant/flip_rate"] == 0.0
    summary = json.loads((Path(out) / "a/summary.json").read_text())
    assert rows[1]["rollout/len_mean"] > 0 and summary["steps"] == 2
    assert summary["torch_threads"] == torch.get_num_threads()
    ckpt = torch.load(Path(out) / "a/ckpt.pt", weights_only=False)
    ckpt["actor"]["model.norm.weight"] = torch.ones(999)  # another model's shapes
    (tmp_path / "other").mkdir()
    torch.save(ckpt, tmp_path / "other/ckpt.pt")
    (tmp_path / "other/args.json").write_text((Path(out) / "a/args.json").read_text())
    assert_one_line_error(run_cli(*common, "--resume", str(tmp_path / "other")),
                          "not a checkpoint of this --model")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert_one_line_error(run_cli(*common, "--out-dir", str(blocker / "sub")), "cannot write")
    assert_one_line_error(long_run(), "the model's context")
    assert not (Path(out) / "long").exists()  # refused before anything was written


def _metrics(path):
    rows = [json.loads(l) for l in Path(path).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _interrupt_then_resume(tmp_path, monkeypatch, name, at_sync, interrupt, kw):
    """A run whose `at_sync`-th weight sync calls `interrupt`; then the same run resumed. Returns
    what the interrupted run raised, its stderr so far and its metric rows."""
    real_sync, calls = qurl.sync_weights, []

    def sync(*a):
        calls.append(sys._getframe(1).f_code.co_name == "train_step")  # not an update's re-sync
        if sum(calls) == at_sync and calls[-1]:
            interrupt()
        return real_sync(*a)
    monkeypatch.setattr(qurl, "sync_weights", sync)
    with pytest.raises((SystemExit, RuntimeError)) as e:
        qurl.train(_small_args(tmp_path, run_name=name, **kw))
    rows = _metrics(tmp_path / name / "metrics.jsonl")
    monkeypatch.setattr(qurl, "sync_weights", real_sync)
    qurl.train(_small_args(tmp_path, resume=str(tmp_path / name), **kw))
    return e.value, rows


def test_resume_after_interrupt_reproduces_metrics(tmp_path, monkeypatch, capsys):
    """Uninterrupted 5 steps == (Ctrl-C after step 3, resume) == (SIGTERM in step 3, resume) ==
    (crash in step 4 after a checkpoint at 2, resume); `--resume` says where it continues."""
    kw = dict(steps=5, quant="fp8", loss="acr", eval_every=2, lr=1e-3)
    monkeypatch.setattr(qurl, "SAVE_EVERY", 2)
    qurl.train(_small_args(tmp_path, run_name="full", **kw))
    ref = _metrics(tmp_path / "full/metrics.jsonl")
    assert len(ref) == 5

    # what the SIGINT handler does: finish this step, checkpoint, exit
    stop, rows = _interrupt_then_resume(tmp_path, monkeypatch, "cut", 3,
                                        lambda: qurl._request_stop(2, None), kw)
    assert stop.code == 130 and len(rows) == 3
    assert _metrics(tmp_path / "cut/metrics.jsonl") == ref
    err = capsys.readouterr().err
    assert f"resuming from {tmp_path / 'cut' / 'ckpt.pt'} (written after step 3)" in err
    assert "step 4 of 5 is next" in err

    # a real SIGTERM to this process, as a cluster's preemption sends it
    stop, rows = _interrupt_then_resume(tmp_path, monkeypatch, "term", 3,
                                        lambda: os.kill(os.getpid(), signal.SIGTERM), kw)
    err = capsys.readouterr().err
    assert stop.code == 143 and len(rows) == 3
    assert "SIGTERM" in err and f"--resume {tmp_path / 'term'}" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler removed on the way out
    assert _metrics(tmp_path / "term/metrics.jsonl") == ref

    def crash():
        raise RuntimeError("simulated crash")
    _, rows = _interrupt_then_resume(tmp_path, monkeypatch, "crash", 4, crash, kw)
    assert len(rows) == 3  # steps 1-3 logged, checkpoint at 2
    assert _metrics(tmp_path / "crash/metrics.jsonl") == ref
    # the resumed step 3's progress line: the evaluation at step 2, not the one at the start
    start = json.loads((tmp_path / "full/summary.json").read_text())["start_eval_acc"]
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step    3/5")][-1]
    assert f"eval {ref[1]['eval/acc']:.3f}" in line and ref[1]["eval/acc"] != start, (line, start)

    # aligned, two mini-batches: the checkpoint keeps the rollout's codes for the next flip rate
    kw |= dict(steps=4, align_forward=True, mini_batches=2, lr=1e-4)
    qurl.train(_small_args(tmp_path, run_name="aligned", **kw))
    stop, rows = _interrupt_then_resume(tmp_path, monkeypatch, "aligned-cut", 3,
                                        lambda: qurl._request_stop(2, None), kw)
    assert stop.code == 130 and len(rows) == 3
    ref = _metrics(tmp_path / "aligned/metrics.jsonl")
    assert _metrics(tmp_path / "aligned-cut/metrics.jsonl") == ref
    assert ref[3]["quant/flip_rate"] > 0


@pytest.mark.parametrize("damage", ["truncated", "not a checkpoint", "code in the pickle"])
def test_load_checkpoint_refuses_a_damaged_or_unsafe_file_in_one_line(tmp_path, damage):
    """`load_checkpoint` reads with weights_only=True: a pickle that would build an arbitrary
    object (here `os.system`'s caller) is refused, as are truncated and foreign files."""
    args = _small_args(tmp_path, run_name="c", quant="fp8", steps=1, eval_size=4)
    learner, run = qurl.start_run(args)
    qurl.save_checkpoint(learner, run)
    ckpt = tmp_path / "c/ckpt.pt"
    assert qurl.load_checkpoint(ckpt, learner.actor)["step"] == 0  # a whole one loads as data
    if damage == "truncated":
        ckpt.write_bytes(ckpt.read_bytes()[:5000])
    elif damage == "not a checkpoint":
        ckpt.write_text("hello")
    else:
        torch.save({"step": 0, "payload": _Evil(tmp_path / "pwned")}, ckpt)
    res = run_cli("--resume", str(tmp_path / "c"), "--steps", "2")
    assert_one_line_error(res, str(ckpt), "is not a readable checkpoint")
    assert not (tmp_path / "pwned").exists()
    if damage == "code in the pickle":  # what weights_only=False would have done
        torch.load(ckpt, weights_only=False)
        assert (tmp_path / "pwned").exists()


class _Evil:
    """What a malicious ckpt.pt would carry: unpickling it runs a command."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_second_signal_aborts_at_once():
    with qurl.stop_requests() as stop:
        qurl._request_stop(signal.SIGTERM, None)
        assert stop == {signal.SIGTERM}
        with pytest.raises(SystemExit) as e:
            qurl._request_stop(signal.SIGTERM, None)
        assert e.value.code == 143


def test_a_checkpoint_without_last_eval_resumes_with_its_first(tmp_path):
    """A checkpoint from before ab35f03 kept the first evaluation alone: it resumes, its last
    evaluation taken as the first (`resume_from`)."""
    args = _small_args(tmp_path, run_name="old", quant="none", steps=1, eval_size=4)
    learner, run = qurl.start_run(args)
    run.step, run.first_eval, run.last_eval = 1, 0.25, 0.5
    qurl.save_checkpoint(learner, run)
    ckpt = torch.load(run.dir / "ckpt.pt", weights_only=True)
    del ckpt["last_eval"]
    torch.save(ckpt, run.dir / "ckpt.pt")
    _, resumed = qurl.start_run(dataclasses.replace(args, resume=str(run.dir), steps=2))
    assert (resumed.step, resumed.first_eval, resumed.last_eval) == (1, 0.25, 0.25)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A crash while a checkpoint is written leaves the previous one whole and loadable."""
    args = _small_args(tmp_path, run_name="c", quant="none", steps=1, eval_size=4)
    learner, run = qurl.start_run(args)
    run.step = 7
    qurl.save_checkpoint(learner, run)
    real_save = torch.save

    def disk_full(state, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", disk_full)
    run.step = 8
    with pytest.raises(OSError):
        qurl.save_checkpoint(learner, run)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(tmp_path / "c/ckpt.pt", weights_only=False)["step"] == 7  # the previous one


# ==================================================================================================
# Appendix B: the compiled decode (--compile)
# ==================================================================================================
@pytest.fixture(scope="module")
def compiled_fp8(tiny):
    """An fp8 sampler of a copy of the tiny actor (its first compiled_sample compiles)."""
    import copy
    model = copy.deepcopy(tiny[0])
    return model, qurl.make_sampler(model, "fp8", torch.float32)


def _flips(model, rollout, threshold=1e-4):
    """The share of sampled tokens whose logp_behav differs from teacher forcing by > threshold:
    an FP8 activation code can flip on the decode's other summation order (eager or compiled)."""
    lp = qurl.token_logprobs(model, rollout.input_ids, rollout.attention_mask,
                             rollout.response_mask)
    far = ((lp - rollout.logp_behav).abs() > threshold) & rollout.response_mask.bool()
    return float(far.sum() / rollout.response_mask.sum())


def test_compiled_decode_equals_the_eager_one(tiny, problems, compiled_fp8):
    """FP8: greedy tokens equal the eager sampler's, rows ending at a stop token or at the limit;
    at T = 1 the sampled tokens' logp_behav equal teacher-forced log-probs as closely as the eager
    sampler's do: for FP8 the rare flip of an activation code no more often than in the eager
    decode (the fp32 actor's, within 1e-5: the compiled aligned test). 64 prompts in the aligned
    test's shapes (4 prompts x 4 rows, 12 new tokens): its FP8 graphs, compiled once for the
    suite (greedy adds the drawing ones)."""
    model, sampler = compiled_fp8
    tok, prompts = tiny[1], _mixed_prompts(tiny[1], problems, 64)
    config, eos = sampler.generation_config, sampler.generation_config.eos_token_id
    newline = tok("\n", add_special_tokens=False)["input_ids"]  # answers reach it in 6 to 20
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every precision compiles
        ended = []
        try:
            config.eos_token_id = qurl.stop_token_ids(sampler, tok) + newline
            for i in range(0, 16, 4):  # greedy
                compiled = qurl.compiled_sample(sampler, tok, prompts[i:i + 4], 4, 12, 0.0)
                eager = qurl.sample(sampler, tok, prompts[i:i + 4], 4, 12, 0.0)
                assert compiled.texts == eager.texts and (compiled.response_mask.sum(1) > 1).all()
                ended += (~compiled.truncated).tolist()
        finally:
            config.eos_token_id = eos
        assert any(ended) and not all(ended)

        flips, tokens = {"compiled": 0.0, "eager": 0.0}, {"compiled": 0.0, "eager": 0.0}
        for i in range(0, 64, 4):  # sampled
            for name, sample in (("compiled", qurl.compiled_sample), ("eager", qurl.sample)):
                ro = sample(sampler, tok, prompts[i:i + 4], 4, 12, 1.0,
                            torch.Generator().manual_seed(i))
                n = float(ro.response_mask.sum())
                flips[name] += _flips(sampler, ro) * n
                tokens[name] += n
    compiled, eager = (flips[name] / tokens[name] for name in ("compiled", "eager"))
    assert tokens["compiled"] > 2000 and compiled <= 2 * eager + 0.002, (compiled, eager)


def test_graphed_warms_up_on_the_real_inputs_before_any_capture():
    """`graphed` on a CPU: the two warm-up calls a GPU makes before capturing run here too, on
    the inputs it is given, and it returns fn itself."""
    calls = []
    fn = lambda model, x: calls.append((model, x.clone()))  # noqa: E731
    x = torch.tensor([3])
    assert qurl.graphed(fn, "model", x) is fn
    assert len(calls) == 2 and all(m == "model" and torch.equal(c, x) for m, c in calls)


def test_compiled_decode_steps_only_at_cache_columns_it_has(tiny, problems, monkeypatch):
    """Every call of the compiled decode step, its warm-up calls first (which on a GPU precede the
    capture: b5a5112 made them before setting the cache column, a device assert on its first CUDA
    run), writes inside the cache and draws a token index in [0, R): here, on the CPU, by the
    same order of operations. The first two calls are the warm-up, on the first step's inputs."""
    import copy
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    seen, step = [], qurl.StaticDecoder.decode_one_token

    def checked(self, model, token, column, fed, end, done):
        seen.append(int(column))
        assert self.prompt_len <= int(column) < self.valid.shape[1] - 1, int(column)
        return step(self, model, token, column, fed, end, done)
    monkeypatch.setattr(qurl.StaticDecoder, "decode_one_token", checked)
    prompts = _mixed_prompts(tok, problems, 4)  # 16 rows, 12 tokens: other tests' compiled shapes
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ro = qurl.compiled_sample(model, tok, prompts, 4, 12, 1.0, torch.Generator().manual_seed(0))
    P = next(iter(qurl.DECODERS[model].values())).prompt_len
    steps = ro.response_mask.shape[1] - 1
    assert seen[:3] == [P, P, P] and seen[2:] == list(range(P, P + steps)), seen
    eager = qurl.sample(model, tok, prompts, 4, 12, 1.0, torch.Generator().manual_seed(0))
    assert ro.texts == eager.texts


@CUDA
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8", "nf4"])
def test_cuda_compiled_sampler_matches_eager(problems, quant):
    """On a GPU the compiled decode (its fused layout: NF4's fused state dequantizes on the GPU
    alone) is captured as a CUDA graph; its greedy tokens equal the eager sampler's (bf16 sums may
    part them on a near tie: at most 2 of 32 rows), and its log-probs match teacher forcing as
    closely as the eager sampler's."""
    model, tok = qurl.load_model(TINY, "cuda", torch.float32)
    sampler = qurl.make_sampler(model, quant, torch.bfloat16)
    prompts = _mixed_prompts(tok, problems, 32)
    with qurl.autocast(torch.device("cuda"), torch.float32 if quant == "bf16" else torch.bfloat16):
        eager = qurl.sample(sampler, tok, prompts, 1, 32, 0.0)
        compiled = qurl.compiled_sample(sampler, tok, prompts, 1, 32, 0.0)
        assert all(d.replay is not None for d in qurl.DECODERS[sampler].values())
        assert sum(a != b for a, b in zip(eager.texts, compiled.texts)) <= 2
        gen = torch.Generator(device="cuda").manual_seed(0)
        ro = qurl.compiled_sample(sampler, tok, prompts, 2, 32, 1.0, gen)
        lp = qurl.token_logprobs(sampler, ro.input_ids, ro.attention_mask, ro.response_mask)
    diff = ((lp - ro.logp_behav) * ro.response_mask).abs()
    assert diff.sum() / ro.response_mask.sum() < 0.02 and diff.max() < 0.25


def test_compiled_decode_never_recompiles_and_reads_fresh_weights(tiny, problems, compiled_fp8):
    """Across decode steps, RL steps (other prompts of the same width) and weight syncs after
    optimizer steps at a large learning rate: no recompilation (dynamo's counter), and the
    log-probs are those of the updated codes, not of the codes the step was compiled with."""
    model, sampler = compiled_fp8
    tok = tiny[1]
    prompts = [qurl.format_prompt(p["question"], tok) for p in problems[:4]]  # 4 x 4 rows, 12
    qurl.compiled_sample(sampler, tok, prompts, 4, 12, 1.0, torch.Generator().manual_seed(0))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch._dynamo.config.error_on_recompile = True
    try:
        for step in range(3):
            stale = qurl.make_sampler(model, "fp8", torch.float32)
            ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert qurl.sync_weights(sampler, model) > 0.01
            batch = [qurl.format_prompt(p["question"], tok) for p in problems[4 * step + 4:][:4]]
            ro = qurl.compiled_sample(sampler, tok, batch, 4, 12, 1.0,
                                      torch.Generator().manual_seed(step))
            fresh = qurl.make_sampler(model, "fp8", torch.float32)  # from the new weights
            assert _flips(fresh, ro) < 0.02 and _flips(stale, ro) > 0.5
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("quant", ["fp8", "int8", "nf4", "bf16", "none"])
def test_fuse_stacks_the_separate_codes_and_follows_every_sync(tiny, quant):
    """The compiled decode's q/k/v and gate/up linears (`fuse`) hold exactly the codes and scales
    of quantizing each actor linear alone (bitsandbytes' own for INT8 and NF4), before and after
    an optimizer step and `sync_weights` (for the actor itself, after the step alone); NF4's fused
    state dequantizes (bitsandbytes) to the separate values; the separate modules compute as
    before, and the fused one's output is theirs side by side."""
    import copy
    import bitsandbytes.functional as bnbF
    model = copy.deepcopy(tiny[0]).train()
    sampler = qurl.make_sampler(model, quant, torch.float32)
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
              ["mlp.gate_proj", "mlp.up_proj"]]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16) if quant == "bf16" else x
    fused = []  # (the fused linear, the separate ones, their names)
    for i, layer in enumerate(sampler.model.layers):
        for group in groups:
            linears = [layer.get_submodule(name) for name in group]
            outputs = [linear(x) for linear in linears]
            fused.append((qurl.fuse(linears), linears, [f"model.layers.{i}.{n}" for n in group]))
            assert all(torch.equal(linear(x), y) for linear, y in zip(linears, outputs))

    def expected(weight):  # (codes, scales) of one actor linear, quantized on its own
        weight = weight.detach()
        if quant == "fp8":
            return qurl.quantize_fp8(weight)
        if quant == "int8":
            codes, absmax, _ = bnbF.int8_vectorwise_quant(weight.half(), 0.0)
            return codes, absmax.float()
        if quant == "nf4":
            codes, state = bnbF.quantize_4bit(weight, blocksize=64, quant_type="nf4")
            return codes, state.absmax
        return (weight.to(torch.bfloat16) if quant == "bf16" else weight), None

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        actor = dict(model.named_modules())
        for module, linears, names in fused:
            codes, scales = zip(*[expected(actor[name].weight) for name in names])
            stored = module.weight if quant in ("bf16", "none") else module.weight_q
            if quant == "fp8":  # (equal needs bytes)
                stored, codes = stored.view(torch.uint8), [c.view(torch.uint8) for c in codes]
            assert torch.equal(stored, torch.cat(codes).view_as(stored))
            if quant in ("fp8", "int8", "nf4"):
                assert torch.equal(module.weight_scale, torch.cat(scales))
            if quant == "nf4":
                values = [bnbF.dequantize_4bit(*bnbF.quantize_4bit(actor[n].weight.detach(),
                          blocksize=64, quant_type="nf4")) for n in names]
                assert torch.equal(bnbF.dequantize_4bit(module.weight_q, module.nf4_state),
                                   torch.cat(values))
            want = torch.cat([linear(x) for linear in linears], -1)
            torch.testing.assert_close(module(x), want, rtol=1e-6, atol=1e-6)
        ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert qurl.sync_weights(sampler, model) > 0.01 or quant == "none"


def test_compile_end_to_end(tmp_path):
    args = _small_args(tmp_path, run_name="c", quant="fp8", compile=True, max_new_tokens=12)
    qurl.train(args)
    rows = [json.loads(l) for l in (tmp_path / "c/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["quant/flip_rate"] > 0
    assert all(v is None or math.isfinite(v) for r in rows for v in r.values())
    assert 0 < rows[0]["mismatch/kl"] < 0.01


# ==================================================================================================
# Tools (tools/): the dry run and its memory estimate, benchmarks, plots
# ==================================================================================================
def test_cli_help_and_dry_run(dry_run, capsys):
    res = run_cli("--help")  # (the entry point as a command: the fresh CLI errors' tests)
    assert res.returncode == 0 and "--invariant-scale" in res.stdout and "W4A16 nf4" in res.stdout
    flags = [f for f in dataclasses.fields(qurl.Args)]
    assert len(flags) <= 32 and res.stdout.count("\n  --") >= len(flags)
    dry_run.main(["--quant", "fp8", "--train-data", _train_head()])  # bench.py's test: a command
    out = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in out and "512 train, 500 test" in out
    assert "Q: What is" in out and "sampler (fp8)" in out
    assert "estimated peak on cpu in float32: update" in out


@pytest.fixture(scope="module")
def dry_run():
    return _script(HERE / "tools" / "dry_run.py", "dry_run")


def test_memory_estimate_terms_against_the_objects_they_count(tiny, problems, dry_run,
                                                              monkeypatch):
    """The estimate's sampler is what a real sampler holds (codes and scales, the fp32 rest, the
    bf16 lm_head beside the tied embedding); its KV cache is in the dtypes transformers keeps under
    autocast (K fp32, V bf16) and --compile keeps (both bf16); activations and logits scale as
    documented; gradient checkpointing shrinks the activations; --align-forward with several
    updates holds the codes an aligned update keeps."""
    import copy
    model, tok = tiny
    estimate = dry_run.estimate_memory
    for fmt in ("fp8", "nf4", "bf16"):
        sampler = qurl.make_sampler(model, fmt, torch.bfloat16)
        codes, n_lin = quant_bytes(sampler)
        held = codes + sum(p.numel() * p.element_size() for p in sampler.parameters())
        est = estimate(model, 64, 20, 32, 16, False, fmt, torch.bfloat16, "cuda")
        scales = codes - n_lin * (0.5 if fmt == "nf4" else 1) if codes else 0
        assert abs(est["sampler"] * 2**30 - held) <= scales, fmt  # per-row scales aside (fp8)
    sampler = qurl.make_sampler(model, "fp8", torch.bfloat16)
    enc = tok(_mixed_prompts(tok, problems, 4), return_tensors="pt", padding=True)
    with qurl.autocast(torch.device("cpu"), torch.bfloat16):
        _, cache, _, _ = qurl._prefill(sampler, tok, enc["input_ids"], enc["attention_mask"])
        decoder = qurl.StaticDecoder(sampler, tok, 4, 64, 4, 0.0)  # `compiled_decode`'s, not run
    assert (cache.layers[0].keys.dtype, cache.layers[0].values.dtype) == (torch.float32,
                                                                          torch.bfloat16)
    compiled = decoder.k_cache, decoder.v_cache
    assert [c.dtype for c in compiled] == [torch.bfloat16, torch.bfloat16]
    eager, fast = (estimate(model, 64, 20, 32, 16, False, "fp8", torch.bfloat16, "cuda", c)
                   for c in (False, True))
    kv = 64 * 52 * model.config.num_hidden_layers * 64  # rows x tokens x layers x K/V width
    assert (eager["rollout"] - fast["rollout"]) * 2**30 == pytest.approx(kv * 2)  # 6 B vs 4 B
    a, b = (estimate(model, 64, 20, 32, 16, checkpointing, "fp8", torch.bfloat16, "cuda")
            for checkpointing in (False, True))
    assert b["activations"] < a["activations"]
    logits = 16 * 16 * 33 * model.config.vocab_size / 2**30  # 16 B each
    assert a["logits"] == b["logits"] == pytest.approx(logits)
    # twice the micro-batch
    c = estimate(model, 64, 20, 32, 32, False, "fp8", torch.bfloat16, "cuda")
    assert c["activations"] == pytest.approx(2 * a["activations"]) and c["rollout"] == a["rollout"]

    # --align-forward, two mini-batches: the codes the update keeps (an aligned step's own)
    for fmt in ("fp8", "nf4", "bf16"):
        learner = _aligned_step(copy.deepcopy(model), tok, problems[:2], fmt, monkeypatch)[3]
        kept = {k: v.numel() * v.element_size() for k, v in learner.rollout_codes.items()}
        codes = sum(size for k, size in kept.items() if k.endswith(("weight_q", "proj.weight")))
        rest = sum(kept.values()) - codes  # scales, norms, biases: what the estimate leaves out
        with_codes, without = (estimate(model, 64, 20, 32, 16, False, fmt, torch.bfloat16,
                                        "cuda", False, k) for k in (True, False))
        assert abs((with_codes["held"] - without["held"]) * 2**30 - sum(kept.values())) <= rest
        assert codes > 5 * rest  # (on a real checkpoint far more)


def test_dry_run_meta_model_matches_the_loaded_one(tiny, dry_run):
    model, _ = dry_run.meta_model(TINY)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert shapes == {n: p.shape for n, p in tiny[0].named_parameters()}
    assert all(p.device.type == "meta" for p in model.parameters())


def test_bench_rollout_on_the_tiny_model(tmp_path, monkeypatch):
    """bench.py rollout: every sampler precision as a ratio to the unquantized one (in bf16 too:
    the NF4 sampler once crashed there), and model.generate on the same rows."""
    out = tmp_path / "bench.jsonl"
    bench = _script(HERE / "tools" / "bench.py", "bench")
    monkeypatch.setattr(qurl, "stop_token_ids", qurl.stop_token_ids)  # bench.main ignores EOS
    bench.main(["rollout", "--dtype", "bfloat16", "--bench-batch", "4,8", "--max-new-tokens", "8",
                "--out", str(out), "--runs", "1"])
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["quant"], r["batch"], r["dtype"]) for r in rows] == [
        (q, b, "bfloat16") for q in ("none", "fp16", "bf16", "int8", "fp8", "nf4") for b in (4, 8)]
    assert all(r["tok_s"] > 0 and r["sync_s"] >= 0 for r in rows)
    assert all(("generate_tok_s" in r) == (r["quant"] == "bf16") for r in rows)


def test_bench_gemm_variants_compute_the_samplers_product():
    """Every FP8 way of a decode GEMM that `tools/bench.py gemm` times computes what the sampler
    computes (the per-token, per-channel FP8 product of the formats' definitions), bf16 the plain
    product; the fused linears' widths are the separate ones' sums."""
    bench = _script(HERE / "tools" / "bench.py", "bench")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=gen), torch.randn(48, 64, generator=gen) / 8
    fp8 = _ref_fake_quant(x, "fp8") @ _ref_fake_quant(w, "fp8").t()
    variants = bench.gemm_variants(x, w, torch.device("cpu"))
    assert set(variants) > {"bf16", "fp8_rowwise", "fp8_tensorwise", "fp8_swapped"}
    for name, fn in variants.items():
        y = fn()
        if name == "fp8_act_quant_only":
            assert y.dtype == torch.float8_e4m3fn and y.shape == x.shape
            continue
        want = (x.double() @ w.double().t()) if name == "bf16" else fp8
        tol = 2e-2 if name == "bf16" else 1e-5
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    shapes = bench.decode_linears("qwen2.5-7b")
    assert shapes["qkv"][1] == sum(shapes[n][1] for n in "qkv")
    assert shapes["gate_up"][1] == shapes["gate"][1] + shapes["up"][1] == 2 * 18944


def test_bench_step_limit_counts_the_model_it_names():
    """`step_limit_ms` against the published 0.5B architecture built on the meta device (its
    decoder linears' and lm_head's parameters counted), by hand: one row reads every byte once
    (memory-bound); at 4,096 rows the GEMMs are bound by their flops (FP8 at twice bf16's peak),
    attention still by its cache reads."""
    from transformers import AutoConfig, AutoModelForCausalLM
    bench = _script(HERE / "tools" / "bench.py", "bench")
    _, h, layers, heads, kv, inter, vocab, tied = bench.MODEL_CONFIGS["qwen2.5-0.5b"]
    config = AutoConfig.for_model("qwen2", hidden_size=h, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv,
                                  intermediate_size=inter, vocab_size=vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for _, m in qurl.decoder_linears(model))
    head = model.lm_head.weight.numel()
    kv_bytes = layers * 2 * kv * (h // heads) * 100 * 2  # K and V of 100 tokens, bf16
    for quant, weight_bytes in (("bf16", 2), ("fp8", 1), ("nf4", 0.5625)):
        want = (linear * weight_bytes + 2 * head + kv_bytes) / 4.8e12 * 1e3
        assert bench.step_limit_ms("qwen2.5-0.5b", 1, 100, quant) == pytest.approx(want)
    rows = 4096  # the GEMMs compute-bound, attention still bound by its cache reads
    for quant, peak in (("bf16", 989e12), ("fp8", 1979e12)):
        want = 2 * rows * linear / peak + 2 * rows * head / 989e12 + rows * kv_bytes / 4.8e12
        assert bench.step_limit_ms("qwen2.5-0.5b", rows, 100, quant) == pytest.approx(want * 1e3)


def test_gpu_table_sweep_pairs_bf16_and_fp8_at_each_row_count(tmp_path):
    """`tools/gpu_table.py --sweep`: one line per shape and row count, FP8's tokens/s over bf16's,
    each step's milliseconds beside its limit; rows that did not compile are left out; --plot
    writes the figure. (The rows are made up here: this checks the table, not a result.)"""
    rows = [{"device": "d", "model": shape, "quant": quant, "batch": batch, "compiled": True,
             "compiled_tok_s": batch * (300.0 if quant == "fp8" else 200.0), "prefill_s": 0.5,
             "step_ms": 2.0, "limit_step_ms_h200": 1.0}
            for shape in ("qwen2.5-0.5b", "qwen2.5-7b") for batch in (64, 256)
            for quant in ("bf16", "fp8")]
    rows.append(rows[0] | {"quant": "nf4", "compiled": False})
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = subprocess.run([sys.executable, str(HERE / "tools/gpu_table.py"), str(path), "--sweep",
                          "--plot", str(tmp_path / "sweep.png")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("| qwen")]
    assert len(lines) == 4 and all("| 1.50 | 2.00 (1.00) | 2.00 (1.00) |" in line for line in lines)
    assert "| qwen2.5-7b | 256 | 51200 | 76800 |" in res.stdout
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@CUDA
def test_cuda_bench_gemm_variants_compute_the_samplers_product():
    """On a GPU, at a decode shape: each FP8 way within the bf16 output's rounding of the FP8
    product of the formats' definitions (fast accumulation within 1e-2), every variant timed."""
    bench = _script(HERE / "tools" / "bench.py", "bench")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 896, device=device, generator=gen)
    w = torch.randn(1152, 896, device=device, generator=gen) / 30
    fp8 = _ref_fake_quant(x, "fp8") @ _ref_fake_quant(w, "fp8").t()
    for name, fn in bench.gemm_variants(x, w, device, tune=False).items():
        if name in ("bf16", "fp8_act_quant_only"):
            continue
        tol = 1e-2 if "fast" in name else 8e-3
        assert _rel_err(fn().double(), fp8) < tol, name
        assert bench._gemm_ms(fn, device, 3)[0] > 0


def test_bench_train_measures_peaks_beside_the_estimate(tmp_path):
    """bench.py train runs whole RL steps and reports the rollout's and the step's peak memory
    beside the estimate. A fresh process: freed memory of other tests would serve."""
    out = tmp_path / "bench.jsonl"
    command = [sys.executable, str(HERE / "tools" / "bench.py"), "train", "--quant", "fp8",
               "--model", TINY, "--prompts-per-step", "2", "--group-size", "4",
               "--max-new-tokens", "8", "--out", str(out)]
    res = subprocess.run(command, capture_output=True, text=True, cwd=HERE, timeout=300)
    assert res.returncode == 0, res.stderr
    row = json.loads(out.read_text())
    assert row["device"].startswith("cpu") and row["rows"] == 8 and row["tok_s"] > 0
    assert row["step_s"] > 0 and row["step_peak_gib"] > 0
    assert row["step_est_gib"] >= row["rollout_est_gib"] > 0
    parts = [row[k] for k in ("sync_s", "rollout_s", "prox_s", "update_s")]  # the step, split
    assert min(parts) >= 0 and row["rollout_s"] > 0 and row["update_s"] > 0
    assert 0.5 * row["step_s"] < sum(parts) <= 1.1 * row["step_s"]


@pytest.fixture(scope="module")
def lab():
    return _script(HERE / "tools" / "mismatch.py", "mismatch")


def test_mismatch_lab_sources_change_only_what_they_claim(tiny, lab):
    """fp8_weights is F.linear on the FP8 codes' values and the exact activation, fp8_activations
    the exact weight on per-token FP8 activations (both against the formats' definitions), and
    lm_head_bf16 changes the lm_head alone (the tied embedding stays exact)."""
    actor = tiny[0]
    x = torch.randn(5, actor.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    name, linear = qurl.decoder_linears(actor)[0]  # q_proj, with a bias
    weight, bias = linear.weight.detach().double(), linear.bias.detach().double()
    for source, want in (
            ("fp8_weights", F.linear(x.double(), _ref_fake_quant(weight.float(), "fp8"), bias)),
            ("fp8_activations", F.linear(_ref_fake_quant(x, "fp8"), weight, bias))):
        copied = dict(lab.build_sampler(actor, source).named_modules())[name]
        got = copied(x)
        assert not torch.equal(got, linear(x))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    sampler = lab.build_sampler(actor, "lm_head_bf16")
    head = sampler.get_output_embeddings().weight
    assert torch.equal(head, actor.get_output_embeddings().weight.bfloat16().float())
    assert not torch.equal(head, actor.get_output_embeddings().weight)
    exact = dict(actor.named_parameters())
    others = [(n, p) for n, p in sampler.named_parameters() if "lm_head" not in n]
    assert len(others) == len(exact) and all(torch.equal(p, exact[n]) for n, p in others)


def test_mismatch_lab_on_the_tiny_model(tmp_path, lab):
    """At the lab's defaults the floor is summation order alone (<= 1e-7); the aligned value (the
    sampler's decode, fed its tokens) is the decode exactly, kl and kl_exact 0, for a W8A8 and a
    W4A16 sampler (one code path for every *_aligned source; int8's and bf16's decode fed its
    tokens: test_decode_fed_its_own_tokens_reproduces_logp_behav), while QaRL's full-forward value
    stays off it; kl_exact >= 0 everywhere. --layers: the decode and the sampler's own full
    forward share the first layer's input exactly, then differ in the last bits (the floor's
    values) and, rarely here, in FP8 codes. On NF4's mismatch over ~10,000 tokens k3's mean lies
    within its standard error of the exact KL it estimates (at 2,500 tokens its heavy tail put it
    1.7 standard errors low)."""
    out = tmp_path / "lab.jsonl"
    lab.main(["--sources", "floor,fp8,fp8_aligned,fp8_aligned_forward,nf4_aligned,stale",
              "--layers", "--json", str(out), "--plot", str(tmp_path / "lab.png")])
    rows = {row["source"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert 0 <= rows["floor"]["kl"] <= 1e-7 and rows["floor"]["kl_exact"] <= 1e-7
    for fmt in ("fp8", "nf4"):
        assert rows[f"{fmt}_aligned"]["kl"] == rows[f"{fmt}_aligned"]["kl_exact"] == 0.0
    assert 0 < rows["fp8_aligned_forward"]["kl"] <= 10 * rows["floor"]["kl"]
    assert rows["fp8"]["kl"] > 1e4 * rows["fp8_aligned_forward"]["kl"]
    assert rows["stale"]["kl"] > 1e4 * rows["floor"]["kl"]
    assert all(row["kl_exact"] >= 0 and len(row["layers"]) == 2 for row in rows.values())
    assert rows["fp8"]["layers"][0] > 0 and rows["floor"]["layers"] == [0.0, 0.0]
    assert rows["floor"]["crossings"][0] == 0 < rows["floor"]["crossings"][1]
    assert rows["fp8"]["crossings"][0] == 0 and rows["fp8"]["crossings"][1] < 1e-3
    assert (tmp_path / "lab.png").read_bytes()[:4] == b"\x89PNG"

    lab.main(["--sources", "nf4", "--prompts", "64", "--json", str(out)])
    nf4 = json.loads(out.read_text())
    assert nf4["tokens"] > 10_000 and abs(nf4["kl"] - nf4["kl_exact"]) <= nf4["kl_se"]
    assert 0 < nf4["ess"] < 1 and nf4["w_truncated"] > 0


def test_plot_writes_png(tmp_path):
    pytest.importorskip(
        "matplotlib", reason="matplotlib is not installed (it is in requirements.txt)"
    )
    for name, quant in (("p_none", "none"), ("p_fp8", "fp8")):
        qurl.train(_small_args(tmp_path, run_name=name, quant=quant, eval_every=1))
    out = tmp_path / "fig" / "cmp.png"
    plot = _script(HERE / "tools" / "plot.py", "plot")
    # one update per rollout clips no token: the clip panel shows 0 on a plain axis
    fig = plot.plot_runs([str(tmp_path / "p_none")], str(out))
    clip = fig.axes[list(plot.PANELS).index("clip/low")]
    fig.canvas.draw()
    assert clip.yaxis.get_offset_text().get_text() == ""
    low, high = clip.get_ylim()
    assert low < 0 < high and set(clip.lines[0].get_ydata()) == {0.0}
    plot.main([str(tmp_path / "p_none"), str(tmp_path / "p_fp8"), "--out", str(out)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 400 and img.shape[1] > 800 and img.std() > 0.01  # a drawn figure
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "nope"), "--out", str(out)])


def test_plot_arms_average_their_seeds(tmp_path, capsys):
    """--table and --arms group runs ARM-sN by ARM: the end accuracy, the evaluations from step
    end - last on and each metric's mean over the last `last` steps, mean ± sample std over the
    seeds (hand-computed here); the figure shades the seeds' range and keeps an arm's colour in
    every panel."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    runs = {"a-s1": ([0.1, 0.3, 0.5], 0.2), "a-s2": ([0.2, 0.5, 0.7], 0.4),
            "b-s1": ([0.1] * 3, 0.0)}
    for name, (evals, kl) in runs.items():
        (tmp_path / name).mkdir()
        rows = [{"step": step, "mismatch/kl": kl + step / 100,
                 "eval/acc": evals[step // 2 - 1] if step % 2 == 0 else None,
                 "tbpo/kept": 0.5 if name == "b-s1" else None}
                for step in range(1, 7)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot = _script(HERE / "tools" / "plot.py", "plot")
    plot.main([str(tmp_path / name) for name in runs] + ["--table", "--last", "2",
                                                          "--metrics", "mismatch/kl,tbpo/kept"])
    table = capsys.readouterr().out.splitlines()
    # a: end 50, 70 -> 60 ± 14.1; evals at steps >= 4: (30 + 50) / 2, (50 + 70) / 2 -> 50 ± 14.1;
    # kl over steps 5, 6: 0.255, 0.455 -> 0.355 ± 0.141; tbpo/kept: a logs none
    assert table[2] == ("| a | 2 | 60.0 ± 14.1 (50.0, 70.0) | 50.0 ± 14.1 (40.0, 60.0) | "
                        "0.355 ± 0.141 (0.255, 0.455) | — |")
    assert table[3] == ("| b | 1 | 10.0 (one seed) | 10.0 (one seed) | 0.055 (one seed) | "
                        "0.5 (one seed) |")
    (tmp_path / "cut-s1").mkdir()  # stopped at step 5, after its evaluation at 4: said, not a crash
    cut = [{"step": step, "eval/acc": 0.5 if step == 4 else None} for step in range(1, 6)]
    (tmp_path / "cut-s1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut))
    with pytest.raises(SystemExit, match="cut-s1 ends at step 5 without an evaluation"):
        plot.main([str(tmp_path / "cut-s1"), "--table"])
    fig = plot.plot_runs([str(tmp_path / name) for name in runs], str(tmp_path / "arms.png"),
                         ["eval/acc", "mismatch/kl", "tbpo/kept"], arms=True)
    acc, kept = fig.axes[0], fig.axes[2]
    assert [line.get_label() for line in acc.lines] == ["a", "b"]
    assert kept.lines[0].get_color() == acc.lines[1].get_color()  # b's colour where a has none
    assert list(acc.lines[0].get_ydata()) == pytest.approx([0.15, 0.4, 0.6])
    assert len(acc.collections) == 1  # one shaded range: arm a's two seeds

# ==================================================================================================
# The file itself: copyable method functions, metric names in one place
# ==================================================================================================
def _defines(node) -> set[str]:
    """The module-level names a top-level statement of qurl.py defines (def, class, assignment,
    tuple assignment included)."""
    import ast
    targets = [t for t in getattr(node, "targets", [getattr(node, "target", None)]) if t]
    names = {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
    return names | ({node.name} if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else set())


def copy_table() -> dict[str, list[str]]:
    """The README's copy table: {what you want: the names of qurl.py to copy}."""
    import ast
    defined = set().union(*map(_defines, ast.parse(Path(qurl.__file__).read_text()).body))
    readme = (HERE / "README.md").read_text()
    table = readme[readme.index("| you want | copy |"):].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        want, names = line.split(" | ")[:2]
        rows[want.strip("| ")] = [n for n in re.findall(r"`(\w+)`", names) if n in defined]
        if "quantized sampler's row" in names:
            rows[want.strip("| ")] += rows["a quantized sampler"]
    return rows


def fresh_module(names: list[str]):
    """A new module holding qurl.py's imports and the source of `names` alone, as a reader would
    paste them into an empty file; fails if they use another name of qurl.py."""
    import ast
    import types
    src = Path(qurl.__file__).read_text()
    lines = src.splitlines()
    module_names, pieces = set(), []
    for n in ast.parse(src).body:
        module_names |= _defines(n)
        if _defines(n) & set(names):
            start = min([d.lineno for d in getattr(n, "decorator_list", [])] + [n.lineno])
            pieces.append("\n".join(lines[start - 1:n.end_lineno]))
    used = {x.id for piece in pieces for x in ast.walk(ast.parse(piece))
            if isinstance(x, ast.Name)} & module_names
    assert used <= set(names), ("also needs", sorted(used - set(names)))
    header = lines[lines.index("from __future__ import annotations"):
                   lines.index("from torch import Tensor, nn") + 1]
    module = types.ModuleType(f"copied_{abs(hash(tuple(names)))}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile("\n".join(header + pieces), module.__name__, "exec"), module.__dict__)
    return module


def _copied_loss(m):
    lp, prox, behav, adv, mask = (torch.tensor(v, dtype=torch.float64)
                                  for v in (LP, LP_PROX, LP_BEHAV, ADV, [[1.0, 1.0], [1.0, 0.0]]))
    options = {k: v for k, v in LOSS_OPTIONS.items() if k != "tbpo_band"}
    for kind in ("naive", "tis", "acr"):
        got = m.token_loss(lp, prox, behav, adv, mask, kind, **options)
        want = qurl.token_loss(lp, prox, behav, adv, mask, kind, **options)
        assert got[0] == want[0] and got[1] == want[1]
    band = LOSS_OPTIONS["is_cap"], LOSS_OPTIONS["tbpo_band"]
    assert m.tbpo_loss(lp, prox, behav, adv, mask, *band)[0] == qurl.tbpo_loss(
        lp, prox, behav, adv, mask, *band)[0]


def _copied_sampler(m, tiny, problems):
    import copy
    actor = copy.deepcopy(tiny[0])
    ids = tiny[1]([qurl.format_prompt(problems[0]["question"], tiny[1])],
                  return_tensors="pt")["input_ids"]
    for fmt in ("fp8", "int8", "nf4"):
        ours, theirs = m.make_sampler(actor, fmt, torch.float32), qurl.make_sampler(
            actor, fmt, torch.float32)
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        with torch.no_grad():
            actor.model.layers[0].mlp.up_proj.weight.add_(0.01)  # (a scale would flip no code)
        assert m.sync_weights(ours, actor) == qurl.sync_weights(theirs, actor) > 0
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    return actor, ids


def test_copy_table_rows_run_in_an_empty_module(tiny, problems):
    """Each row of the README's copy table, pasted alone into an empty module, needs no other name
    of qurl.py and computes what qurl.py computes."""
    import copy
    rows = copy_table()
    assert len(rows) == 7 and all(rows.values())
    modules = {want: fresh_module(names) for want, names in rows.items()}
    _copied_loss(modules["a loss"])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(
        modules["GRPO advantages"].group_advantages(rewards, 4),
        qurl.group_advantages(rewards, 4)))
    logs = torch.tensor(LP_PROX), torch.tensor(LP_BEHAV), torch.ones(2, 2)
    assert modules["mismatch metrics"].mismatch_metrics(*logs) == qurl.mismatch_metrics(*logs)
    actor, ids = _copied_sampler(modules["a quantized sampler"], tiny, problems)

    with modules["the aligned forward"].rollout_aligned(actor, "fp8"):
        ours = actor(ids).logits
    with qurl.rollout_aligned(actor, "fp8"):
        assert torch.equal(ours, actor(ids).logits)
    scaled = copy.deepcopy(actor)
    modules["invariant scaling"].invariant_rescale(scaled, 1.5)
    torch.testing.assert_close(scaled(ids).logits, actor(ids).logits, rtol=1e-4, atol=1e-4)

    prompts, generators = _mixed_prompts(tiny[1], problems, 4), [torch.Generator() for _ in "ab"]
    ours, theirs = (sample(actor, tiny[1], prompts, 2, 8, 1.0, g.manual_seed(0)) for sample, g in
                    zip((modules["a sampler with `logp_behav`"].sample, qurl.sample), generators))
    assert torch.equal(ours.input_ids, theirs.input_ids)
    assert torch.equal(ours.logp_behav, theirs.logp_behav)


def test_the_lesson_file_keeps_its_shape():
    """qurl.py is read line by line: its size counted in characters without indentation, the
    method between its banners, lines of at most 100 columns everywhere, functions of at most 60
    lines and in paragraphs past 20, a docstring on every function of the method and a test that
    names it, conditional expressions few and never inside another expression."""
    import ast
    src = Path(qurl.__file__).read_text()
    lines = src.splitlines()
    chars = sum(len(line.strip()) for line in lines)
    start = next(i for i, line in enumerate(lines) if "THE METHOD" in line)
    end = next(i for i, line in enumerate(lines) if "APPENDIX" in line)
    method = sum(len(line.strip()) for line in lines[start:end])
    compiled = next(i for i, line in enumerate(lines) if line.startswith("def compiled_sample"))
    compiled = sum(len(line.strip()) for line in lines[compiled - 1:])  # with its decorator
    # the issues' bounds (45, 46)
    assert chars <= 67_000 and method <= 36_400 and compiled <= 9_400, (chars, method, compiled)
    for path in [Path(qurl.__file__), Path(__file__), *sorted((HERE / "tools").glob("*.py"))]:
        wide = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if len(line) > 100]
        assert not wide, (path.name, wide)

    tree = ast.parse(src)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in functions
            if n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
    unbroken = [n.name for n in functions if n.end_lineno - n.lineno + 1 > 20
                and "" not in [line.strip() for line in lines[n.lineno:n.end_lineno]]]
    assert not unbroken, unbroken

    method_defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                   and start < n.lineno <= end]
    assert len(method_defs) > 20
    undocumented = [n.name for n in method_defs if not ast.get_docstring(n)
                    and isinstance(n, ast.FunctionDef)]
    assert not undocumented, undocumented
    test_tree = ast.parse(Path(__file__).read_text())
    tests = [(n.name, ast.get_docstring(n) or "") for n in test_tree.body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    untested = [n.name for n in method_defs if not any(
        n.name.strip("_").lower() in name or f"`{n.name}`" in doc for name, doc in tests)]
    assert not untested, untested

    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    conditionals = [n for n in ast.walk(tree) if isinstance(n, ast.IfExp)]
    nested = [n.lineno for n in conditionals
              if not isinstance(parents[id(n)], (ast.Assign, ast.AnnAssign, ast.Return))]
    assert len(conditionals) <= 25 and not nested, (len(conditionals), nested)


def test_metric_names_defined_once_and_in_the_glossary():
    """METRIC_KEYS is the one list (rows hold exactly these: see test_end_to_end); the README's
    glossary names each."""
    readme = (HERE / "README.md").read_text()
    glossary = readme[readme.index("| metric |"):]
    glossary = glossary[:glossary.index("\n\n")]
    assert all(f"`{k}`" in glossary for k in qurl.METRIC_KEYS if k != "step"), \
        [k for k in qurl.METRIC_KEYS if f"`{k}`" not in glossary]
    assert len(set(qurl.METRIC_KEYS)) == len(qurl.METRIC_KEYS)
