"""The LM's prompt embedding rows kept on the host: a request's prefix made without the device.

``SpeechLM.prefix_embeds`` looks its rows up on the LM's device, then the vLLM backend copies them back to the
host (vLLM takes prompt embeddings there). Each of those steps waits on the device (the ids' copies, the range
check's syncs, the lookups behind whatever else runs) and hands the GIL back and forth with the serving
threads, which under a burst of arrivals is the first token's longest part. The rows are a copy of the
released tables, so the prefix is the same tensor, made by a gather on the host in microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.lm.speech_lm import SpeechLM, check_id_range


@dataclass(frozen=True, eq=False)
class PromptTable:
    """Host copies of ``lm``'s text and speech embedding tables and its two special rows (sos, task id);
    [V, H] each, in the LM's dtype (Qwen2's text table: 151,936 x 896, 272 MB in bf16)."""

    text: Tensor  # [text vocab, H]
    speech: Tensor  # [speech vocab, H]
    sos: Tensor  # [1, H]
    task: Tensor  # [1, H]

    @classmethod
    def of(cls, lm: SpeechLM) -> PromptTable:
        cfg = lm.config
        with torch.inference_mode():
            text = _host(lm.embed_tokens.weight)
            speech = _host(lm.speech_embedding.weight)
            # copied rows: a view would keep a whole table alive for one row
            sos, task = (_host(lm.special(row)).clone() for row in (cfg.sos_id, cfg.task_id))
        return cls(text, speech, sos, task)

    def prefix(self, text_ids: Sequence[int], prompt_ids: Sequence[int], speech_ids: Sequence[int]) -> Tensor:
        """``SpeechLM.prefix_embeds``'s [sos, text(prompt text ++ text), task, speech(prompt speech)] ->
        [P, H] on the host; ids out of a table's range are the caller's error (InvalidInput), as there."""
        text = [*prompt_ids, *text_ids]
        _check_range("text", text, self.text.shape[0])
        _check_range("prompt speech", speech_ids, self.speech.shape[0])
        parts = [self.sos, _rows(self.text, text), self.task, _rows(self.speech, speech_ids)]
        return torch.cat(parts)


def _host(weight: Tensor) -> Tensor:
    """A table's host copy (on a CPU LM: the table itself, no second copy)."""
    return weight.detach().to("cpu")


def _rows(table: Tensor, ids: Sequence[int]) -> Tensor:
    return table.index_select(0, torch.tensor(ids, dtype=torch.long))


def _check_range(what: str, ids: Sequence[int], size: int) -> None:
    if ids:
        check_id_range(what, min(ids), max(ids), size)
