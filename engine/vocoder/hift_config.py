"""HiFT configuration: ``HiftConfig`` (the yaml ``hift`` node) and ``F0PredictorConfig`` (its
``f0_predictor``), with the constants they check. Their own module, so the layers (hift_layers.py), the f0
predictor, the noise recipe and the generators all import it and it imports none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from engine.yaml_data import tag_of

FULL_NOISE_SAMPLES = 300 * 24000  # the reference hard-codes 300 s at 24 kHz
NUM_HARMONICS = 9  # fundamental + 8 overtones; hard-coded in the reference buffers
# The causal f0 predictor's first conv (kernel 4, looking right) consumes this many future mel frames:
# hift_layers.causal_padding(4).
F0_LOOK_AHEAD = 3
_F0_TAGS = {"ConvRNNF0Predictor": False, "CausalConvRNNF0Predictor": True}


@dataclass(frozen=True)
class F0PredictorConfig:
    """The yaml ``f0_predictor`` node; defaults are the released full-size values."""

    causal: bool = False
    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512

    def __post_init__(self) -> None:
        for name in ("num_class", "in_channels", "cond_channels"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"F0PredictorConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_class != 1:
            raise ValueError(
                f"F0PredictorConfig.num_class must be 1 (f0 is one value per frame), got {self.num_class}"
            )

    @property
    def look_ahead(self) -> int:
        """Right-context mel frames the first conv consumes (3 for the causal predictor, 0 otherwise)."""
        return F0_LOOK_AHEAD if self.causal else 0

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> F0PredictorConfig:
        tag = tag_of(node)
        if tag not in _F0_TAGS:
            raise ValueError(f"f0_predictor: unsupported class {tag!r} (expected one of {sorted(_F0_TAGS)})")
        unknown = set(node) - {"__tag__", "num_class", "in_channels", "cond_channels"}
        if unknown:
            raise ValueError(f"f0_predictor ({tag}): unknown keys {sorted(unknown)}")
        kw = {k: int(node[k]) for k in ("num_class", "in_channels", "cond_channels") if k in node}
        return cls(causal=_F0_TAGS[tag], **kw)


# v2 streaming vocoder cache (CosyVoice2Model): the engine keeps the last 8 mel frames and 3840 source samples
# of each chunk and passes the samples back as ``cache_source`` (spec 6.3).
MEL_CACHE_FRAMES = 8
SOURCE_CACHE_SAMPLES = MEL_CACHE_FRAMES * 480

_TAGS = {"HiFTGenerator": False, "CausalHiFTGenerator": True}
_TUPLES = ("upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes", "source_resblock_kernel_sizes")
_NESTED = ("resblock_dilation_sizes", "source_resblock_dilation_sizes")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"HiftConfig: {message}")


@dataclass(frozen=True)
class HiftConfig:
    """The yaml ``hift`` node; defaults are the released CosyVoice2/3 full-size values (causal picks v3)."""

    causal: bool = False
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4  # v3 only
    f0_predictor: F0PredictorConfig = field(default_factory=F0PredictorConfig)
    noise_max_samples: int = FULL_NOISE_SAMPLES  # v3 only, runtime (not in the yaml): 300 s at 24 kHz

    def __post_init__(self) -> None:
        n, f0, lists = len(self.upsample_rates), self.f0_predictor, self._per_stage_lists()
        _require(f0.causal == self.causal, f"causal={self.causal} but f0_predictor.causal={f0.causal}")
        _require(self.sampling_rate != 22050, "sampling_rate 22050 selects the v1 SineGen (not supported)")
        _require(all(len(x) == n for x in lists), f"upsample/source-resblock lists need {n} entries each")
        _require(
            len(self.resblock_dilation_sizes) == len(self.resblock_kernel_sizes), "resblock lists differ"
        )
        _require(self.base_channels > 0 and self.base_channels % 2**n == 0, f"base_channels not k*{2**n}")
        _require(self.in_channels == f0.in_channels, "in_channels != f0_predictor.in_channels")
        _require(
            not self.causal or (self.nb_harmonics + 1 == NUM_HARMONICS and self.conv_pre_look_right >= 1),
            "causal needs nb_harmonics 8 (9-wide fixed noise) and conv_pre_look_right >= 1",
        )
        _require(
            0 < self.noise_max_samples <= FULL_NOISE_SAMPLES, f"noise_max_samples > {FULL_NOISE_SAMPLES}"
        )

    def _per_stage_lists(self) -> tuple[tuple[Any, ...], ...]:
        return (
            self.upsample_kernel_sizes,
            self.source_resblock_kernel_sizes,
            self.source_resblock_dilation_sizes,
        )

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame: prod(upsample_rates) * hop_len = 480."""
        return math.prod(self.upsample_rates) * self.hop_len

    @property
    def withheld_frames(self) -> int:
        """v3 ``finalize=False``: trailing mel frames with no output yet (3 f0 + 4 conv_pre + 1 iSTFT)."""
        return self.f0_predictor.look_ahead + self.conv_pre_look_right + 1 if self.causal else 0

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> HiftConfig:
        tag = tag_of(node)
        if tag not in _TAGS:
            raise ValueError(f"hift: unsupported class {tag!r} (expected one of {sorted(_TAGS)})")
        names = {f.name for f in fields(cls)} - {"causal", "n_fft", "hop_len", "noise_max_samples"}
        unknown = set(node) - names - {"__tag__", "istft_params"}
        if unknown:
            raise ValueError(f"hift ({tag}): unknown keys {sorted(unknown)}")
        kw: dict[str, Any] = {k: v for k, v in node.items() if k in names}
        kw.update({k: tuple(kw[k]) for k in _TUPLES if k in kw})
        kw.update({k: tuple(tuple(d) for d in kw[k]) for k in _NESTED if k in kw})
        if "f0_predictor" in kw:
            kw["f0_predictor"] = F0PredictorConfig.from_yaml(kw["f0_predictor"])
        istft = node.get("istft_params", {})
        kw.update({k: int(istft[k]) for k in ("n_fft", "hop_len") if k in istft})
        return cls(causal=_TAGS[tag], **kw)
