"""CosyVoice2 flow token encoder (``UpsampleConformerEncoder``), the pre-lookahead conv shared with v3, and
the yaml helpers every flow part uses. Keys match the released ``flow.pt`` under ``encoder.``.

Shapes: B batch, T tokens at 25 Hz, D = ``output_size``. The encoder turns token embeddings [B,T,Din] into
frames [B,2T,D] at 50 Hz: Linear+LN+sqrt(D) -> pre-lookahead conv (3 tokens of right context) -> conformer
layers with ESPnet relative positions -> nearest x2 + causal conv -> Linear+LN+sqrt(D) -> 4 more layers -> LN.
The attention masks live in ``engine.flow.attention``.
See reference/cosyvoice-spec.md §2.6, §6.5 and pitfalls 17, 23, 25.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.flow.attention import attention_mask
from engine.yaml_data import tag_of


def yaml_field(node: dict[str, Any], key: str) -> Any:
    """A key the released yaml always sets; fail loudly naming the class and the key when it is absent."""
    if key not in node:
        raise KeyError(f"flow yaml: {tag_of(node) or 'node'} has no {key!r} (keys: {sorted(node)})")
    return node[key]


def expect_tag(node: dict[str, Any], *names: str) -> None:
    if tag_of(node) not in names:
        raise ValueError(f"flow yaml: expected a !new: node of {names}, got {node.get('__tag__')!r}")


def pad_mask(lengths: Tensor, max_len: int) -> Tensor:
    """[B] lengths -> [B, max_len] bool, True on valid positions."""
    return torch.arange(max_len, device=lengths.device) < lengths[:, None]


# EncoderConfig fields read from the yaml's encoder node (the rest are hard-coded in the reference).
_YAML_INTS = (
    "input_size",
    "output_size",
    "attention_heads",
    "linear_units",
    "num_blocks",
    "static_chunk_size",
)


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoder`` geometry. Defaults: the released CosyVoice2 flow (§2.6)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    static_chunk_size: int = 25  # streaming chunk in tokens; x up_stride after upsampling
    num_up_blocks: int = 4  # hard-coded in the reference
    pre_lookahead_len: int = 3  # hard-coded in the reference
    up_stride: int = 2  # hard-coded in the reference

    def __post_init__(self) -> None:
        for name in (*_YAML_INTS, "num_up_blocks", "pre_lookahead_len", "up_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"EncoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.output_size % self.attention_heads:
            raise ValueError(f"output_size {self.output_size} not divisible by {self.attention_heads} heads")
        if self.input_size != self.output_size:
            # up_embed is Linear(input_size, output_size) applied to the output_size-wide up_layer output.
            raise ValueError(f"input_size {self.input_size} must equal output_size {self.output_size}")

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> EncoderConfig:
        expect_tag(node, "UpsampleConformerEncoder")
        fixed = {
            "input_layer": "linear",
            "pos_enc_layer_type": "rel_pos_espnet",
            "selfattention_layer_type": "rel_selfattn",
            "normalize_before": True,
            "use_cnn_module": False,
            "macaron_style": False,
        }
        for key, supported in fixed.items():
            if yaml_field(node, key) != supported:
                raise ValueError(f"flow yaml: encoder {key}={node[key]!r} unsupported (only {supported!r})")
        if node.get("activation_type", "swish") != "swish":
            raise ValueError(f"flow yaml: encoder activation_type={node['activation_type']!r} unsupported")
        return cls(**{k: int(yaml_field(node, k)) for k in _YAML_INTS})


def rel_position_table(size: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """ESPnet relative positions [1, 2*size-1, d_model] for offsets size-1 ... -(size-1) (left to right)."""
    position = torch.arange(0, size, dtype=torch.float32, device=device).unsqueeze(1)
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    pos = torch.zeros(size, d_model, device=device)
    neg = torch.zeros(size, d_model, device=device)
    pos[:, 0::2], pos[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
    neg[:, 0::2], neg[:, 1::2] = torch.sin(-1 * position * div_term), torch.cos(-1 * position * div_term)
    return torch.cat([torch.flip(pos, [0]), neg[1:]]).unsqueeze(0).to(dtype)


class PreLookaheadLayer(nn.Module):
    """Position i sees tokens i..i+lookahead (conv1), then a causal k3 conv, plus the input (residual)."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int = 3) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, 3)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """x [B,T,C] -> [B,T,C]. Positions at or past ``lengths`` read as zeros, as the reference's right
        padding does; look-ahead context tokens are simply the last valid positions of x (the caller drops
        their outputs)."""
        h = x if lengths is None else x * pad_mask(lengths, x.size(1)).unsqueeze(-1).to(x.dtype)
        h = F.pad(h.transpose(1, 2), (0, self.pre_lookahead_len))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class LinearEmbed(nn.Module):
    """``LinearNoSubsampling``: Linear + LayerNorm(1e-5), scaled by sqrt(D) (keys ``out.0``, ``out.1``)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """ESPnet ``RelPositionMultiHeadedAttention``: Transformer-XL attention with learned biases u, v."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        """x [B,T,D], mask [B,T,T] bool, pos_emb [1,2T-1,D] -> [B,T,D]."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.heads, self.d_k)
        k = self.linear_k(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.heads, self.d_k).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        # rel_shift: column c of `position` is offset t-1-c; score (i, j) needs offset i-j.
        idx = (t - 1) - torch.arange(t, device=x.device)[:, None] + torch.arange(t, device=x.device)[None, :]
        position = torch.gather(position, -1, idx.expand(b, self.heads, t, t))
        scores = (content + position) / math.sqrt(self.d_k)
        blocked = ~mask.unsqueeze(1)
        attn = torch.softmax(scores.masked_fill(blocked, -float("inf")), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.heads * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, units)
        self.w_2 = nn.Linear(units, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm (LN eps 1e-12) rel-pos attention + SiLU FFN; no macaron, no conv module."""

    def __init__(self, dim: int, heads: int, units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim)
        self.feed_forward = FeedForward(dim, units)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class Upsample1D(nn.Module):
    """Nearest x stride, then a causal conv of kernel 2*stride+1 (left zero padding)."""

    def __init__(self, channels: int, stride: int = 2) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: Tensor) -> Tensor:
        """[B,C,T] -> [B,C,stride*T]."""
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (self.stride * 2, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearEmbed(cfg.input_size, d)
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        # The reference hard-codes 512 here; 512 is the released output_size, so derive it from that.
        self.pre_lookahead_layer = PreLookaheadLayer(d, d, cfg.pre_lookahead_len)
        units, heads = cfg.linear_units, cfg.attention_heads
        self.encoders = nn.ModuleList(ConformerLayer(d, heads, units) for _ in range(cfg.num_blocks))
        self.up_layer = Upsample1D(d, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.input_size, d)
        self.up_encoders = nn.ModuleList(ConformerLayer(d, heads, units) for _ in range(cfg.num_up_blocks))

    def forward(
        self, xs: Tensor, xs_lens: Tensor, context_len: int, streaming: bool
    ) -> tuple[Tensor, Tensor]:
        """Token embeddings [B,T,Din] (each row's last ``context_len`` valid tokens are look-ahead context
        only) -> frames [B, stride*(T-context_len), D] and their lengths [B]."""
        lens = xs_lens - context_len
        x = self.pre_lookahead_layer(self.embed(xs), xs_lens)[:, : xs.size(1) - context_len]
        chunk = self.cfg.static_chunk_size if streaming else 0
        x = self._layers(self.encoders, x, lens, chunk)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        lens = lens * self.cfg.up_stride
        x = self._layers(self.up_encoders, self.up_embed(x), lens, chunk * self.cfg.up_stride)
        return self.after_norm(x), lens

    def _layers(self, layers: nn.ModuleList, x: Tensor, lens: Tensor, chunk: int) -> Tensor:
        mask = attention_mask(pad_mask(lens, x.size(1)), chunk)
        pos_emb = rel_position_table(x.size(1), x.size(2), x.device, x.dtype)
        for layer in layers:
            x = layer(x, mask, pos_emb)
        return x
