"""The fp32 model over the paged cache reproduces transformers' greedy ids (committed reference).

Each test drives the model by hand: blocks are handed out in a scrambled order so block tables
matter, and AttentionMetadata is built the way the engine core builds it.
"""

import json
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.loader import load_model

REFERENCE = json.loads(
    (Path(__file__).parents[1] / "data" / "hf_greedy_reference.json").read_text()
)
CONVS = REFERENCE["conversations"]
EOS = REFERENCE["eos_token_id"]
BLOCK_SIZE = 16
NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def fp32_model():
    model, config = load_model("smollm2-135m", dtype=torch.float32, quantization=None)
    return model, config


class PagedRunner:
    """Sequences over one KV pool; step() runs the new tokens of several sequences at once."""

    def __init__(self, model, config):
        self.model = model
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
        # scrambled: 47, 0, 46, 1, ... so a sequence's blocks are never contiguous
        order = [b for pair in zip(range(47, 23, -1), range(24), strict=True) for b in pair]
        self.free = order
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new: dict[int, list[int]]) -> dict[int, int]:
        """new: seq id -> its new token ids; returns seq id -> greedy next token."""
        ids, positions, slots, qlens, slens = [], [], [], [], []
        for seq, toks in new.items():
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop(0))
            ids += toks
            positions += range(start, end)
            slots += [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            qlens.append(len(toks))
            slens.append(end)
            self.lens[seq] = end
        width = max(len(self.blocks[s]) for s in new)
        table = [self.blocks[s] + [-1] * (width - len(self.blocks[s])) for s in new]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(
                [0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32
            ),
            seq_lens=torch.tensor(slens, dtype=torch.int32),
            block_tables=torch.tensor(table, dtype=torch.int32),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
            block_size=BLOCK_SIZE,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, attn)
        last = torch.tensor(qlens).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last])
        assert logits.dtype == torch.float32 and logits.shape[1] == 49152
        return dict(zip(new, logits.argmax(-1).tolist(), strict=True))


def greedy(
    runner, prompts: dict[int, list[int]], budgets: dict[int, int], chunk: int | None = None
):
    """Greedy-decode sequences side by side until eos or budget; prompts go in `chunk`-sized bites."""
    out: dict[int, list[int]] = {s: [] for s in prompts}
    active = set(prompts)
    while active:
        step = {}
        for s in sorted(active):
            done = runner.lens.get(s, 0)
            if done < len(prompts[s]):
                end = len(prompts[s]) if chunk is None else min(done + chunk, len(prompts[s]))
                step[s] = prompts[s][done:end]
            else:
                step[s] = [out[s][-1]]
        nxt = runner.step(step)
        for s in step:
            if runner.lens[s] < len(prompts[s]):
                continue  # mid-prefill: this chunk's logits are not a prediction
            out[s].append(nxt[s])
            if nxt[s] == EOS or len(out[s]) == budgets[s]:
                active.discard(s)
    return out


@pytest.mark.parametrize(("conv", "num_tokens"), [(0, 8), (1, 32), (3, 16)])
def test_single_sequence_matches_transformers_greedy(fp32_model, conv, num_tokens):
    ref = CONVS[conv]  # 0 ends with eos after 8 tokens; 3 is Japanese output
    out = greedy(PagedRunner(*fp32_model), {0: ref["prompt_ids"]}, {0: num_tokens})
    assert out[0] == ref["greedy_ids"][:num_tokens]


def test_batch_of_two_different_lengths_matches(fp32_model):
    a, b = CONVS[1], CONVS[2]  # 32 and 70 prompt tokens, decoded side by side
    out = greedy(
        PagedRunner(*fp32_model),
        {0: a["prompt_ids"], 1: b["prompt_ids"]},
        {0: 16, 1: len(b["greedy_ids"])},
    )
    assert out[0] == a["greedy_ids"][:16]
    assert out[1] == b["greedy_ids"]


def test_chunked_prefill_mixed_with_decode_matches(fp32_model):
    a, b = CONVS[0], CONVS[2]  # 37 and 70 prompt tokens in chunks of 17: `a` decodes while
    runner = PagedRunner(*fp32_model)  # `b` is still being prefilled
    out = greedy(runner, {0: a["prompt_ids"], 1: b["prompt_ids"]}, {0: 8, 1: 12}, chunk=17)
    assert out[0] == a["greedy_ids"]
    assert out[1] == b["greedy_ids"][:12]


def test_default_bf16_int4_decode_model_follows_the_reference():
    """The fast bf16 path ("auto": int4 GEMVs for decode, dense prefill) is not garbage: a
    high-margin continuation survives. Exactness is fp32's (the default's) job; bf16 flips
    low-margin ties."""
    model, config = load_model("smollm2-135m", dtype="bfloat16")
    assert model.quantization == "int4-decode"
    runner = PagedRunner(model, config)
    runner.caches = [(k.bfloat16(), v.bfloat16()) for k, v in runner.caches]
    ref = CONVS[1]
    out = greedy(runner, {0: ref["prompt_ids"]}, {0: 6})
    assert out[0] == ref["greedy_ids"][:6]  # "The sky is blue because of"


def test_forward_checks_the_number_of_kv_caches(fp32_model):
    model, config = fp32_model
    runner = PagedRunner(model, config)
    with pytest.raises(ValueError, match="29 KV caches for 30 layers"):
        runner.caches = runner.caches[:29]
        runner.step({0: [1, 2, 3]})
