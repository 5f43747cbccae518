"""ModelRunner: turns a scheduled batch into model inputs, runs the forward, returns logits.

The batch is the scheduled sequences' new tokens concatenated in order (no padding). Inputs are
built as Python lists and copied to the device once per tensor; logits are computed only for
the last token of each sequence that samples this step, and for each of its draft tokens, and
for every prompt position of a sequence that asked for prompt logprobs (PromptRows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.model import LlamaForCausalLM
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


@dataclass(frozen=True)
class PromptRows:
    """Logits of prompt positions [start, start + len(logits)) of `seq`: row k predicts prompt
    token start + k + 1."""

    seq: Sequence
    start: int
    logits: Tensor  # [num_rows, vocab] float32


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        block_manager: BlockManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = device

    def _tensor(self, values: list[int], dtype: torch.dtype) -> Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor, list[tuple[Sequence, int, list[int]]]]:
        """-> input_ids [num_tokens], positions [num_tokens], metadata, logits_indices [n], and
        (seq, first position, rows) of the prompt positions whose logits are asked for."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: list[tuple[Sequence, int, list[int]]] = []
        for s in scheduled:
            if s.seq.needs_prompt_logits:  # positions before the last prompt token's
                stop = min(s.start + s.num_real_tokens, s.seq.num_prompt_tokens - 1)
                first = len(input_ids)
                if stop > s.start:
                    prompt_rows.append((s.seq, s.start, list(range(first, first + stop - s.start))))
            end = s.start + s.num_new_tokens
            input_ids += s.seq.token_ids[s.start : s.start + s.num_real_tokens]
            input_ids += s.draft  # speculative tokens go after the real ones
            positions += range(s.start, end)
            slot_mapping += self.block_manager.slot_mapping(s.seq, s.start, end)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            rows = s.num_sampled_rows  # the last real token's row, then each draft token's
            logits_indices += range(len(input_ids) - rows, len(input_ids))
        width = max(len(s.seq.block_table) for s in scheduled)
        # padding entries of a block table are -1 (never read: seq_lens bounds every lookup)
        tables = [s.seq.block_table + [-1] * (width - len(s.seq.block_table)) for s in scheduled]
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        attn = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),  # [num_tokens]
            query_start_loc=self._tensor(query_start_loc, torch.int32),  # [num_seqs + 1]
            seq_lens=self._tensor(seq_lens, torch.int32),  # [num_seqs]
            block_tables=self._tensor(tables, torch.int32),  # [num_seqs, width]
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_manager.block_size,
        )
        return (
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            attn,
            self._tensor(logits_indices, torch.int64),
            prompt_rows,
        )

    @torch.inference_mode()
    def run(
        self, scheduled: list[ScheduledSeq], greedy: bool = False
    ) -> tuple[Tensor | None, list[PromptRows]]:
        """Forward the batch; -> logits [num_sampled_rows, vocab] float32 (None if none), or
        with `greedy` each row's argmax [num_sampled_rows] int64 instead (model.greedy_tokens),
        and the logits of the prompt positions asked for."""
        input_ids, positions, attn, logits_indices, prompt_rows = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache.kv_caches, attn)
        prompts = [
            PromptRows(seq, start, self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]))
            for seq, start, rows in prompt_rows
        ]  # fmt: skip
        if logits_indices.numel() == 0:
            return None, prompts
        if greedy:
            return self.model.greedy_tokens(hidden[logits_indices]), prompts  # [n]
        return self.model.compute_logits(hidden[logits_indices]), prompts  # [n, vocab]
