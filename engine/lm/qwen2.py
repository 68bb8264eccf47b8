"""Qwen2 decoder (the speech LM backbone) in plain PyTorch, laid out so its state-dict keys are HF's.

Same computation as transformers' ``Qwen2ForCausalLM`` (RMSNorm, rotate-half RoPE, grouped-query attention
with q/k/v bias, SiLU-gated MLP), but attention reads and writes per-request ``KVCache`` objects, so one
forward can extend several requests whose caches have different lengths (padding + masking).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.lm.lm_config import SpeechLMConfig

# cuDNN attention (torch's first choice on Hopper) builds a graph per shape, and the key span changes every
# decode step: ~2 ms of CPU per call. These backends have no per-shape setup; the list is ordered by priority.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    """One forward over T new positions per request: where they go and which keys each query sees.

    One request (or no cache): new keys are written into the cache first and attention reads a view of it.
    Several requests: their pasts are gathered once per forward into one padded tensor
    [layers, 2, B, kv_heads, max_len, D], each layer attends to (that past ++ its new keys), and the new keys
    are written back at the end: B copies per forward instead of B per layer. Query t of request b sees
    past keys j < start_b and new keys t' <= t; its rotary position is start_b + t.
    """

    def __init__(self, caches: Sequence[KVCache] | None, batch: int, steps: int, device: torch.device):
        self.caches, self.steps = caches, steps
        starts = [c.length for c in caches] if caches is not None else [0] * batch
        if len(starts) != batch or (caches is not None and len({id(c) for c in caches}) != batch):
            raise ValueError(f"{batch} sequences need {batch} distinct caches")
        start = torch.tensor(starts, device=device)
        new = torch.arange(steps, device=device)
        self.positions = start[:, None] + new  # [B, T]
        self.is_causal = max(starts) == 0 and steps > 1  # SDPA's own flag: no mask tensor needed
        self.mask: Tensor | None = None
        self.gathered: Tensor | None = None
        self.fresh: list[Tensor] = []
        for c in caches or ():
            c.reserve(max(starts) + steps)  # gathering reads every cache up to the longest past
        if caches is not None and batch > 1:
            past = max(starts)
            self.gathered = torch.stack([c.kv[:, :, :, :past] for c in caches], dim=2)
            seen = torch.arange(past, device=device)[None, None, :] < start[:, None, None]  # [B, 1, past]
            causal = new[None, :] <= new[:, None]  # [T, T]
            self.mask = torch.cat((seen.expand(-1, steps, -1), causal.expand(batch, -1, -1)), -1)[:, None]
        elif not self.is_causal and steps > 1:  # one request extending a non-empty cache by several
            keys = torch.arange(starts[0] + steps, device=device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # [1, 1, T, span]

    def keys_values(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, kv_heads, T, D] of the new positions -> the keys/values to attend [B, kv_heads, S, D]."""
        if self.caches is None:
            return k, v
        if self.gathered is not None:
            self.fresh.append(torch.stack((k, v)))  # [2, B, kv_heads, T, D]
            kv = torch.cat((self.gathered[layer], self.fresh[-1]), dim=3)
            return kv[0], kv[1]
        c = self.caches[0]
        c.kv[layer, :, :, c.length : c.length + self.steps] = torch.stack((k[0], v[0]))
        kv = c.kv[layer, :, :, : c.length + self.steps]  # a view, no copy
        return kv[0][None], kv[1][None]

    def commit(self) -> None:
        """Write back gathered-mode keys/values and advance every cache by T."""
        fresh = torch.stack(self.fresh) if self.fresh else None  # [layers, 2, B, kv_heads, T, D]
        for b, c in enumerate(self.caches or ()):
            if fresh is not None:
                c.kv[:, :, :, c.length : c.length + self.steps] = fresh[:, :, b]
            c.length += self.steps


class SlotStep:
    """One decode position for a request whose keys/values live in a fixed buffer ``kv``
    [layers, 2, kv_heads, capacity, D], at position ``pos`` ([1] long on the device): every tensor it reads
    or writes keeps its address, so the step can be captured in a CUDA graph once and replayed with a new
    ``pos``. Attention reads all ``capacity`` keys under a mask (key j seen when j <= pos); the positions
    past ``pos`` hold finite stale values or zeros."""

    def __init__(self, kv: Tensor, pos: Tensor):
        self.kv, self.pos = kv, pos
        self.positions = pos.view(1, 1)  # [B=1, T=1]
        self.is_causal = False
        keys = torch.arange(kv.shape[3], device=kv.device)
        self.mask: Tensor | None = (keys <= pos)[None, None, None, :]  # [1, 1, 1, capacity]

    def keys_values(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [1, kv_heads, 1, D] written at ``pos``; the layer's buffer [1, kv_heads, capacity, D]."""
        self.kv[layer].index_copy_(2, self.pos, torch.stack((k[0], v[0])))
        return self.kv[layer, 0][None], self.kv[layer, 1][None]

    def commit(self) -> None:
        """Nothing to write back: the caller advances its cache's length."""


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T] (HF default rope).

    Angles are computed in float32 and then cast to the compute dtype, as HF does. ``sin`` comes back with
    its first half negated so that rotate_half(x) * sin == roll(x, half) * sin (one kernel fewer per call).
    """
    exponent = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Non-interleaved ("rotate_half") rotation of x [B, heads, T, D]: x * cos + rotate_half(x) * sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # statistics in float32 whatever the weights' dtype, as HF does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


Step = _CacheStep | SlotStep


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: SpeechLMConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: Step, layer: int) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        keys, values = step.keys_values(layer, k, v)
        if step.mask is not None:  # the fused kernels that take a mask do not take grouped heads
            rep = self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=step.mask, is_causal=step.is_causal, enable_gqa=step.mask is None
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

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], step: Step, layer: int) -> Tensor:
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
        return self.run(embeds, _CacheStep(caches, embeds.shape[0], embeds.shape[1], embeds.device))

    def run(self, embeds: Tensor, step: Step) -> Tensor:
        """embeds [B, T, H] -> hidden [B, T, H], the keys/values read and written as ``step`` says."""
        rope = rotary(step.positions, self.head_dim, self.rope_theta, embeds.dtype)
        x = embeds
        with sdpa_kernel(_SDPA_BACKENDS, set_priority=True):  # once per forward: entering costs ~75 us
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
