"""The estimated peak memory of a qurl run, without weights: `python tools/dry_run.py [qurl flags]`.

Prints the flags, the model's size, the data, one formatted prompt and `estimate_memory`'s peaks of
a training step and of its rollout. The model is built on the meta device from its config (shapes,
no memory), so a 7B model's estimate takes a second and no GPU.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import qurl  # noqa: E402


def estimate_memory(
    model,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    micro_batch: int,
    grad_ckpt: bool,
    quant: str,
    dtype: torch.dtype,
    device_type: str = "cuda",
    compiled: bool = False,
    codes_kept: bool = False,
) -> dict:
    """Estimated peak GiB of a training step's update and of its rollout from the model's shapes
    (meta-device will do). Held: fp32 masters and AdamW's moments (12 B per parameter) and the
    sampler. The update adds fp32 gradients, autocast's bf16 weight copies, what one micro-batch
    keeps for backward (per token and layer 36h + 8i bytes in bf16, 44h + 16i in fp32: Qwen2's
    saved tensors, counted) and 16 B per response logit. The rollout adds the KV cache in the
    dtypes the sampler keeps it (under autocast transformers keeps K, rotated by fp32 cos/sin, in
    fp32 and V in the compute dtype; --compile keeps both in the compute dtype; a bf16/fp16 copy
    in its own) and one decode step's logits. `codes_kept` (--align-forward with several
    optimizer steps a rollout): the update keeps a copy of the sampler's decoder layers (codes;
    their scales and norms, left out here) for the next flip rate, until the next RL step's sync."""
    c = model.config
    h, n_layers = c.hidden_size, c.num_hidden_layers
    inter, vocab = c.intermediate_size, c.vocab_size
    kv_dim = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    n_par = sum(param.numel() for param in model.parameters())
    n_lin = sum(mod.weight.numel() for _, mod in qurl.decoder_linears(model))
    bf16, b = dtype == torch.bfloat16, 2 if dtype == torch.bfloat16 else 4
    # lm_head: the quantized sampler holds it in the compute dtype, beside a tied embedding
    head = vocab * h
    if quant == "none":
        sampler, kv_bytes = 0, 4 + b  # the actor itself
    elif quant in ("bf16", "fp16"):
        sampler, kv_bytes = 2 * n_par, 4
    else:  # quantized decoder linears, an fp32 copy of the rest (the CPU: also dequantized fp32)
        per_weight = 0.5 + 4 / qurl.NF4_BLOCK if quant == "nf4" else 1
        sampler = (
            4 * (n_par - n_lin)
            + n_lin * per_weight
            + 4 * n_lin * (device_type == "cpu" and quant != "int8")
        )
        sampler += b * head - 4 * head * (not getattr(c, "tie_word_embeddings", False))
        kv_bytes = 4 + b
    if compiled and quant not in ("bf16", "fp16"):
        kv_bytes = 2 * b
    held = 12 * n_par + sampler
    if codes_kept:  # 1 B a code (NF4: half, and its block absmax), a half copy's 2 B values
        per_code = {"bf16": 2, "fp16": 2, "nf4": 0.5 + 4 / qurl.NF4_BLOCK}.get(quant, 1)
        held += n_lin * per_code * (quant != "none")
    mb, T = min(micro_batch, rows), prompt_len + new_tokens
    per_layer = 36 * h + 8 * inter if bf16 else 44 * h + 16 * inter
    acts = mb * T * (8 * h + (n_layers * 4 * h + per_layer if grad_ckpt else n_layers * per_layer))
    logits = 16 * mb * (new_tokens + 1) * vocab
    train = held + 4 * n_par + 2 * (n_lin + vocab * h) * bf16 + acts + logits
    rollout = held + rows * T * n_layers * kv_dim * kv_bytes + rows * vocab * (b + 8)
    sizes = dict(train=train, rollout=rollout, held=held, activations=acts, logits=logits)
    return {k: v / 2**30 for k, v in (sizes | {"sampler": sampler}).items()}


def meta_model(name: str):
    """(model on the meta device, tokenizer): the shapes of a model folder or hub model, no
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config, tokenizer = AutoConfig.from_pretrained(name), AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:  # 4.x: a malformed hub name's HFValidationError
        raise qurl.QurlError(
            f"cannot load model '{name}' as a folder here or a hub name (offline? data/tiny-qwen "
            f"is local): {str(e).splitlines()[0]}"
        )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), tokenizer


def main(argv=None) -> None:
    args = qurl.parse_args(argv)
    try:
        device, dtype = qurl.resolve_device_dtype(args.dtype)
        model, tokenizer = meta_model(args.model)
        train_set = qurl.load_problems(args.train_data, "train")
        test_set = qurl.load_problems(args.test_data, "test")
    except qurl.QurlError as e:
        sys.exit(f"qurl: error: {e}")
    prompt_len = qurl.check_prompt_lengths(model, tokenizer, train_set, args.max_new_tokens)
    rows = args.prompts_per_step * args.group_size
    sizes = rows, prompt_len, args.max_new_tokens, args.micro_batch
    kept = args.align_forward and args.mini_batches * args.ppo_epochs > 1
    est = estimate_memory(model, *sizes, args.grad_checkpointing, args.quant, dtype, device.type,
                          args.compile, kept)
    print(json.dumps(dataclasses.asdict(args), indent=1))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {args.model}: {type(model).__name__}, {params:.2f}M "
        f"parameters; sampler ({args.quant}) {est['sampler']:.3g} GiB"
    )
    print(
        f"estimated peak on {device.type} in {str(dtype)[6:]}: update {est['train']:.3g} GiB (held "
        f"{est['held']:.3g}, activations {est['activations']:.3g}, "
        f"logits {est['logits']:.3g}), rollout {est['rollout']:.3g} GiB; "
        f"{rows} rows of {prompt_len} + {args.max_new_tokens} tokens, "
        f"--micro-batch {args.micro_batch}"
        f"{' with --grad-checkpointing' if args.grad_checkpointing else ''}"
    )
    print(f"problems: {len(train_set)} train, {len(test_set)} test")
    print(
        f"one formatted prompt:\n{qurl.format_prompt(train_set[0]['question'], tokenizer)}\n"
        f"(gold: {train_set[0]['gold']})"
    )


if __name__ == "__main__":
    main()
