"""The v3 ``CausalHiFTGenerator`` fixed noise buffers, rebuilt exactly (spec Appendix A).

The official constructors draw them from torch's global CPU generator after the flow's CFM reseeds it with 0,
so their values depend on every default init drawn in between. After ``manual_seed(0)`` the stream is consumed
by: ``randn(1, 80, 15000)`` (flow noise), the v3 flow's ``Embedding(6561, 80)`` and ``Linear(192, 80)`` inits,
the f0 predictor's conv/linear inits (shapes from its config), then ``rand(1, 9)`` = rand_ini (column 0
zeroed), ``rand(1, 7_200_000, 9)`` = sine_waves (uniform, used as additive noise), the ``Linear(9, 1)`` init
and ``rand(1, 7_200_000, 1)`` = uv (only feeds the discarded noise branch; kept for completeness).

We replay the same draws on a private ``torch.Generator`` (same Mersenne-Twister stream, same kernels), so
the global RNG is never touched and concurrent requests are not disturbed. The buffers are ~290 MB of
float32 for 300 s, so one copy per (f0 config, length, device) is built lazily and shared.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from engine.vocoder.hift_config import FULL_NOISE_SAMPLES, NUM_HARMONICS, F0PredictorConfig

log = logging.getLogger(__name__)

FLOW_NOISE_SHAPE = (1, 80, 15000)  # CausalConditionalCFM.rand_noise
FLOW_EMBEDDING = (6561, 80)  # v3 flow input_embedding (vocab, mel dim)
FLOW_SPK_AFFINE = (192, 80)  # v3 flow spk_embed_affine_layer (in, out)


@dataclass(frozen=True)
class HiftNoise:
    """rand_ini [1, 9] (column 0 = 0), sine_waves [1, N, 9] uniform [0, 1), uv [1, N, 1] uniform [0, 1)."""

    rand_ini: torch.Tensor
    sine_waves: torch.Tensor
    uv: torch.Tensor

    @property
    def num_samples(self) -> int:
        return int(self.sine_waves.shape[1])

    def to(self, device: torch.device | str) -> HiftNoise:
        return HiftNoise(self.rand_ini.to(device), self.sine_waves.to(device), self.uv.to(device))


def _draw_linear(g: torch.Generator, fan_in: int, fan_out: int) -> None:
    """Consume what ``nn.Linear(fan_in, fan_out)``'s default init draws (same call, so same stream use)."""
    _draw_conv(g, fan_in, fan_out, 1)


def _draw_conv(g: torch.Generator, cin: int, cout: int, kernel: int) -> None:
    """Consume ``nn.Conv1d(cin, cout, kernel)``'s default init: Kaiming-uniform(a=sqrt 5), uniform bias."""
    weight = torch.empty(cout, cin, kernel) if kernel > 1 else torch.empty(cout, cin)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=g)
    bound = 1.0 / math.sqrt(cin * kernel)
    nn.init.uniform_(torch.empty(cout), -bound, bound, generator=g)


def _draw_f0_predictor(g: torch.Generator, cfg: F0PredictorConfig) -> None:
    first_kernel = 4 if cfg.causal else 3
    _draw_conv(g, cfg.in_channels, cfg.cond_channels, first_kernel)
    for _ in range(4):
        _draw_conv(g, cfg.cond_channels, cfg.cond_channels, 3)
    _draw_linear(g, cfg.cond_channels, cfg.num_class)


def build_noise(f0: F0PredictorConfig, max_samples: int = FULL_NOISE_SAMPLES) -> HiftNoise:
    """Replay the reference construction stream on a private CPU generator; keep the first ``max_samples``.

    The full 7.2 M-sample sine buffer must still be drawn (uv comes after it in the stream); only the kept
    prefix survives. Returns CPU float32 tensors.
    """
    if not 0 < max_samples <= FULL_NOISE_SAMPLES:
        raise ValueError(f"max_samples must be in (0, {FULL_NOISE_SAMPLES}], got {max_samples}")
    g = torch.Generator(device="cpu").manual_seed(0)
    torch.randn(FLOW_NOISE_SHAPE, generator=g)
    nn.init.normal_(torch.empty(FLOW_EMBEDDING), generator=g)
    _draw_linear(g, *FLOW_SPK_AFFINE)
    _draw_f0_predictor(g, f0)
    rand_ini = torch.rand(1, NUM_HARMONICS, generator=g)
    rand_ini[:, 0] = 0
    sine_waves = torch.rand(1, FULL_NOISE_SAMPLES, NUM_HARMONICS, generator=g)
    _draw_linear(g, NUM_HARMONICS, 1)  # SourceModuleHnNSF.l_linear, built between the two buffers
    uv = torch.rand(1, FULL_NOISE_SAMPLES, 1, generator=g)
    if max_samples < FULL_NOISE_SAMPLES:
        sine_waves, uv = sine_waves[:, :max_samples].clone(), uv[:, :max_samples].clone()
    return HiftNoise(rand_ini, sine_waves, uv)


_CACHE: dict[tuple[F0PredictorConfig, int, str], HiftNoise] = {}
_LOCK = threading.Lock()


def shared_noise(
    f0: F0PredictorConfig, max_samples: int = FULL_NOISE_SAMPLES, device: torch.device | str = "cpu"
) -> HiftNoise:
    """One process-wide copy per (f0 config, length, device); built on first use (about 1 s on CPU)."""
    key = (f0, max_samples, str(torch.device(device)))
    with _LOCK:
        if key not in _CACHE:
            cpu_key = (f0, max_samples, "cpu")
            if cpu_key not in _CACHE:
                log.info(
                    "building v3 HiFT noise buffers (%d samples, f0 cond %d)", max_samples, f0.cond_channels
                )
                _CACHE[cpu_key] = build_noise(f0, max_samples)
            _CACHE[key] = _CACHE[cpu_key].to(device)
        return _CACHE[key]


def clear_shared_noise() -> None:
    """Drop every cached buffer (frees the ~290 MB per entry once no generator holds it)."""
    with _LOCK:
        _CACHE.clear()
