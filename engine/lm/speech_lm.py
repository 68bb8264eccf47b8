"""The CosyVoice2/3 speech LM (``Qwen2LM`` / ``CosyVoice3LM``): a Qwen2 backbone fed with embeddings, a speech
embedding table and a speech-token decoder head. Keys match the released ``llm.pt`` (strict load).

Decoding is the engine's job (engine/lm/); this module gives it the prefix, one batched KV-cache step for
many requests at once, and log-probabilities. See reference/cosyvoice-spec.md §2.3, §2.4, §4, §5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine.errors import InvalidInput
from engine.lm.lm_config import SpeechLMConfig
from engine.lm.qwen2 import KVCache, Qwen2Encoder, SlotStep


class SpeechLM(nn.Module):
    """``Qwen2LM`` (v2) / ``CosyVoice3LM`` (v3) inference: float32 master weights, ``.to(dtype)`` for bf16."""

    def __init__(self, config: SpeechLMConfig):
        super().__init__()
        self.config = config
        hidden, vocab = config.hidden_size, config.speech_vocab_size
        if config.has_llm_embedding:
            self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = Qwen2Encoder(config)
        self.llm_decoder = nn.Linear(hidden, vocab, bias=config.decoder_bias)
        self.speech_embedding = nn.Embedding(vocab, hidden)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.llm.model.model.embed_tokens

    def special(self, row: int) -> Tensor:
        """The special row (sos or task id) [1, H], from the table the checkpoint keeps it in."""
        table = self.llm_embedding if self.config.has_llm_embedding else self.speech_embedding
        return table.weight[row : row + 1]

    def prefix_embeds(
        self, text_ids: Tensor, prompt_text_ids: Tensor | None = None, prompt_speech_ids: Tensor | None = None
    ) -> Tensor:
        """[sos, embed_tokens(prompt_text ++ text), task_id, speech_embedding(prompt_speech)] -> [P, H].

        Ids are 1-D. instruct2 passes the instruct ids as prompt text and no prompt speech; cross-lingual
        and sft pass neither prompt part.
        """
        device = self.speech_embedding.weight.device
        empty = torch.zeros(0, dtype=torch.long, device=device)
        text = torch.cat([_ids(prompt_text_ids, empty), _ids(text_ids, empty)])
        speech = _ids(prompt_speech_ids, empty)
        _check_range("text", text, self.config.text_vocab_size)
        _check_range("prompt speech", speech, self.config.speech_token_size)
        parts = [
            self.special(self.config.sos_id),
            self.embed_tokens(text),
            self.special(self.config.task_id),
            self.speech_embedding(speech),
        ]
        return torch.cat(parts)

    def speech_embeds(self, ids: Tensor) -> Tensor:
        """Speech ids [N] -> [N, H]: the input for the next decode step."""
        return self.speech_embedding(ids.to(self.speech_embedding.weight.device))

    def logprobs(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> float32 log-softmax over the speech vocabulary [..., V]."""
        return torch.log_softmax(self.llm_decoder(hidden).float(), dim=-1)

    def forward(self, embeds: Tensor) -> Tensor:
        """Full causal pass without a cache (teacher forcing): [T, H] or [B, T, H] -> same shape."""
        single = embeds.dim() == 2
        hidden = self.llm(embeds[None] if single else embeds)
        return hidden[0] if single else hidden

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty cache on the model's device and dtype; the request owns it and drops it when done."""
        c, w = self.config, self.speech_embedding.weight
        return KVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, dtype=w.dtype, device=w.device, capacity=capacity
        )

    def prefill(self, embeds: Tensor, cache: KVCache) -> Tensor:
        """Append embeds [P, H] to one request's cache (empty or not); returns the last hidden [H]."""
        if embeds.dim() != 2 or embeds.shape[0] == 0:
            raise ValueError(f"prefill wants embeds [P>0, H], got {tuple(embeds.shape)}")
        return self.llm(embeds[None], [cache])[0, -1]

    def decode(self, embeds: Tensor, caches: Sequence[KVCache]) -> Tensor:
        """One step for B requests at once: embeds [B, H] (one new position each) -> hidden [B, H].

        The caches may have different lengths; each gets its own rotary position and attention span.
        """
        if embeds.dim() != 2 or embeds.shape[0] != len(caches):
            raise ValueError(
                f"decode wants embeds [B, H] for B={len(caches)} caches, got {tuple(embeds.shape)}"
            )
        return self.llm(embeds[:, None], caches)[:, 0]

    def decode_in_slot(self, ids: Tensor, kv: Tensor, pos: Tensor) -> Tensor:
        """One step for the request whose keys/values fill the fixed buffer ``kv`` below ``pos``: its last
        id [1] -> hidden [1, H], the new keys/values written at ``pos`` ([1] long). Every tensor keeps its
        address from one call to the next (``qwen2.SlotStep``), so the step can be captured and replayed."""
        embeds = self.speech_embedding(ids)[:, None]  # [1, 1, H]
        return self.llm.model.model.run(embeds, SlotStep(kv, pos))[:, 0]


def _ids(ids: Tensor | None, empty: Tensor) -> Tensor:
    if ids is None:
        return empty
    if ids.dim() != 1:
        raise InvalidInput(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids.to(device=empty.device, dtype=torch.long)


def _check_range(what: str, ids: Tensor, size: int) -> None:
    if ids.numel():
        check_id_range(what, int(ids.min()), int(ids.max()), size)


def check_id_range(what: str, low: int, high: int, size: int) -> None:
    """Ids whose least is ``low`` and greatest ``high`` must index a table of ``size`` rows (InvalidInput)."""
    if low < 0 or high >= size:
        raise InvalidInput(f"{what} token ids must lie in [0, {size}), got [{low}, {high}]")
