"""CosyVoice2 flow estimator: the causal 1-D U-Net ``CausalConditionalDecoder`` (CosyVoice + Matcha-TTS).
Keys match the released ``flow.pt`` under ``decoder.estimator.``.

One resolution level: down (resnet + transformers + causal conv), mid blocks, up (resnet on [x ‖ skip] +
transformers + causal conv), final causal block, 1x1 projection. Inputs are stacked x ‖ mu ‖ spks ‖ cond
(80 each). Convs are causal (left padding) and every conv input is multiplied by the mask, so a frame never
depends on later frames except through attention. See reference/cosyvoice-spec.md §2.8 and pitfalls 20-23.

``forward_window`` is the streaming call that reuses a request's finished frames (engine.flow.unet_cache):
only a window of query frames runs, each causal conv reading its cached left frames and each attention
layer the cached keys/values of the frames before the window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.flow.attention import FrameAttention
from engine.flow.dit_pages import PagedRows
from engine.flow.encoder import expect_tag, yaml_field
from engine.flow.unet_pages import PagedUNetStep

if TYPE_CHECKING:
    from engine.flow.unet_cache import UNetStep

    WindowStep = UNetStep | PagedUNetStep  # a window's step: cached (eager) or paged (graphs)

# who sees whom in one attention layer: (q, k, v) [B,H,Q,D] -> [B,H,Q,D] (FrameAttention, or a window's)
Rule = Callable[[Tensor, Tensor, Tensor], Tensor]


def sinusoidal_embedding(t: Tensor, dim: int, scale: int = 1000) -> Tensor:
    """Flow time t [B] in [0,1] -> [B, dim] = [sin ‖ cos] of scale*t at dim/2 log-spaced frequencies."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    emb = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((emb.sin(), emb.cos()), dim=-1)


@dataclass(frozen=True)
class UNetConfig:
    """Defaults: the released CosyVoice2 estimator (§2.6, §2.8)."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    static_chunk_size: int = 50  # streaming attention chunk, frames

    @property
    def attention_layers(self) -> int:
        """Transformer blocks in all: ``n_blocks`` at the down, every mid and the up level."""
        return self.n_blocks * (2 + self.num_mid_blocks)

    def __post_init__(self) -> None:
        if len(self.channels) != 1:
            # More levels would need the reference's strided (non-causal) Downsample1D; no release uses it.
            raise ValueError(f"UNetConfig.channels must have one level, got {self.channels}")
        for name in (
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "n_blocks",
            "num_heads",
            "static_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"UNetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_mid_blocks < 0 or self.channels[0] < 1:
            raise ValueError(f"bad UNetConfig: {self}")

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> UNetConfig:
        expect_tag(node, "CausalConditionalDecoder")
        if yaml_field(node, "act_fn") != "gelu":
            raise ValueError(f"flow yaml: estimator act_fn={node['act_fn']!r} unsupported (only 'gelu')")
        ints = (
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "n_blocks",
            "num_mid_blocks",
            "num_heads",
            "static_chunk_size",
        )
        channels = tuple(int(c) for c in yaml_field(node, "channels"))
        return cls(channels=channels, **{k: int(yaml_field(node, k)) for k in ints})


class CausalConv1d(nn.Conv1d):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))

    def after(self, past: Tensor, x: Tensor) -> Tensor:
        """x [B,C,Q] following ``past`` [B,C,kernel-1], the input's frames before x -> [B,C_out,Q]."""
        return super().forward(torch.cat([past, x], dim=2))


class Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """Causal k3 conv -> LayerNorm over channels -> Mish, masked in and out (keys ``block.0``/``block.2``)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(), nn.LayerNorm(dim_out), Transpose(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask

    def window(self, x: Tensor, mask: Tensor, step: WindowStep) -> Tensor:
        """``forward`` on a window's frames, the conv's left frames from ``step``'s cache."""
        conv, *rest = self.block.children()
        if not isinstance(conv, CausalConv1d):
            raise TypeError(f"CausalBlock1D starts with a causal conv, not {type(conv).__name__}")
        h = step.conv(conv, x * mask)
        for layer in rest:
            h = layer(h)
        return h * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)

    def window(self, x: Tensor, mask: Tensor, t: Tensor, step: WindowStep) -> Tensor:
        h = self.block1.window(x, mask, step) + self.mlp(t).unsqueeze(-1)
        return self.block2.window(h, mask, step) + self.res_conv(x * mask)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class SelfAttention(nn.Module):
    """diffusers ``Attention``: q/k/v without bias, ``to_out.0`` with bias. The reference adds a -1e10 bias
    where the mask is False; a bool mask gives the same softmax (exp underflows to 0 either way, and no
    query row is fully masked: every row sees key 0)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, rule: Rule) -> Tensor:
        """x [B,T,C]; rule: who sees whom -> [B,T,C]."""
        b = x.size(0)
        q, k, v = (
            p(x).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
            for p in (self.to_q, self.to_k, self.to_v)
        )
        out = rule(q, k, v)
        return self.to_out[0](out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class GeluProjection(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))  # exact erf GELU here; the DiT uses the tanh one


class GeluFeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        # Index 1 is the reference's dropout; kept so the output layer stays at key ``net.2``.
        self.net = nn.ModuleList([GeluProjection(dim, mult * dim), nn.Identity(), nn.Linear(mult * dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class TransformerBlock(nn.Module):
    """Matcha ``BasicTransformerBlock`` without cross attention: LN -> attn -> +, LN -> FF(x4, GELU) -> +."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = GeluFeedForward(dim)

    def forward(self, x: Tensor, rule: Rule) -> Tensor:
        x = self.attn1(self.norm1(x), rule) + x
        return self.ff(self.norm3(x)) + x


