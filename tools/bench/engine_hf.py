"""The transformers baseline of `brigade bench engine`: fp32 `generate` on the same weights,
one stream, and the mixed workload as static padded batches (left padding + attention_mask,
every row decoding until the batch's longest is done; only a row's own tokens count).
"""

from __future__ import annotations

import random
import time

from tools.bench.engine_workload import PAD_TOKEN_ID, padded_batches

SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0}  # top_k 0: off


def load_model(model: str):
    """transformers' fp32 model (its CPU default) from the GGUF file or Hugging Face
    directory that the engine loads; None when transformers is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    from engine.weights import resolve_model

    path = resolve_model(model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, **kw).eval()


def single_decode(hf, vocab: int, num_tokens: int) -> float:
    """Greedy decode tok/s of one stream after a 32-token prompt (prefill subtracted)."""
    import torch

    ids = torch.tensor([[random.Random(2).randrange(3, vocab) for _ in range(32)]])

    def generate(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    generate(2)  # warm-up
    return round((num_tokens - 1) / (generate(num_tokens) - generate(1)), 1)


def generate_padded(hf, prompts: list[list[int]], steps: int, seed: int, **sampling):
    """One static batch: prompts left-padded to the longest with an attention_mask, exactly
    `steps` new tokens per row (min_new_tokens = max_new_tokens, so eos ends no row early).
    Returns the new token ids, [batch, steps]."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids,  # [batch, width]
            attention_mask=attention_mask,  # [batch, width], 0 on pads
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=PAD_TOKEN_ID,
            **sampling,
        )
    new = out[:, width:]  # [batch, steps]
    assert new.shape == (len(prompts), steps), f"generate returned {tuple(new.shape)}"
    return new


def run_workload(hf, workload, concurrency: int, seed: int) -> dict:
    """The workload as static padded batches of `concurrency` rows, sampled like the engine's
    run (temperature 0.8, top-p 0.95); tok/s counts each row's own max_tokens only."""
    generated = padded_rows = batches = 0
    t0 = time.perf_counter()
    for batch in padded_batches(workload, concurrency):
        prompts = [workload[i][0] for i, _, _, _ in batch]
        steps = batch[0][2]
        generate_padded(hf, prompts, steps, seed + batches, **SAMPLING)
        generated += sum(own for _, _, _, own in batch)
        padded_rows += steps * len(batch)
        batches += 1
    wall = time.perf_counter() - t0
    return {
        "requests": len(workload),
        "batches": batches,
        "generated_tokens": generated,
        "padded_row_steps": padded_rows,
        "wall_s": round(wall, 2),
        "tok_per_s": round(generated / wall, 1),
    }
