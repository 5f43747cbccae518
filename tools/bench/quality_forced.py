"""Teacher-forced passes of a model over corpus segments, scored against the fp32 reference.

A pass feeds each segment's true tokens through the paged KV cache in one of two shapes: the
prefill path (one sequence at a time, `tokens_per_step` tokens per forward) or the decode path
(`num_streams` segments side by side, each fed `tokens_per_step` tokens a step: 1 as a stream
decodes, 1 + k as a speculative draft of k tokens is verified). Every position's logits are
scored against the reference's (KL, top-1) and against the next true token (perplexity).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import LlamaForCausalLM
from tools.bench.quality_reference import ReferenceLlama

BLOCK_SIZE = 16


def split_segments(
    token_ids: list[int], segment_len: int, max_tokens: int | None
) -> list[list[int]]:
    """The corpus (cut to `max_tokens`) as consecutive segments of `segment_len` tokens; a last
    piece shorter than 2 tokens (no position to score) is dropped."""
    ids = token_ids[:max_tokens] if max_tokens else token_ids
    segments = [ids[i : i + segment_len] for i in range(0, len(ids), segment_len)]
    return [s for s in segments if len(s) >= 2]


def forced_logits(
    model: LlamaForCausalLM,
    segments: list[list[int]],
    *,
    num_streams: int,
    tokens_per_step: int,
    kv_dtype: torch.dtype | None = None,
) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (segment index, first position, fp32 logits [n, vocab]) as the forwards run: groups
    of `num_streams` segments share each step, each advancing `tokens_per_step` tokens; the KV
    cache in `kv_dtype` (None: the model's)."""
    config = model.config
    longest = max(len(s) for s in segments)
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    cache = KVCache(
        config,
        num_blocks=blocks_per_seq * num_streams,
        block_size=BLOCK_SIZE,
        dtype=kv_dtype or model.dtype,
        device=model.device,
    )
    for first in range(0, len(segments), num_streams):
        group = list(range(first, min(first + num_streams, len(segments))))
        # stream j owns blocks [j * blocks_per_seq, (j + 1) * blocks_per_seq)
        tables = [
            list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq)) for j in range(len(group))
        ]
        done = [0] * len(group)
        while True:
            active = [j for j, i in enumerate(group) if done[j] < len(segments[i])]
            if not active:
                break
            input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
            for j in active:
                seg, start = segments[group[j]], done[j]
                end = min(start + tokens_per_step, len(seg))
                input_ids += seg[start:end]
                positions += range(start, end)
                slots += [
                    tables[j][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    for p in range(start, end)
                ]
                query_lens.append(end - start)
                seq_lens.append(end)
            attn = AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                query_start_loc=torch.tensor(
                    [0, *np.cumsum(query_lens).tolist()], dtype=torch.int32
                ),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_tables=torch.tensor([tables[j] for j in active], dtype=torch.int32),
                query_lens_cpu=query_lens,
                seq_lens_cpu=seq_lens,
                block_size=BLOCK_SIZE,
            )
            ids_t = torch.tensor(input_ids, dtype=torch.int64)
            pos_t = torch.tensor(positions, dtype=torch.int64)
            hidden = model(ids_t, pos_t, cache.kv_caches, attn)  # [num_tokens, hidden]
            logits = model.compute_logits(hidden)  # [num_tokens, vocab] fp32
            row = 0
            for j, n in zip(active, query_lens, strict=True):
                yield group[j], done[j], logits[row : row + n]
                row += n
                done[j] += n


class Reference:
    """The reference's log-probabilities at every scored position (all but each segment's last),
    kept in a temporary file: [num_positions, vocab] fp32 is ~1.8 GB for 9.5k tokens."""

    def __init__(self, segments: list[list[int]], vocab_size: int) -> None:
        self.offsets = [0]
        for s in segments:
            self.offsets.append(self.offsets[-1] + len(s) - 1)
        self._file = tempfile.NamedTemporaryFile(prefix="brigade-quality-", suffix=".f32")
        shape = (self.offsets[-1], vocab_size)
        self.logprobs = np.memmap(self._file.name, dtype=np.float32, mode="w+", shape=shape)

    def rows(self, segment: int, start: int, n: int) -> Tensor:
        at = self.offsets[segment] + start
        return torch.from_numpy(np.asarray(self.logprobs[at : at + n]))

    def fill(self, model: ReferenceLlama, segments: list[list[int]]) -> None:
        """Each segment through the plain fp32 forward, whole."""
        for i, seg in enumerate(segments):
            logits = model.logits(seg)[:-1]  # [len - 1, vocab]: the last has no next token
            at = self.offsets[i]
            self.logprobs[at : at + len(seg) - 1] = torch.log_softmax(logits, dim=-1).numpy()

    def close(self) -> None:
        self._file.close()


def _num_scored(ref: Reference, segment: int, start: int, logits: Tensor) -> int:
    """Rows of these logits that have a next token (the segment's last position has none)."""
    scored = ref.offsets[segment + 1] - ref.offsets[segment]
    return max(0, min(logits.shape[0], scored - start))


@dataclass
class Scores:
    """Running sums over scored positions; `summary()` gives the means."""

    num_positions: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    top1_agree: int = 0
    nll_sum: float = 0.0  # of the next true token under the scored model
    ref_nll_sum: float = 0.0
    flips: list[tuple[int, int]] = field(default_factory=list)  # (segment, position), first 20

    def add(
        self, ref_logprobs: Tensor, logits: Tensor, targets: Tensor, segment: int, start: int
    ) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)  # [n, vocab]
        kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).clamp_min(0.0)  # [n]
        agree = ref_logprobs.argmax(-1) == logprobs.argmax(-1)
        self.num_positions += kl.shape[0]
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.top1_agree += int(agree.sum())
        self.nll_sum -= float(logprobs.gather(1, targets[:, None]).sum())
        self.ref_nll_sum -= float(ref_logprobs.gather(1, targets[:, None]).sum())
        for i in (~agree).nonzero().flatten().tolist()[: 20 - len(self.flips)]:
            self.flips.append((segment, start + i))

    def summary(self) -> dict:
        n = max(self.num_positions, 1)
        return {
            "num_positions": self.num_positions,
            "mean_kl": self.kl_sum / n,
            "max_kl": self.kl_max,
            "top1": self.top1_agree / n,
            "ppl": math.exp(self.nll_sum / n),
            "ref_ppl": math.exp(self.ref_nll_sum / n),
            "first_flips": self.flips,
        }


def score(
    ref: Reference,
    segments: list[list[int]],
    passes: Iterator[tuple[int, int, Tensor]],
) -> dict:
    """Score a pass of the candidate model against the reference."""
    scores = Scores()
    for segment, start, logits in passes:
        n = _num_scored(ref, segment, start, logits)
        if n == 0:
            continue
        targets = torch.tensor(segments[segment][start + 1 : start + 1 + n], dtype=torch.int64)
        scores.add(ref.rows(segment, start, n), logits[:n], targets, segment, start)
    return scores.summary()
