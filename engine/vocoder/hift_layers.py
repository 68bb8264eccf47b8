"""HiFT building blocks: padded (causal) convs, Snake, ResBlock, the causal upsampler and the NSF source.

Parameter names follow the reference modules so the released hift.pt loads strictly into the generators.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from engine.vocoder.hift_config import HiftConfig


def causal_padding(kernel_size: int, dilation: int = 1) -> int:
    """Zero frames a CosyVoice ``CausalConv1d`` adds on one side so the output keeps the input length."""
    return ((kernel_size * dilation - dilation) // 2) * 2 + (kernel_size + 1) % 2


class PaddedConv1d(nn.Conv1d):
    """Conv1d with explicit zero padding (left, right) in frames.

    Symmetric padding uses the conv's own ``padding`` (the released non-causal convs); asymmetric padding is
    applied with ``F.pad`` (CosyVoice's causal convs, which concatenate zeros or a look-ahead context).
    ``forward(x, pad=False)`` skips the padding: for a right-looking conv that is the streaming case where the
    last ``pad[1]`` frames of ``x`` are real look-ahead context instead of zeros (so the output is shorter).
    """

    def __init__(
        self, cin: int, cout: int, kernel: int, *, stride: int = 1, dilation: int = 1, pad: tuple[int, int]
    ) -> None:
        symmetric = pad[0] == pad[1]
        super().__init__(cin, cout, kernel, stride, padding=pad[0] if symmetric else 0, dilation=dilation)
        self.explicit_pad = (0, 0) if symmetric else pad

    def forward(self, x: torch.Tensor, pad: bool = True) -> torch.Tensor:
        if not pad:
            return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation)
        if self.explicit_pad != (0, 0):
            x = F.pad(x, self.explicit_pad)
        return super().forward(x)


def causal_conv(cin: int, cout: int, kernel: int, dilation: int = 1, *, right: bool = False) -> PaddedConv1d:
    """CosyVoice ``CausalConv1d``: zeros on the left ('left' type) or on the right ('right', look-ahead)."""
    p = causal_padding(kernel, dilation)
    return PaddedConv1d(cin, cout, kernel, dilation=dilation, pad=(0, p) if right else (p, 0))


def same_conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> PaddedConv1d:
    """Non-causal 'same' conv (odd kernel): ``(k*d - d) // 2`` zeros each side."""
    p = (kernel * dilation - dilation) // 2
    return PaddedConv1d(cin, cout, kernel, dilation=dilation, pad=(p, p))


class Snake(nn.Module):
    """x + sin^2(alpha x) / (alpha + 1e-9), alpha per channel, stored raw (not log-scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.alpha[None, :, None]
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a) ** 2


class ResBlock(nn.Module):
    """Per dilation d: Snake -> conv(k, d) -> Snake -> conv(k, 1) -> residual add (causal: left padding)."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...], causal: bool) -> None:
        super().__init__()
        conv = causal_conv if causal else same_conv
        self.convs1 = nn.ModuleList(weight_norm(conv(channels, channels, kernel, d)) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(conv(channels, channels, kernel, 1)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = c2(a2(c1(a1(x)))) + x
        return x


class CausalUpsampleConv(PaddedConv1d):
    """v3 ``CausalConv1dUpsample``: nearest x``factor`` -> k-1 zeros on the left -> Conv1d(k, stride 1)."""

    def __init__(self, cin: int, cout: int, kernel: int, factor: int) -> None:
        super().__init__(cin, cout, kernel, pad=(kernel - 1, 0))
        self.factor = factor

    def forward(self, x: torch.Tensor, pad: bool = True) -> torch.Tensor:
        return super().forward(F.interpolate(x, scale_factor=self.factor, mode="nearest"), pad)


class SourceModule(nn.Module):
    """``SourceModuleHnNSF`` with ``SineGen2``: f0 [B, L, 1] -> 9 noisy harmonics -> tanh(Linear(9, 1)).

    ``config.causal`` selects the v3 variant (nearest instead of linear re-upsampling of the integrated
    phase); the random parts (initial phases, additive noise) come from the caller, fresh (v2) or fixed (v3).
    """

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        self.l_linear = nn.Linear(config.nb_harmonics + 1, 1)
        self.config = config

    def forward(
        self, f0_up: torch.Tensor, rand_ini: torch.Tensor, noise: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """f0 [B, L, 1] (Hz, per sample), initial phases [B|1, 9] in cycles -> source [B, 1, L].

        ``noise(sines)`` gives the additive noise [B|1, L, 9]; it sees the sines tensor itself because the
        reference draws ``randn_like`` on it, whose (transposed) memory layout decides the random stream.
        """
        c, up = self.config, self.config.samples_per_frame
        harmonics = torch.arange(1, c.nb_harmonics + 2, dtype=torch.float32, device=f0_up.device)
        rad = (f0_up * harmonics / c.sampling_rate) % 1  # cycles per sample, integer part irrelevant
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        # the phase is integrated at frame rate, then scaled and re-upsampled (linear in v2, nearest in v3)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / up, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        mode = "nearest" if c.causal else "linear"
        phase = F.interpolate(phase.transpose(1, 2) * up, scale_factor=up, mode=mode).transpose(1, 2)
        sines = torch.sin(phase) * c.nsf_alpha
        uv = (f0_up > c.nsf_voiced_threshold).to(torch.float32)
        noise_amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        harmonics_out = sines * uv + noise_amp * noise(sines)
        return torch.tanh(self.l_linear(harmonics_out)).transpose(1, 2)


def stage_channels(config: HiftConfig) -> list[int]:
    """Channels after each upsampling stage: base/2, base/4, base/8 (256, 128, 64 full size)."""
    return [config.base_channels // 2 ** (i + 1) for i in range(len(config.upsample_rates))]


def upsamplers(config: HiftConfig) -> nn.ModuleList:
    """``ups``: v2 ConvTranspose1d(k, stride u, padding (k-u)/2); v3 nearest x u + left-causal conv(k)."""
    chans = stage_channels(config)
    ins = [config.base_channels, *chans[:-1]]
    layers = zip(ins, chans, config.upsample_rates, config.upsample_kernel_sizes)
    return nn.ModuleList(
        weight_norm(
            CausalUpsampleConv(cin, cout, k, u)
            if config.causal
            else nn.ConvTranspose1d(cin, cout, k, u, padding=(k - u) // 2)
        )
        for cin, cout, u, k in layers
    )


def source_downsamplers(config: HiftConfig) -> nn.ModuleList:
    """``source_downs``: STFT [B, 18, F] -> each stage's frame rate (/15, /3, /1: conv 2u, stride u)."""
    rates = config.upsample_rates
    down = [math.prod(rates[::-1][:i]) for i in range(len(rates))][::-1]  # [15, 3, 1]
    spec = config.n_fft + 2
    return nn.ModuleList(
        PaddedConv1d(spec, ch, 1, pad=(0, 0))
        if u == 1
        else PaddedConv1d(spec, ch, 2 * u, stride=u, pad=(u - 1, 0) if config.causal else (u // 2, u // 2))
        for ch, u in zip(stage_channels(config), down)
    )
