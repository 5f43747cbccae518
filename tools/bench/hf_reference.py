"""Write transformers' greedy fp32 token ids (and tokenizer ids) for the default model.

Usage: python -m tools.bench.hf_reference [--out tests/data/hf_greedy_reference.json]
Needs the `reference` extra (transformers + accelerate); tests compare the engine against the
committed output, so they never need transformers themselves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Give me three names for a cat."},
        {"role": "assistant", "content": "Sure: Whiskers, Luna and Tiger."},
        {"role": "user", "content": "Now three for a dog 🐶, please."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Japanese (日本語) and French."}],
]

TOKENIZER_TEXTS: list[str] = [
    "Hello, world! This is plain ASCII text.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Numbers 1234567 and 3.14159, dates 2024-01-01.",
    "Emoji: 😀🎉👩\u200d👩\u200d👧 and ❤️",
    "CJK: 日本語のテキスト、中文文本。한국어",
    "Accents: ümlaut café naïve façade",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "don't you're I'LL we've",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="tests/data/hf_greedy_reference.json")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.weights import resolve_model

    path = resolve_model(args.model)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    conversations = []
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        greedy = out[0, len(prompt_ids) :].tolist()
        conversations.append(
            {
                "messages": messages,
                "prompt_text": text,
                "prompt_ids": prompt_ids,
                "greedy_ids": greedy,
            }
        )
        print(f"{len(prompt_ids)} prompt tokens -> {tok.decode(greedy)!r}")
    tokenizer_cases = [
        {"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TOKENIZER_TEXTS
    ]
    record = {
        "model": args.model,
        "gguf_file": path.name,
        "dtype": "float32",
        "max_new_tokens": args.max_new_tokens,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "eos_token_id": tok.eos_token_id,
        "conversations": conversations,
        "tokenizer": tokenizer_cases,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
