"""Qwen2 decoder (the speech LM backbone) in plain PyTorch, laid out so its state-dict keys are HF's.

Same computation as transformers' ``Qwen2ForCausalLM`` (RMSNorm, rotate-half RoPE, grouped-query attention
with q/k/v bias, SiLU-gated MLP), but attention reads and writes per-request ``KVCache`` objects, so one
forward can extend several requests whose caches have different lengths (padding + masking).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from engine.models.speech_lm import SpeechLMConfig


class KVCache:
    """One request's keys/values for every layer; owned by the request, not by the model.

    ``kv`` is [layers, 2 (k, v), kv_heads, capacity, head_dim]; positions ``[0, length)`` are valid. It grows
    by doubling, and unused slots stay finite (zeros or stale values) because padded batches read them
    under a mask, and a NaN there would still poison the softmax-weighted sum.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 256,
    ):
        self.kv = torch.zeros(
            num_layers, 2, num_kv_heads, max(capacity, 1), head_dim, dtype=dtype, device=device
        )
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (valid ones are kept)."""
        if total <= self.capacity:
            return
        grown = self.kv.new_zeros(*self.kv.shape[:3], max(total, 2 * self.capacity), self.kv.shape[4])
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown


class _CacheStep:
    """One forward over T new positions per request: where they go and which keys each query sees."""

    def __init__(self, caches: Sequence[KVCache] | None, batch: int, steps: int, device: torch.device):
        self.caches, self.steps = caches, steps
        starts = [c.length for c in caches] if caches is not None else [0] * batch
        if len(starts) != batch:
            raise ValueError(f"{batch} sequences but {len(starts)} caches")
        self.span = max(starts) + steps  # keys in the padded batch
        start = torch.tensor(starts, device=device)
        self.positions = start[:, None] + torch.arange(steps, device=device)  # [B, T] rotary positions
        # SDPA's own causal flag suffices when every sequence starts at 0; one request alone sees all keys
        # when it adds a single position. Otherwise query t of request b sees keys j <= start_b + t.
        self.is_causal = max(starts) == 0 and steps > 1
        self.mask: Tensor | None = None
        if not self.is_causal and not (batch == 1 and steps == 1):
            keys = torch.arange(self.span, device=device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # [B, 1, T, span]
        if caches is not None:
            for c in caches:
                c.reserve(self.span)

    def keys_values(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, kv_heads, T, D] of the new positions -> all keys/values [B, kv_heads, span, D]."""
        if self.caches is None:
            return k, v
        new = torch.stack((k, v), dim=1)  # [B, 2, kv_heads, T, D]
        for b, c in enumerate(self.caches):
            c.kv[layer, :, :, c.length : c.length + self.steps] = new[b]
        if len(self.caches) == 1:
            kv = self.caches[0].kv[layer, :, :, : self.span].unsqueeze(0)  # a view, no copy
        else:
            kv = torch.stack([c.kv[layer, :, :, : self.span] for c in self.caches])
        return kv[:, 0], kv[:, 1]

    def commit(self) -> None:
        for c in self.caches or ():
            c.length += self.steps


def rotary(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, head_dim] in float32 for integer positions [B, T] (HF default rope)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Non-interleaved ("rotate_half") rotation of x [B, heads, T, D], computed in float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # statistics in float32 whatever the weights' dtype, as HF does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: _CacheStep, layer: int) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        keys, values = step.keys_values(layer, k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=step.mask, is_causal=step.is_causal, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: _CacheStep, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """``Qwen2Model``: embed_tokens, layers, final norm. Takes embeddings, returns the normed last hidden."""

    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.embed_tokens = nn.Embedding(cfg.text_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, caches: Sequence[KVCache] | None = None) -> Tensor:
        """embeds [B, T, H] -> hidden [B, T, H]; with caches, appends T positions to each of the B caches."""
        step = _CacheStep(caches, embeds.shape[0], embeds.shape[1], embeds.device)
        rope = rotary(step.positions, self.head_dim, self.rope_theta)
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, step, i)
        step.commit()
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """Holds the backbone and the (tied, never used for speech) ``lm_head`` so the released keys load."""

    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.text_vocab_size, bias=False)
        self.tied = cfg.tie_word_embeddings
        self._tie()
        # load_state_dict(assign=True) swaps in two separate tensors; re-tie so the table is held once.
        self.register_load_state_dict_post_hook(lambda module, _keys: module._tie())

    def _tie(self) -> None:
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Encoder(nn.Module):
    """CosyVoice's ``Qwen2Encoder`` wrapper: the key prefix ``llm.model.`` comes from here."""

    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.model = Qwen2ForCausalLM(cfg)

    def forward(self, embeds: Tensor, caches: Sequence[KVCache] | None = None) -> Tensor:
        return self.model.model(embeds, caches)
