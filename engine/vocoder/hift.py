"""HiFT vocoder: v2 ``HiFTGenerator`` (fresh noise per call), v3 ``CausalHiFTGenerator`` (fixed noise).

mel [B, 80, T] -> f0 [B, T] -> harmonic source [B, 1, T*480] -> STFT-domain fusion -> iSTFT -> speech
[B, T*480] at 24 kHz (480 = prod(upsample_rates) * hop). Parameter names match the released hift.pt after the
checkpoint loader strips ``generator.``; weight-normed convs use torch's parametrization API, so keys are
``<name>.parametrizations.weight.original0/1`` (legacy ``weight_g``/``weight_v`` load through torch's hook).
v2's draws are made apart from the call (``draw_noise``, then ``vocode``), so that several requests' rows of
one shape can share a call while each row keeps the draws its own generator gives it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.vocoder.f0_predictor import F0Predictor
from engine.vocoder.hift_config import NUM_HARMONICS, HiftConfig
from engine.vocoder.hift_layers import (
    ResBlock,
    SourceModule,
    causal_conv,
    same_conv,
    source_downsamplers,
    stage_channels,
    upsamplers,
)
from engine.vocoder.hift_noise import HiftNoise, shared_noise


@dataclass(frozen=True)
class V2Noise:
    """One v2 call's random draws for B rows: initial phases rand_ini [B, 9] in cycles (column 0 = 0) and the
    sines' additive noise [B, T*480, 9] (standard normal, scaled by the source module)."""

    rand_ini: torch.Tensor
    sines: torch.Tensor

    @staticmethod
    def stack(rows: list[V2Noise]) -> V2Noise:
        """Rows drawn one by one (each from its request's generator) -> one batch's draws."""
        return V2Noise(torch.cat([r.rand_ini for r in rows]), torch.cat([r.sines for r in rows]))


