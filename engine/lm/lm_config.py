"""The speech LM's geometry (``SpeechLMConfig``), read from ``CosyVoice-BlankEN/config.json``: its own module,
so the backbone (qwen2.py) and the LM (speech_lm.py) both import it and neither imports the other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelError

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