class CausalConditionalDecoder(nn.Module):
    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, time_dim = cfg.channels[0], cfg.channels[0] * 4
        self.time_mlp = TimestepEmbedding(cfg.in_channels, time_dim)
        self.down_blocks = nn.ModuleList(
            [self._level(cfg.in_channels, ch, time_dim, CausalConv1d(ch, ch, 3))]
        )
        self.mid_blocks = nn.ModuleList(self._level(ch, ch, time_dim) for _ in range(cfg.num_mid_blocks))
        self.up_blocks = nn.ModuleList([self._level(2 * ch, ch, time_dim, CausalConv1d(ch, ch, 3))])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, cfg.out_channels, 1)
        # the attention rule folded into q/k dimensions instead of a dense mask (engine.flow.attention):
        # a serving choice (EngineConfig.flow_attention), the same softmax; off = the reference's masks
        self.fold_masks = False

    def _level(self, dim: int, dim_out: int, time_dim: int, conv: nn.Module | None = None) -> nn.ModuleList:
        blocks = nn.ModuleList(
            TransformerBlock(dim_out, self.cfg.num_heads, self.cfg.attention_head_dim)
            for _ in range(self.cfg.n_blocks)
        )
        parts = [CausalResnetBlock1D(dim, dim_out, time_dim), blocks]
        return nn.ModuleList([*parts, conv] if conv is not None else parts)

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
        """x, mu, cond [B,80,T]; mask [B,1,T]; t [B]; spks [B,80] -> velocity [B,80,T] (x mask)."""
        # t in float32 whatever the weights (a bf16 t would move 1000*t by whole radians)
        temb = self.time_mlp(sinusoidal_embedding(t.float(), self.cfg.in_channels).to(x.dtype))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)
        chunk = self.cfg.static_chunk_size if streaming else 0
        rule = FrameAttention(mask[:, 0].bool(), chunk, self.fold_masks)
        down, up = self.down_blocks[0], self.up_blocks[0]
        skip = self._stage(down, x, mask, temb, rule)
        x = self._conv(down)(skip * mask)
        for level in self.mid_blocks:
            x = self._stage(level, x, mask, temb, rule)
        x = self._stage(up, torch.cat([x[:, :, : skip.size(2)], skip], dim=1), mask, temb, rule)
        x = self.final_block(self._conv(up)(x * mask), mask)
        return self.final_proj(x * mask) * mask

    @staticmethod
    def _stage(level: nn.Module, x: Tensor, mask: Tensor, temb: Tensor, rule: FrameAttention) -> Tensor:
        """A level's resnet then its transformer blocks (the level's conv, if any, is the caller's)."""
        resnet, blocks, *_ = level.children()
        h = resnet(x, mask, temb).transpose(1, 2).contiguous()
        for block in blocks.children():
            h = block(h, rule)
        return h.transpose(1, 2).contiguous()

    def forward_window(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, step: WindowStep
    ) -> Tensor:
        """``forward`` in a streaming call that reuses cached frames: x, mu, cond [B,80,Q] are each row's
        query frames (``step``: its window, Euler step and caches); t [B]; spks [B,80] -> velocity
        [B,80,Q] (x mask)."""
        temb = self.time_mlp(sinusoidal_embedding(t.float(), self.cfg.in_channels).to(x.dtype))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)
        mask = step.mask.to(x.dtype)
        down, up = self.down_blocks[0], self.up_blocks[0]
        skip = self._stage_window(down, x, mask, temb, step)
        x = step.conv(self._conv(down), skip * mask)
        for level in self.mid_blocks:
            x = self._stage_window(level, x, mask, temb, step)
        x = self._stage_window(up, torch.cat([x, skip], dim=1), mask, temb, step)
        x = self.final_block.window(step.conv(self._conv(up), x * mask), mask, step)
        step.check()
        return self.final_proj(x * mask) * mask

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
        """``forward_window`` over page windows (engine.flow.unet_pages), tensors in and out so it
        compiles and captures: x, mu, cond [2B,80,Q]; t [2B]; spks [2B,80]; kv and states the pool's pages of
        every step (``PagePool.kv_pages``, ``states_pages``); ``rows``: ``PagedRows.tensors``, page numbers of
        this call's step (lead pages [2B,1]) -> (velocity [2B,80,Q], the window's
        keys/values [depth,2,2B,H,Q,D], its conv states [2B,chunks,numbers])."""
        chunk = self.cfg.static_chunk_size
        convs = self.conv_states()
        step = PagedUNetStep(kv, states, PagedRows(*rows), chunk, x.size(2), convs, self.fold_masks)
        return self.forward_window(x, mu, t, spks, cond, step), *step.written()

    @staticmethod
    def _stage_window(level: nn.Module, x: Tensor, mask: Tensor, temb: Tensor, step: WindowStep) -> Tensor:
        """``_stage`` on a window: the resnet's convs and every block's attention from ``step``."""
        resnet, blocks, *_ = level.children()
        if not isinstance(resnet, CausalResnetBlock1D):
            raise TypeError(f"a U-Net level starts with a resnet block, not {type(resnet).__name__}")
        h = resnet.window(x, mask, temb, step).transpose(1, 2).contiguous()
        for block in blocks.children():
            h = block(h, step.attention())
        return h.transpose(1, 2).contiguous()

    def causal_convs(self) -> list[CausalConv1d]:
        """Every causal conv, in the order ``forward`` calls them (registration order)."""
        return [m for m in self.modules() if isinstance(m, CausalConv1d)]

    def conv_states(self) -> tuple[tuple[int, int], ...]:
        """Each causal conv's (input channels, left frames it reads = kernel - 1), in call order: what a
        window needs of the frames before it."""
        return tuple((c.in_channels, c.kernel_size[0] - 1) for c in self.causal_convs())

    @staticmethod
    def _conv(level: nn.Module) -> CausalConv1d:
        conv = list(level.children())[2]
        if not isinstance(conv, CausalConv1d):
            raise TypeError(f"a U-Net level ends with a causal conv, not {type(conv).__name__}")
        return conv
