"""Regenerate qurl's embedded default: arithmetic problems in GSM8K's format and a tiny, warm-started Qwen2.

    python data/make_tiny.py            # about 1 min 45 s on 2 CPU cores
    python data/make_tiny.py --probe data/tiny-qwen runs/fp8-acr-s1/final   # where a model stands on the slip

Writes data/arith_train.jsonl (20,000 problems), data/arith_test.jsonl (500, disjoint from train), their one-digit
multiplications (data/arith_mul_*.jsonl: 683 and 117 distinct questions) and data/tiny-qwen/
(a character-level tokenizer and a ~0.5M-parameter Qwen2ForCausalLM). The model is trained for SFT_STEPS steps of
plain supervised next-token prediction, in exactly the prompt format qurl.py uses (`qurl.format_prompt`), on *noisy
demonstrations*: the train problems, where in P_SLIP of the problems that need a carry or a borrow the worked solution
makes the classic slip of forgetting it (48+26=64, 52-27=35; see `slip`). The jsonl files keep the correct answers.

Why the noise: RL with a verifiable reward mostly turns what a model can already sample into what it answers greedily
(pass@k into pass@1). A warm start that imitated only correct solutions is capability-bound at this size: RL then has to
teach arithmetic itself, a few points per hundred steps. The slipped demonstrations give the warm start a systematic,
greedy-visible error whose fix it already samples now and then, which is the regime real reasoning models are in when
RL helps them, and the reward is what removes it. The jsonl files are byte-identical on every run (fixed seed); the
weights depend on the CPU's float math.
"""
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import qurl  # noqa: E402

SEED = 0
N_TRAIN, N_TEST = 20_000, 500
P_SLIP = 0.7  # share of the carry/borrow problems whose demonstration forgets the carry (or the borrow)
SFT_STEPS, EVAL_EVERY, BATCH, LR = 1000, 250, 64, 1e-3


def make_problem(rng: random.Random) -> dict:
    kind = rng.choice(["add", "sub", "mul", "add_sub"])
    a, b, c = rng.randint(0, 99), rng.randint(0, 99), rng.randint(0, 99)
    if kind == "add":
        q, sol, ans = f"What is {a} + {b}?", f"{a}+{b}={a + b}", a + b
    elif kind == "sub":
        q, sol, ans = f"What is {a} - {b}?", f"{a}-{b}={a - b}", a - b
    elif kind == "mul":
        b = rng.randint(2, 9)
        q, sol, ans = f"What is {a} * {b}?", f"{a}*{b}={a * b}", a * b
    else:
        q, sol, ans = f"What is {a} + {b} - {c}?", f"{a}+{b}={a + b}, {a + b}-{c}={a + b - c}", a + b - c
    return {"question": q, "answer": f"{sol}\n#### {ans}"}


def make_data() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    test, seen = [], set()
    while len(test) < N_TEST:
        p = make_problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            test.append(p)
    train = []
    while len(train) < N_TRAIN:
        p = make_problem(rng)
        if p["question"] not in seen:  # disjoint from test; repeats within train are fine (few '*' problems exist)
            train.append(p)
    return train, test


def multiplications(rows: list[dict]) -> list[dict]:
    """The one-digit multiplications among rows, each question once: SmolLM2-135M-Instruct's task in qurl's README
    ("A real checkpoint on a laptop"), where its greedy accuracy starts at 18 % (8 % on the whole set)."""
    seen = set()
    return [r for r in rows if "*" in r["question"] and not (r["question"] in seen or seen.add(r["question"]))]


def slip(question: str) -> tuple[str, int] | None:
    """The worked solution and answer of a student who forgets to carry (or to borrow), or None where no carry or borrow
    occurs (the slip would give the right answer). a+b: the tens carry dropped (48+26=64); a-b: the borrow dropped, so
    the tens are not decremented (52-27=35); a*b: the carry from the units product dropped (47*6=242); a+b-c: the slip
    in the addition, the subtraction then done right on the wrong sum."""
    nums = [int(n) for n in re.findall(r"\d+", question)]
    if "*" in question:
        a, b = nums
        carry = (a % 10) * b // 10
        return (f"{a}*{b}={a * b - 10 * carry}", a * b - 10 * carry) if carry else None
    if "+" in question and "-" in question:
        a, b, c = nums
        if a % 10 + b % 10 < 10:
            return None
        s = a + b - 10
        return f"{a}+{b}={s}, {s}-{c}={s - c}", s - c
    if "+" in question:
        a, b = nums
        return (f"{a}+{b}={a + b - 10}", a + b - 10) if a % 10 + b % 10 >= 10 else None
    a, b = nums
    hi, lo = max(a, b), min(a, b)
    if hi % 10 >= lo % 10:
        return None
    r = (hi - lo + 10) * (1 if a >= b else -1)  # the tens digit of hi is not decremented
    return f"{a}-{b}={r}", r


def noisy_demonstrations(train: list[dict]) -> list[dict]:
    """The SFT corpus: each train problem once; P_SLIP of those with a carry or a borrow show the slip instead."""
    rng = random.Random(SEED + 1)
    out = []
    for p in train:
        s = slip(p["question"])
        out.append({"question": p["question"], "answer": f"{s[0]}\n#### {s[1]}"} if s and rng.random() < P_SLIP else p)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def make_tokenizer(out: Path):
    """Qwen2's own tokenizer class (byte-level BPE) with one token per byte and no merges: a character-level
    tokenizer that reloads with AutoTokenizer exactly as a real Qwen tokenizer does. <|endoftext|> is EOS and pad."""
    from transformers import AutoTokenizer
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer
    vocab = {"<|endoftext|>": 0}
    vocab.update({ch: i + 1 for i, ch in enumerate(sorted(ByteLevel.alphabet()))})  # the 256 byte symbols
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], padding_side="left", model_max_length=256)
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)  # train with exactly what users will load


