"""The CosyVoice2/3 speech LM (``Qwen2LM`` / ``CosyVoice3LM``): a Qwen2 backbone fed with embeddings, a speech
embedding table and a speech-token decoder head. Keys match the released ``llm.pt`` (strict load).

Decoding is the engine's job (engine/lm/); this module gives it the prefix, one batched KV-cache step for
many requests at once, and log-probabilities. See reference/cosyvoice-spec.md §2.3, §2.4, §4, §5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import InvalidInput, ModelError
from engine.models.qwen2 import KVCache, Qwen2Encoder

FAMILIES = ("cosyvoice2", "cosyvoice3")
# Extra speech-vocabulary rows after the 3^8 FSQ codes: v2 eos/(unused)/fill, v3 200 special ids.
_EXTRA_SPEECH_ROWS = {"cosyvoice2": 3, "cosyvoice3": 200}


@dataclass(frozen=True)
class SpeechLMConfig:
    """Geometry of the speech LM. Defaults: the released 0.5B models (Qwen2.5-0.5B backbone)."""

    family: str = "cosyvoice3"
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 4864
    text_vocab_size: int = 151936
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    speech_token_size: int = 6561  # 3^8 FSQ codes; also the index the reference masks before min_len

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        sizes = (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "text_vocab_size",
            "max_position_embeddings",
            "speech_token_size",
        )
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be > 0")

    @classmethod
    def full_size(cls, family: str) -> SpeechLMConfig:
        """The released CosyVoice2-0.5B / Fun-CosyVoice3-0.5B geometry."""
        return cls(family=family)

    @classmethod
    def from_qwen_config(
        cls, family: str, cfg: Mapping[str, Any], source: str = "config.json"
    ) -> SpeechLMConfig:
        """Read ``CosyVoice-BlankEN/config.json`` (HF Qwen2Config as a dict); absent optional keys take HF's
        Qwen2Config defaults, as ``from_pretrained`` would."""

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelError(f"{source}: missing required key {key!r}")
            return cfg[key]

        if cfg.get("model_type", "qwen2") != "qwen2" or cfg.get("hidden_act", "silu") != "silu":
            raise ModelError(
                f"{source}: expected a qwen2 model with silu, got "
                f"{cfg.get('model_type')!r}/{cfg.get('hidden_act')!r}"
            )
        if cfg.get("rope_scaling") or cfg.get("use_sliding_window"):
            raise ModelError(f"{source}: rope_scaling / sliding-window attention are not supported")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        return cls(
            family=family,
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            text_vocab_size=int(need("vocab_size")),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def is_v2(self) -> bool:
        return self.family == "cosyvoice2"

    @property
    def speech_vocab_size(self) -> int:
        """Rows of speech_embedding / outputs of llm_decoder: v2 6564, v3 6761."""
        return self.speech_token_size + _EXTRA_SPEECH_ROWS[self.family]

    @property
    def decoder_bias(self) -> bool:
        return self.is_v2

    @property
    def has_llm_embedding(self) -> bool:
        return self.is_v2

    @property
    def special_table(self) -> str:
        """The table that sos/task_id index: v2 ``llm_embedding`` [2, H], v3 ``speech_embedding``."""
        return "llm_embedding" if self.is_v2 else "speech_embedding"

    @property
    def sos_id(self) -> int:
        return 0 if self.is_v2 else self.speech_token_size

    @property
    def task_id(self) -> int:
        return 1 if self.is_v2 else self.speech_token_size + 2

    @property
    def eos_id(self) -> int:
        return self.speech_token_size if self.is_v2 else self.speech_token_size + 1

    @property
    def fill_id(self) -> int:
        """Bistream fill token (a speech id): v2 6563, v3 6564."""
        return self.speech_token_size + (2 if self.is_v2 else 3)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Sampling any of these ends a request: v2 {6561, 6562, 6563}, v3 6561..6760."""
        return frozenset(range(self.speech_token_size, self.speech_vocab_size))

    @property
    def min_len_mask_index(self) -> int:
        """The logit the reference sets to -inf before min_len (v2 eos; v3 sos, a known reference defect)."""
        return self.speech_token_size


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

    def _special(self, row: int) -> Tensor:
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
            self._special(self.config.sos_id),
            self.embed_tokens(text),
            self._special(self.config.task_id),
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


def _ids(ids: Tensor | None, empty: Tensor) -> Tensor:
    if ids is None:
        return empty
    if ids.dim() != 1:
        raise InvalidInput(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids.to(device=empty.device, dtype=torch.long)


def _check_range(what: str, ids: Tensor, size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
        raise InvalidInput(
            f"{what} token ids must lie in [0, {size}), got [{int(ids.min())}, {int(ids.max())}]"
        )