class _HiftBase(nn.Module):
    """Layers and the shared decode path; children registered in the reference order (state-dict order)."""

    stft_window: torch.Tensor

    def __init__(self, config: HiftConfig) -> None:
        super().__init__()
        c, base, causal = config, config.base_channels, config.causal
        self.config = c
        self.m_source = SourceModule(c)
        if causal:  # kernel r+1 looking right pads exactly r frames (CausalConv1d 'right' rule)
            self.conv_pre = weight_norm(
                causal_conv(c.in_channels, base, c.conv_pre_look_right + 1, right=True)
            )
        else:
            self.conv_pre = weight_norm(same_conv(c.in_channels, base, 7))
        chans = stage_channels(c)
        self.ups = upsamplers(c)
        self.source_downs = source_downsamplers(c)
        src = zip(chans, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes)
        self.source_resblocks = nn.ModuleList(ResBlock(ch, k, d, causal) for ch, k, d in src)
        blocks = list(zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.resblocks = nn.ModuleList(ResBlock(ch, k, d, causal) for ch in chans for k, d in blocks)
        spec_ch = c.n_fft + 2  # real || imag STFT bins
        post = causal_conv(chans[-1], spec_ch, 7) if causal else same_conv(chans[-1], spec_ch, 7)
        self.conv_post = weight_norm(post)
        self.f0_predictor = F0Predictor(c.f0_predictor)
        # scipy get_window('hann', n_fft, fftbins=True) == float64 periodic Hann rounded to float32
        window = torch.hann_window(c.n_fft, periodic=True, dtype=torch.float64).to(torch.float32)
        self.register_buffer("stft_window", window, persistent=False)

    def fold_weight_norm(self) -> None:
        """Bake g * v / ||v|| into plain ``weight`` tensors (call after loading: the keys change)."""
        if self.config.causal:
            self.f0_predictor.double()  # fold the f0 predictor in float64, the precision it runs in
        for module in [m for m in self.modules() if parametrize.is_parametrized(m, "weight")]:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] in Hz (v3 overrides: float64, ``finalize``)."""
        return self.f0_predictor(mel, finalize)

    def upsample_f0(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] -> nearest x480 -> [B, T*480, 1]."""
        return F.interpolate(
            f0[:, None], scale_factor=self.config.samples_per_frame, mode="nearest"
        ).transpose(1, 2)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T'] + source [B, 1, L] -> speech [B, samples] clamped to +-audio_limit."""
        c, nk = self.config, len(self.config.resblock_kernel_sizes)
        spec = torch.view_as_real(self._stft(source.squeeze(1)))  # [B, 9, F, 2]
        spec = torch.cat([spec[..., 0], spec[..., 1]], dim=1)  # real || imag: [B, 18, F]
        x = self.conv_pre(mel, pad=finalize)
        if not finalize:  # conv_pre consumed its look-ahead frames: drop their STFT frames too
            spec = spec[:, :, : -math.prod(c.upsample_rates) * c.conv_pre_look_right]
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            xs = self.resblocks[i * nk](x)
            for j in range(1, nk):
                xs += self.resblocks[i * nk + j](x)
            x = xs / nk
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as in the reference
        half = c.n_fft // 2 + 1
        speech = self._istft(torch.exp(x[:, :half]), torch.sin(x[:, half:]))
        if not finalize:  # the last hop's overlap-add is incomplete without the next frames
            speech = speech[:, : -c.samples_per_frame]
        return torch.clamp(speech, -c.audio_limit, c.audio_limit)

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        n, hop = self.config.n_fft, self.config.hop_len
        return torch.stft(x, n, hop, n, window=self.stft_window.to(x), return_complex=True)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """[B, n_fft/2+1, F] magnitude and phase -> speech [B, (F-1)*hop]: ``torch.istft`` (center=True) as
        an explicit overlap-add. torch.istft checks its window envelope on the host, a GPU sync that cannot
        be recorded in a CUDA graph; the periodic Hann at 75 % overlap never fails that check."""
        n, hop = self.config.n_fft, self.config.hop_len
        magnitude = torch.clip(magnitude, max=1e2)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        window = self.stft_window.to(magnitude)
        frames = torch.fft.irfft(spec, n, dim=1) * window[:, None]  # [B, n, F], one windowed frame a column
        count = frames.shape[2]
        length = n + hop * (count - 1)
        signal = _overlap_add(frames, length, hop)
        envelope = _overlap_add(window.square()[None, :, None].expand(1, n, count), length, hop)
        return (signal / envelope)[:, n // 2 : length - n // 2]

    def _check_mel(self, mel: torch.Tensor, min_frames: int) -> None:
        if mel.dim() != 3 or mel.shape[1] != self.config.in_channels or mel.shape[2] < min_frames:
            raise ValueError(
                f"hift: mel must be [B, {self.config.in_channels}, T>={min_frames}], got {tuple(mel.shape)}"
            )


class HiFTGenerator(_HiftBase):
    """v2 (CosyVoice2): non-causal convs, linear phase re-upsampling, fresh noise per call."""

    def __init__(self, config: HiftConfig) -> None:
        if config.causal:
            raise ValueError("HiFTGenerator needs a non-causal HiftConfig (use CausalHiFTGenerator)")
        super().__init__(config)

    def inference(
        self,
        mel: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] -> (speech [B, T*480], source [B, 1, T*480]).

        ``cache_source`` [B, 1, S] (S <= T*480, e.g. the previous chunk's last ``SOURCE_CACHE_SAMPLES``)
        overwrites the first S source samples, so chunk seams keep a continuous excitation. The random draws
        (``draw_noise``) come from ``generator`` (on the mel's device), which makes them per-request
        deterministic; None uses the global RNG like the reference.
        """
        self._check_inputs(mel, cache_source)  # before drawing: a refused call leaves the generator as it was
        return self.vocode(mel, cache_source, self.draw_noise(mel, generator))

    def draw_noise(self, mel: torch.Tensor, generator: torch.Generator | None = None) -> V2Noise:
        """The draws one ``inference`` call on mel [B, 80, T] makes, in the reference order: rand(B, 9)
        initial phases, randn(B, L, 9) additive noise (L = T*480), randn(B, L, 1) for the reference's
        discarded noise branch (drawn only to keep the stream aligned). A batch of requests draws row by row,
        each from its own generator with B = 1, then ``V2Noise.stack``s the rows."""
        batch, samples = mel.shape[0], mel.shape[2] * self.config.samples_per_frame
        with torch.inference_mode():
            rand_ini = torch.rand(batch, NUM_HARMONICS, generator=generator, device=mel.device)
            rand_ini[:, 0] = 0  # the fundamental starts at phase 0
            # randn_like on the sines, whose memory is [B, 9, L] (a transposed interpolate output): the
            # layout decides which draw lands on which sample, so draw in it. The sines are float32 or wider.
            dtype = torch.promote_types(mel.dtype, torch.float32)
            sines = torch.empty(batch, NUM_HARMONICS, samples, dtype=dtype, device=mel.device)
            sines = sines.transpose(1, 2).normal_(generator=generator)
            torch.empty(batch, samples, 1, dtype=mel.dtype, device=mel.device).normal_(generator=generator)
        return V2Noise(rand_ini, sines)

    def vocode(
        self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: V2Noise
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``inference`` with the draws made: mel [B, 80, T] (rows of equal T: the convs are not causal, so
        padding would change a row) -> (speech [B, T*480], source [B, 1, T*480])."""
        self._check_inputs(mel, cache_source)
        cached = 0 if cache_source is None else cache_source.shape[-1]
        if noise.sines.shape != (mel.shape[0], mel.shape[2] * self.config.samples_per_frame, NUM_HARMONICS):
            raise ValueError(f"hift: noise {tuple(noise.sines.shape)} does not fit mel {tuple(mel.shape)}")
        with torch.inference_mode():
            f0_up = self.upsample_f0(self.predict_f0(mel))
            source = self.m_source(f0_up, noise.rand_ini, lambda s: noise.sines)
            if cached:
                source[:, :, :cached] = cache_source
            return self.decode(mel, source), source

    def _check_inputs(self, mel: torch.Tensor, cache_source: torch.Tensor | None) -> None:
        self._check_mel(mel, 1)
        cached = 0 if cache_source is None else cache_source.shape[-1]
        if cache_source is not None and cached and (cache_source.dim() != 3 or cached > mel.shape[2] * 480):
            raise ValueError(f"hift: cache_source must be [B, 1, S<=T*480], got {tuple(cache_source.shape)}")

    forward = inference


class CausalHiFTGenerator(_HiftBase):
    """v3 (Fun-CosyVoice3): causal convs, float64 f0, ``SineGen2`` with nearest upsampling and fixed noise.

    The noise buffers (``hift_noise``) are not in hift.pt; they are fetched lazily from the process-wide
    cache on the first call (so meta/structure builds stay cheap), or injected with ``set_noise``.
    """

    def __init__(self, config: HiftConfig) -> None:
        if not config.causal:
            raise ValueError("CausalHiFTGenerator needs a causal HiftConfig (use HiFTGenerator)")
        super().__init__(config)
        self._noise: HiftNoise | None = None

    def set_noise(self, noise: HiftNoise) -> None:
        """Use these buffers instead of the shared recipe (e.g. a fixture prefix)."""
        self._noise = noise

    def noise_on(self, device: torch.device) -> HiftNoise:
        if self._noise is None:
            self._noise = shared_noise(self.config.f0_predictor, self.config.noise_max_samples, device)
        elif self._noise.rand_ini.device != device:
            self._noise = self._noise.to(device)
        return self._noise

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> float64 f0 [B, T] (finalize=False: [B, T-3]); the predictor runs in float64."""
        if self.f0_predictor.classifier.weight.dtype != torch.float64:
            with torch.inference_mode(False):  # keep the cast parameters ordinary (non-inference) tensors
                self.f0_predictor.double()
        return self.f0_predictor(mel.to(torch.float64), finalize)

    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] -> (speech, source [B, 1, T'*480]).

        finalize=True: speech [B, T*480] (zero right padding). finalize=False: the last 3 frames are only f0
        look-ahead, the next 4 only conv_pre look-ahead, and one more frame of iSTFT tail is withheld, so
        speech is [B, (T-8)*480] and T' = T-3; re-running on a longer mel reproduces this prefix exactly.
        """
        c = self.config
        self._check_mel(mel, 1 if finalize else c.withheld_frames)
        noise, frames = (
            self.noise_on(mel.device),
            mel.shape[2] - (0 if finalize else c.f0_predictor.look_ahead),
        )
        if frames * c.samples_per_frame > noise.num_samples:
            raise ValueError(f"hift: {frames} f0 frames exceed the {noise.num_samples}-sample noise buffer")
        with torch.inference_mode():
            f0_up = self.upsample_f0(self.predict_f0(mel, finalize).to(mel.dtype))
            source = self.m_source(f0_up, noise.rand_ini, lambda s: noise.sine_waves[:, : s.shape[1]])
            body = mel if finalize else mel[:, :, : -c.f0_predictor.look_ahead]
            return self.decode(body, source, finalize), source

    forward = inference

    def finals(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several rows' final calls in two calls: mels [1, 80, T_i], each at least ``TAIL_FRAMES`` long ->
        each row's speech [1, T_i*480], what ``inference(mel, True)`` gives the row alone.

        A final call vocodes up to the row's right edge, where right padding is not exact: the source's
        STFT reflects at the edge, and the last upsampler and the inverse STFT read past it (on the released
        architecture the last ~50 samples differ). So one right-padded call gives every row's source, exact
        up to its edge, and its speech but the last ``TAIL_KEPT`` frames; one more call decodes each row's
        last ``TAIL_FRAMES`` frames with that source (the same width for every row: no padding) and gives
        those frames exactly, the decoder's causal receptive field (~23 frames) lying inside the window.
        """
        spf, w, kept = self.config.samples_per_frame, TAIL_FRAMES, TAIL_KEPT
        lengths = [m.shape[2] for m in mels]
        if min(lengths) < w:
            raise ValueError(f"hift finals: every row needs at least {w} frames, got {min(lengths)}")
        width = max(lengths)
        speech, source = self.inference(torch.cat([F.pad(m, (0, width - m.shape[2])) for m in mels]), True)
        edges = [source[i : i + 1, :, (t - w) * spf : t * spf] for i, t in enumerate(lengths)]
        tail_source = torch.cat(edges)
        with torch.inference_mode():
            tails = self.decode(torch.cat([m[:, :, -w:] for m in mels]), tail_source, True)  # [B, w*spf]
        return [
            torch.cat([speech[i : i + 1, : (t - kept) * spf], tails[i : i + 1, (w - kept) * spf :]], dim=1)
            for i, t in enumerate(lengths)
        ]


# ``CausalHiFTGenerator.finals``: each row's last frames decoded again, and the last of them kept (the
# window's first ~23 frames see its left edge; the padded call is off in the last fraction of a frame)
TAIL_FRAMES = 32
TAIL_KEPT = 4


def _overlap_add(frames: torch.Tensor, length: int, hop: int) -> torch.Tensor:
    """[B, n, F] frames, frame f starting at sample f*hop -> their sum [B, length]."""
    n = frames.shape[1]
    return F.fold(frames, (1, length), (1, n), stride=(1, hop)).flatten(1)


def build_hift(config: HiftConfig) -> HiFTGenerator | CausalHiFTGenerator:
    """The generator class the config's family uses (v2 non-causal, v3 causal)."""
    return CausalHiFTGenerator(config) if config.causal else HiFTGenerator(config)