def make_model(vocab_size: int, eos: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=eos, eos_token_id=eos,
                      pad_token_id=eos)
    return Qwen2ForCausalLM(cfg)


def sft_batch(rows, tok, rng: torch.Generator):
    """Prompt + answer + EOS, right-padded; loss only on the answer and its EOS."""
    idx = torch.randint(len(rows), (BATCH,), generator=rng).tolist()
    seqs, starts = [], []
    for i in idx:
        p = tok(qurl.format_prompt(rows[i]["question"], tok), add_special_tokens=False)["input_ids"]
        a = tok(rows[i]["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        starts.append(len(p))
    T = max(map(len, seqs))
    ids = torch.full((BATCH, T), tok.pad_token_id)
    labels = torch.full((BATCH, T), -100)
    am = torch.zeros(BATCH, T, dtype=torch.long)
    for r, (s, st) in enumerate(zip(seqs, starts)):
        ids[r, :len(s)] = torch.tensor(s)
        am[r, :len(s)] = 1
        labels[r, st:len(s)] = torch.tensor(s[st:])
    return ids, am, labels


def main() -> None:
    t0 = time.time()
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    train, test = make_data()
    write_jsonl(HERE / "arith_train.jsonl", train)
    write_jsonl(HERE / "arith_test.jsonl", test)
    write_jsonl(HERE / "arith_mul_train.jsonl", multiplications(train))
    write_jsonl(HERE / "arith_mul_test.jsonl", multiplications(test))
    out = HERE / "tiny-qwen"
    tok = make_tokenizer(out)
    model = make_model(len(tok), tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"data written; model {n_params / 1e6:.2f}M parameters", flush=True)
    problems = qurl.load_problems(str(HERE / "arith_test.jsonl"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rng = torch.Generator().manual_seed(SEED)
    demos = noisy_demonstrations(train)
    n_slip = sum(d is not p for d, p in zip(demos, train))
    print(f"SFT corpus: {len(demos)} problems, {n_slip} with a slipped carry/borrow", flush=True)
    acc = acc100 = 0.0
    for step in range(1, SFT_STEPS + 1):
        ids, am, labels = sft_batch(demos, tok, rng)
        loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % EVAL_EVERY == 0:
            model.eval()
            acc100 = qurl.evaluate(model, tok, problems[:100], max_new_tokens=32)
            acc = (acc100 * 100 + qurl.evaluate(model, tok, problems[100:], max_new_tokens=32) * 400) / 500
            model.train()
            print(f"step {step} loss {loss.item():.3f} held-out acc {acc:.3f} (first 100: {acc100:.2f}) "
                  f"[{time.time() - t0:.0f}s]", flush=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"params": n_params, "sft_steps": SFT_STEPS, "p_slip": P_SLIP, "slipped_demos": n_slip, "batch": BATCH,
            "lr": LR, "seconds": round(time.time() - t0, 1),
            "heldout_acc_500": round(acc, 4), "heldout_acc_first_100": round(acc100, 4), "max_new_tokens": 32,
            "torch": torch.__version__}
    (out / "warmup.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


def probe(model_dir: str, k: int = 8) -> None:
    """Where a model stands on the slip, split by whether a test problem needs a carry or borrow: greedy right, greedy
    equal to the slipped answer, one sample right (T = 1) and right in at least one of k samples (pass@k)."""
    torch.manual_seed(SEED)
    model, tok = qurl.load_model(model_dir, "cpu", torch.float32)
    problems = qurl.load_problems(str(HERE / "arith_test.jsonl"))
    prompts = [qurl.format_prompt(p["question"], tok) for p in problems]
    greedy = qurl.sample(model.eval(), tok, prompts, n=1, max_new_tokens=32, temperature=0.0).texts
    g = torch.Generator().manual_seed(SEED)
    samples = qurl.sample(model, tok, prompts, n=k, max_new_tokens=32, temperature=1.0, generator=g).texts
    print(f"{model_dir}\n| problems | count | greedy right | greedy gives the slip | one sample right | pass@{k} |")
    slips = [slip(p["question"]) for p in problems]
    for name, want in (("with a carry or borrow", True), ("without", False)):
        idx = [i for i, s in enumerate(slips) if (s is not None) == want]
        right = sum(qurl.reward(greedy[i], problems[i]["gold"]) for i in idx) / len(idx)
        slipped = f"{sum(qurl.reward(greedy[i], str(slips[i][1])) for i in idx) / len(idx):.0%}" if want else "-"
        r = [[qurl.reward(samples[i * k + j], problems[i]["gold"]) for j in range(k)] for i in idx]
        one = sum(sum(x) / k for x in r) / len(idx)
        pass_k = sum(max(x) for x in r) / len(idx)
        print(f"| {name} | {len(idx)} | {right:.0%} | {slipped} | {one:.0%} | {pass_k:.0%} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":  # python data/make_tiny.py --probe MODEL_DIR [MODEL_DIR ...]
        for d in sys.argv[2:]:
            probe(d)
    else:
        main()
