"""CosyVoice3 flow estimator: the DiT (CosyVoice ``cosyvoice/flow/DiT``, F5-TTS style, x-transformers RoPE).
Keys match the released ``flow.pt`` under ``decoder.estimator.`` (incl. the ``rotary_embed.inv_freq`` buffer).

Frames are [B,T,dim] inside. Input = Linear(x ‖ cond ‖ mu ‖ spks) plus a causal grouped-conv position
embedding; blocks use AdaLN-Zero on the flow-time embedding, tanh-GELU FFN and RoPE applied to the
flattened q/k BEFORE the head split, so only the first dim_head channels (head 0) rotate: a quirk of the
reference that the released weights depend on. See reference/cosyvoice-spec.md §2.9 and pitfall 21.

``forward_window`` is the streaming call that reuses a request's finished frames (engine.flow.dit_cache):
only a window of query frames runs, attending over the cached keys/values of the frames before it;
``forward_paged`` is the same over a page pool, from tensors only (engine.flow.dit_pages: the CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.flow.attention import FrameAttention, WindowAttention
from engine.flow.dit_pages import PagedRows, PagedWindow
from engine.flow.encoder import expect_tag, yaml_field
from engine.flow.unet import sinusoidal_embedding

if TYPE_CHECKING:
    from engine.flow.dit_cache import DiTWindow, KeysValues


@dataclass(frozen=True)
class DiTConfig:
    """Defaults: the released Fun-CosyVoice3 estimator (§2.7)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # streaming attention chunk, frames
    time_freq_dim: int = 256  # SinusPositionEmbedding width (fixed in the reference)
    conv_pos_kernel: int = 31  # fixed in the reference
    conv_pos_groups: int = 16  # fixed in the reference

    @property
    def lead_frames(self) -> int:
        """Input frames before a frame that reach it through the two causal position convs (60)."""
        return 2 * (self.conv_pos_kernel - 1)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"DiTConfig.{name} must be >= 1, got {value}")
        if self.dim % self.conv_pos_groups or self.dim_head % 2:
            raise ValueError(
                f"dim must divide into {self.conv_pos_groups} groups and dim_head be even: {self}"
            )
        if self.out_channels != self.mel_dim:
            raise ValueError(f"out_channels {self.out_channels} must equal mel_dim {self.mel_dim}")

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> DiTConfig:
        expect_tag(node, "DiT")
        if node.get("long_skip_connection", False):
            raise ValueError("flow yaml: DiT long_skip_connection=True is unsupported (no release uses it)")
        names = (
            "dim",
            "depth",
            "heads",
            "dim_head",
            "ff_mult",
            "mel_dim",
            "mu_dim",
            "spk_dim",
            "out_channels",
            "static_chunk_size",
        )
        return cls(**{k: int(yaml_field(node, k)) for k in names})


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        """t [B] float32 (a bf16 t would move 1000*t by whole radians) -> [B,dim] in the weights' dtype."""
        first = self.time_mlp[0]
        assert isinstance(first, nn.Linear)
        return self.time_mlp(sinusoidal_embedding(t.float(), self.freq_dim).to(first.weight.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convs with Mish: frame i sees frames i-60..i."""

    def __init__(self, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.pad = kernel_size - 1
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor, known: Tensor | None = None) -> Tensor:
        """x [B,T,dim] -> [B,T,dim]. ``known`` [B,T] bool, a cached window's lead (which may start before
        frame 0): False frames read as the zeros the reference pads in front of frame 0, at both convs."""
        if known is not None:
            return self._windowed(x, known[:, None, :].to(x.dtype))
        h = self.conv1(F.pad(x.transpose(1, 2), (self.pad, 0)))
        return self.conv2(F.pad(h, (self.pad, 0))).transpose(1, 2)

    def _windowed(self, x: Tensor, keep: Tensor) -> Tensor:
        """keep [B,1,T]: 0 before frame 0. A window's first 2 x pad outputs read frames before its start
        (the caller drops them); every later one reads exactly what the whole sequence would give it."""
        h = self.conv1(F.pad(x.transpose(1, 2) * keep, (self.pad, 0))) * keep
        return self.conv2(F.pad(h, (self.pad, 0))).transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim * 2 + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(
        self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, known: Tensor | None = None
    ) -> Tensor:
        """[B,T,80] each (spks [B,80]) -> [B,T,dim]. Order x ‖ cond ‖ mu ‖ spks (not the U-Net's).
        ``known``: a cached window's frames that exist (see ``CausalConvPositionEmbedding``)."""
        h = self.proj(torch.cat([x, cond, mu, spks.unsqueeze(1).expand(-1, x.size(1), -1)], dim=-1))
        return self.conv_pos_embed(h, known) + h


class RotaryEmbedding(nn.Module):
    """x-transformers ``RotaryEmbedding``: frequencies laid out as interleaved pairs (f0,f0,f1,f1,...)."""

    inv_freq: Tensor

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int) -> Tensor:
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        return torch.stack((freqs, freqs), dim=-1).flatten(-2).unsqueeze(0)  # [1,T,dim]


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate the first freqs.size(-1) channels of x [B,T,C] in adjacent pairs (2i, 2i+1); keep the rest."""
    rot_dim = freqs.size(-1)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    pairs = rot.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rot = rot * freqs.cos() + rotated_half * freqs.sin()
    return torch.cat((rot, rest), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(
        self, x: Tensor, rule: FrameAttention | WindowAttention, freqs: Tensor, kv: KeysValues | None = None
    ) -> Tensor:
        """x [B,T,dim]; rule: who sees whom; freqs [1 or B,T,dim_head] -> [B,T,dim]. ``kv``: a cached
        window's (x holds its query frames only): it keeps their keys/values and adds the prefix's."""
        b = x.size(0)
        q = apply_rotary(self.to_q(x), freqs)  # on the flattened heads: only head 0 rotates
        k = apply_rotary(self.to_k(x), freqs)
        q, k, v = (a.view(b, -1, self.heads, self.dim_head).transpose(1, 2) for a in (q, k, self.to_v(x)))
        if kv is not None:
            k, v = kv(k, v)
        out = rule(q, k, v)
        out = self.to_out[0](out.transpose(1, 2).reshape(b, -1, self.heads * self.dim_head).to(q.dtype))
        # The reference zeroes frames that the LAST query row may not see: the last row sees every valid
        # key in either mask, so these are the padding frames.
        return out.masked_fill(~rule.valid.unsqueeze(-1), 0.0)


def _layer_norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def forward(self, temb: Tensor) -> tuple[Tensor, ...]:
        """[B,dim] -> ``chunks`` modulation vectors [B,1,dim]."""
        return tuple(c.unsqueeze(1) for c in torch.chunk(self.linear(F.silu(temb)), self.chunks, dim=1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        # Index 1 is the reference's dropout; kept so the output layer stays at key ``ff.2``.
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim, 6)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(
        self,
        x: Tensor,
        temb: Tensor,
        rule: FrameAttention | WindowAttention,
        freqs: Tensor,
        kv: KeysValues | None = None,
    ) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(temb)
        x = x + gate_msa * self.attn(_layer_norm(x) * (1 + scale_msa) + shift_msa, rule, freqs, kv)
        return x + gate_mlp * self.ff(_layer_norm(x) * (1 + scale_mlp) + shift_mlp)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormZero(cfg.dim, 2)  # final: (scale, shift), the reverse order
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)
        # the attention rule folded into q/k dimensions instead of a dense mask (engine.flow.attention):
        # a serving choice (EngineConfig.flow_attention), the same softmax; off = the reference's masks
        self.fold_masks = False

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
    ) -> Tensor:
        """x, mu, cond [B,80,T]; mask [B,1,T]; t [B]; spks [B,80] -> velocity [B,80,T] (not masked)."""
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        temb = self.time_embed(t)
        h = self.input_embed(x, cond, mu, spks)
        freqs = self.rotary_embed(x.size(1))
        chunk = self.cfg.static_chunk_size if streaming else 0
        rule = FrameAttention(mask[:, 0].bool(), chunk, self.fold_masks)
        for block in self.transformer_blocks:
            h = block(h, temb, rule, freqs)
        scale, shift = self.norm_out(temb)
        return self.proj_out(_layer_norm(h) * (1 + scale) + shift).transpose(1, 2)

    def forward_window(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        window: DiTWindow | PagedWindow,
        step: int,
    ) -> Tensor:
        """A streaming call of Euler step ``step`` that reuses cached frames: x, mu, cond [B,80,lead+Q] are
        each row's frames from its window start - lead on (``window``: positions, masks, the cache); t [B];
        spks [B,80] -> velocity [B,80,Q] of the window's Q query frames (not masked)."""
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        temb = self.time_embed(t)
        # the lead frames only feed the position conv of the first queries; they are not queries
        h = self.input_embed(x, cond, mu, spks, window.known)[:, window.lead :]
        freqs = self.rotary_embed(window.span)[0][window.query_pos]  # [B,Q,dim_head] at absolute positions
        for layer, block in enumerate(self.transformer_blocks):
            h = block(h, temb, window.rule, freqs, window.keys_values(step, layer))
        scale, shift = self.norm_out(temb)
        return self.proj_out(_layer_norm(h) * (1 + scale) + shift).transpose(1, 2)

    def forward_paged(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        kv: Tensor,
        states: Tensor,
        *rows: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``forward_window`` over page windows (engine.flow.dit_pages), tensors in and out so it compiles
        and captures: x, mu, cond [2B,80,lead+Q]; t [2B]; spks [2B,80]; kv the pool's pages of every step
        (``PagePool.kv_pages``); ``rows``: ``PagedRows.tensors``, page numbers of this call's step (the lead
        pages unused: the solver feeds x's lead itself) -> (velocity
        [2B,80,Q], the window's keys/values [depth,2,2B,H,Q,D], no conv states: ``states`` is the U-Net's)."""
        lead = self.cfg.lead_frames
        chunk, queries = self.cfg.static_chunk_size, x.size(2) - lead
        window = PagedWindow(kv, PagedRows(*rows), lead, chunk, queries, self.fold_masks)
        velocity = self.forward_window(x, mu, t, spks, cond, window, 0)
        return velocity, window.written(), states.new_zeros(0)
