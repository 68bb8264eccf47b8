"""Flow matching: speech tokens -> 80-bin mel for CosyVoice2 (``CausalMaskedDiffWithXvec``: conformer encoder
+ U-Net) and CosyVoice3 (``CausalMaskedDiffWithDiT``: pre-lookahead conv + DiT). Keys match the released
``flow.pt`` (strict load); ``build_flow`` takes the yaml's ``flow`` node read as data.

Call semantics (reference/cosyvoice-spec.md §6.5, §7): prompt tokens ‖ tokens -> 2 frames per token ->
``mu``; ``cond`` holds the prompt mel; 10 Euler steps on a cosine schedule from a FIXED noise buffer,
classifier-free guidance 0.7 as one batch [cond rows ‖ uncond rows]; the prompt frames are cut off.
``finalize=False`` makes each row's last 3 tokens look-ahead context only. Rows may be right-padded; each
row of a padded batch equals that row run alone.

Streaming calls may reuse each request's finished frames instead of re-running its whole prefix
(``inference(..., caches=...)``, ``CausalCFM.forward_cached``; why it is exact: engine.flow.dit_cache for
CosyVoice3's DiT, engine.flow.unet_cache for CosyVoice2's U-Net).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import TooLarge
from engine.flow.dit import DiT, DiTConfig
from engine.flow.dit_cache import CacheLayout, DiTCache, DiTWindow, ReuseBudget
from engine.flow.dit_pages import PagedCache, PagedRows, PagePool
from engine.flow.encoder import (
    EncoderConfig,
    PreLookaheadLayer,
    UpsampleConformerEncoder,
    expect_tag,
    pad_mask,
    yaml_field,
)
from engine.flow.unet import CausalConditionalDecoder, UNetConfig
from engine.flow.unet_cache import UNetCache, UNetLayout, UNetWindow
from engine.yaml_data import tag_of

MEL_DIM = 80  # the reference CFM hard-codes 80 mel channels
# a frame cache's sizes (``CausalCFM.cache_sizes``): Euler steps, attention layers, heads, head dim, x's mel
# channels, chunk, lead frames
CacheSizes = tuple[int, int, int, int, int, int, int]


def flow_noise(frames: int = 15000, seed: int = 0) -> Tensor:
    """The reference's fixed z0: ``set_all_random_seed(0); torch.randn(1, 80, 15000)`` on CPU, drawn here
    from a private generator so the global RNG is left alone. Position-locked: a call uses [:, :, :T]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(1, MEL_DIM, frames, generator=gen, device="cpu")


@dataclass(frozen=True)
class CfmConfig:
    """``CausalConditionalCFM`` inference settings. Defaults: every released yaml (n_timesteps is fixed at
    10 by the reference's flow.inference, not by the yaml)."""

    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    n_timesteps: int = 10
    temperature: float = 1.0
    noise_frames: int = 15000  # 300 s at 50 frames/s
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if self.t_scheduler not in ("cosine", "linear"):
            raise ValueError(f"t_scheduler must be 'cosine' or 'linear', got {self.t_scheduler!r}")
        if self.n_timesteps < 1 or self.noise_frames < 1 or self.temperature <= 0:
            raise ValueError(f"bad CfmConfig: {self}")

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> CfmConfig:
        expect_tag(node, "CausalConditionalCFM")
        if int(yaml_field(node, "spk_emb_dim")) != MEL_DIM:
            raise ValueError(f"flow yaml: decoder spk_emb_dim={node['spk_emb_dim']} (only {MEL_DIM})")
        params = yaml_field(node, "cfm_params")
        params = params.get("content", params)
        if yaml_field(params, "solver") != "euler":
            raise ValueError(f"flow yaml: cfm_params solver={params['solver']!r} unsupported (only 'euler')")
        return cls(
            inference_cfg_rate=float(yaml_field(params, "inference_cfg_rate")),
            t_scheduler=str(yaml_field(params, "t_scheduler")),
        )


@dataclass(frozen=True)
class CfmInputs:
    """What the solver gets: mu/cond [B,80,T], mask [B,1,T], spks [B,80]; per-row prompt/total frames [B]."""

    mu: Tensor
    mask: Tensor
    spks: Tensor
    cond: Tensor
    prompt_frames: Tensor
    total_frames: Tensor


@dataclass(frozen=True, eq=False)
class FlowBatch:
    """One padded flow call's rows, right-padded to the longest: tokens ``token`` [B,T] long (speech
    tokens, 25 Hz) with ``token_len`` [B]; the voice's prompt tokens ``prompt_token`` [B,P] long with
    ``prompt_token_len`` [B]; its prompt mel ``prompt_feat`` [B,F,80] (frames x mel bins, 50 Hz) with
    ``prompt_feat_len`` [B]; its speaker embedding ``embedding`` [B,192]. eq=False: tensors have no
    single truth value."""

    token: Tensor
    token_len: Tensor
    prompt_token: Tensor
    prompt_token_len: Tensor
    prompt_feat: Tensor
    prompt_feat_len: Tensor
    embedding: Tensor

    @classmethod
    def one(cls, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> FlowBatch:
        """A single unpadded row ([1,T], [1,P], [1,F,80], [1,192]): the lengths are the tensors' own."""
        lens = [torch.tensor([t.size(1)], device=token.device) for t in (token, prompt_token, prompt_feat)]
        return cls(token, lens[0], prompt_token, lens[1], prompt_feat, lens[2], embedding)


class CausalCFM(nn.Module):
    """Euler solver with CFG around an estimator(x, mask, mu, t, spks, cond, streaming) -> [B,80,T]."""

    def __init__(self, cfg: CfmConfig, estimator: nn.Module, noise: Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.estimator = estimator
        # plain attribute: not in flow.pt
        self.noise = flow_noise(cfg.noise_frames, cfg.noise_seed) if noise is None else noise
        self._noise_cache: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._schedule_cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def fold_attention(self) -> None:
        """The DiT's or U-Net's attention rules folded into q/k dimensions from now on, instead of a dense
        mask (engine.flow.attention); before any compile or capture, which bake the choice in."""
        est = self.estimator
        if not isinstance(est, DiT | CausalConditionalDecoder):
            raise TypeError(f"folded attention needs the DiT or U-Net estimator, not {type(est).__name__}")
        est.fold_masks = True

    def with_estimator(self, estimator: nn.Module) -> CausalCFM:
        """The same solver (settings, noise buffer) around another estimator, e.g. a compiled one; it shares
        this one's device copies of the noise and the step schedule (what graphs of either read)."""
        twin = CausalCFM(self.cfg, estimator, self.noise)
        twin._noise_cache, twin._schedule_cache = self._noise_cache, self._schedule_cache
        return twin

    def initial_noise(self, frames: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        if frames > self.noise.size(2):
            limit = self.noise.size(2)
            raise TooLarge(f"speech too long for one flow pass: {frames} mel frames, at most {limit} (300 s)")
        key = (device, dtype)
        if key not in self._noise_cache:
            self._noise_cache[key] = self.noise.to(device=device, dtype=dtype)
        return self._noise_cache[key][:, :, :frames] * self.cfg.temperature

    def t_span(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        t = torch.linspace(0, 1, self.cfg.n_timesteps + 1, device=device, dtype=dtype)
        return 1 - torch.cos(t * 0.5 * torch.pi) if self.cfg.t_scheduler == "cosine" else t

    def schedule(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Each Euler step's time t and step size dt, [steps] each, as the reference's loop computes them
        (dt against the accumulated t); kept per device and dtype, so a captured step reads them in place.
        Made as normal tensors even in inference mode: a later solve with autograd on may save them."""
        key = (device, dtype)
        if key not in self._schedule_cache:
            with torch.inference_mode(False), torch.no_grad():
                self._schedule_cache[key] = self._schedule(device, dtype)
        return self._schedule_cache[key]

    def _schedule(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        span = self.t_span(device, dtype)
        t, dt, times, sizes = span[0:1], span[1] - span[0], [], []
        for step in range(1, len(span)):
            times.append(t)
            sizes.append(dt.reshape(1))
            t = t + dt
            if step < len(span) - 1:
                dt = span[step + 1] - t
        return torch.cat(times), torch.cat(sizes)

    def forward(self, inputs: CfmInputs, streaming: bool) -> Tensor:
        """-> mel [B,80,T] float32."""
        b, frames = inputs.mu.size(0), inputs.mu.size(2)
        x = self.initial_noise(frames, inputs.mu.device, inputs.mu.dtype).expand(b, -1, -1)
        return self._euler(x, self._velocity(inputs, streaming)).float()

    def solve_step(self, x: Tensor, step: Tensor, inputs: CfmInputs, streaming: bool) -> Tensor:
        """One Euler step of ``forward``, in place: x [B,80,T] the state entering step ``step`` ([1] long, on
        x's device: one captured step serves all of them) -> x after it."""
        return self._advance_at(x, step, self._velocity(inputs, streaming))

    def _velocity(self, inputs: CfmInputs, streaming: bool) -> Callable[[Tensor, Tensor, Any], Tensor]:
        """The guided estimator for ``_euler``: x [B,80,T], t [1] -> [2B,80,T]. Rows [0, b) are conditioned,
        rows [b, 2b) the unconditional twins (mu, spks, cond zeroed)."""
        spks, b = inputs.spks, inputs.mu.size(0)
        mask_in = torch.cat([inputs.mask, inputs.mask]).to(spks.dtype)
        mu_in, spks_in, cond_in = _guided(inputs.mu, spks, inputs.cond)

        def velocity(x: Tensor, t: Tensor, step: Any) -> Tensor:
            x_in = torch.cat([x, x]).to(spks.dtype)
            return self.estimator(x_in, mask_in, mu_in, t.expand(2 * b), spks_in, cond_in, streaming)

        return velocity

    def _euler(self, x: Tensor, velocity: Callable[[Tensor, Tensor, Any], Tensor]) -> Tensor:
        """The reference's Euler loop with classifier-free guidance: ``velocity(x [B,80,Q], t [1], step)``
        -> [2B,80,Q], the conditioned rows then their unconditioned twins -> x after the last step."""
        times, sizes = self.schedule(x.device, x.dtype)
        for step in range(self.cfg.n_timesteps):
            # t [1] a tensor of its own, as the stepped solve's ``times[step]``: a view of the schedule (a
            # normal tensor) gave the estimator's call another specialisation key (engine.flow.precompiled),
            # so a call past the graphs found no loaded program and compiled one in the serving process (a
            # 2-s first chunk for a 6.3-s prompt on an H100)
            t = times[step : step + 1].clone()
            x = self._advance(x, velocity(x, t, step), sizes[step : step + 1])
        return x

    def _advance_at(
        self, x: Tensor, step: Tensor, velocity: Callable[[Tensor, Tensor, Any], Tensor]
    ) -> Tensor:
        """``_euler``'s step ``step`` ([1] long) in place on x."""
        times, sizes = self.schedule(x.device, x.dtype)
        return x.copy_(self._advance(x, velocity(x, times[step], step), sizes[step]))

    def _advance(self, x: Tensor, v: Tensor, dt: Tensor) -> Tensor:
        """x + dt * the guided velocity (``inference_cfg_rate``) of v [2B,...]: cond rows, uncond twins."""
        v_cond, v_uncond = v.split(x.size(0))
        rate = self.cfg.inference_cfg_rate
        return x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)

    def forward_paged(
        self,
        pool: PagePool,
        noise: Tensor,
        mu: Tensor,
        cond: Tensor,
        spks: Tensor,
        *batch: Tensor,
    ) -> Tensor:
        """The streaming solve of a batch of page windows (engine.flow.dit_pages, unet_pages), from tensors
        only and without a host sync (the CUDA-graph solver captures it): noise [B,80,Q] at the query frames;
        mu, cond [B,80,lead+Q] from each window's lead on (the U-Net: no lead); spks [B,80]; ``batch``:
        ``PagedBatch.tensors`` (start, total, prefix, writes, lead) -> x [B,80,Q] float32. Every step keeps
        the chunks the call completes in their pages: keys/values, and the DiT's x or the U-Net's conv
        states. The estimator: the DiT, the U-Net, or a stand-in with their ``forward_paged`` (compiled)."""
        return self._euler(noise, self._paged_velocity(pool, mu, cond, spks, batch)).float()

    def forward_paged_step(
        self, pool: PagePool, x: Tensor, step: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, *batch: Tensor
    ) -> Tensor:
        """One Euler step of ``forward_paged``, in place: x [B,80,Q] the state entering step ``step`` ([1]
        long, on x's device: the pool's pages of that step are read and written through it) -> x after it."""
        return self._advance_at(x, step, self._paged_velocity(pool, mu, cond, spks, batch))

    def _paged_velocity(
        self, pool: PagePool, mu: Tensor, cond: Tensor, spks: Tensor, batch: tuple[Tensor, ...]
    ) -> Callable[[Tensor, Tensor, Any], Tensor]:
        """``forward_paged``'s guided estimator for ``_euler``: x [B,80,Q], t [1], the step (an int, or a
        [1] long tensor) -> [2B,80,Q], keeping the chunks the call completes at that step in their pages."""
        paged: Callable[..., tuple[Tensor, ...]] = self.estimator.forward_paged  # type: ignore[assignment]
        b, lay = mu.size(0), pool.layout
        start, total, prefix, writes, lead = batch
        mu_in, spks_in, cond_in = _guided(mu, spks, cond)

        def velocity(x: Tensor, t: Tensor, step: int | Tensor) -> Tensor:
            # the page numbers in the pool's pages of this step, each made once a step
            kept, before = pool.at(step, writes), pool.at(step, lead)
            if lay.lead:  # the DiT: x of the position conv's lead frames, from the pages before the window
                pool.keep_x(x, kept)
                x = torch.cat([pool.lead_x(before).to(x.dtype), x], dim=2)  # [B,80,lead+Q]
            x_in = torch.cat([x, x]).to(spks.dtype)
            rows = PagedRows.of(pool.at(step, prefix), start, total, before).tensors  # the estimator's rows
            v, new, states = paged(
                x_in, mu_in, t.expand(2 * b), spks_in, cond_in, pool.kv_pages, pool.states_pages, *rows
            )
            pool.keep_kv(new, kept)
            if lay.states:
                pool.keep_states(states, kept)
            return v

        return velocity

    def frame_cache(self, budget: ReuseBudget) -> DiTCache:
        """A fresh per-request cache for ``forward_cached`` (the U-Net's kind or the DiT's) in ``budget``."""
        return UNetCache(budget) if isinstance(self.estimator, CausalConditionalDecoder) else DiTCache(budget)

    @property
    def cache_sizes(self) -> CacheSizes | None:
        """(Euler steps, attention layers, heads, head dim, x's mel channels, chunk, lead frames) of the
        estimator's frame caches and pages: the DiT keeps x and reads 60 lead frames; the U-Net neither (its
        convs' left frames are their states); None for another estimator."""
        est, steps = self.estimator, self.cfg.n_timesteps
        if isinstance(est, DiT):
            c = est.cfg
            return steps, c.depth, c.heads, c.dim_head, c.mel_dim, c.static_chunk_size, c.lead_frames
        if isinstance(est, CausalConditionalDecoder):
            u = est.cfg
            return steps, u.attention_layers, u.num_heads, u.attention_head_dim, 0, u.static_chunk_size, 0
        return None

    @property
    def reuses_frames(self) -> bool:
        """Whether ``forward_cached`` can run: the estimator is the DiT or the U-Net itself (not a compiled
        or graphed stand-in)."""
        return isinstance(self.estimator, DiT | CausalConditionalDecoder)

    def forward_cached(self, inputs: CfmInputs, caches: Sequence[DiTCache | PagedCache]) -> Tensor:
        """The streaming solve of ``forward`` computing only each row's frames after its cache (one cache
        per row: a ``DiTCache`` for the DiT, a ``UNetCache`` for the U-Net), which it then extends -> mel
        [B,80,T] float32, zero before each row's window: those frames were not computed, so callers must not
        emit them."""
        mu, frames = inputs.mu, inputs.mu.size(2)
        noise = self.initial_noise(frames, mu.device, mu.dtype).expand(mu.size(0), -1, -1)
        own = [c for c in caches if isinstance(c, DiTCache)]
        if len(own) != len(caches):
            raise TypeError("the eager solver reuses frames from a DiTCache or UNetCache per row")
        window, velocity = self._window(inputs, own, noise)
        x = self._euler(window.queries(noise), velocity)  # [B,80,Q]
        window.commit()
        return window.place(x.float(), frames)

    def _window(
        self, inputs: CfmInputs, caches: Sequence[DiTCache], noise: Tensor
    ) -> tuple[DiTWindow, Callable[[Tensor, Tensor, int], Tensor]]:
        """The estimator's window over the rows' caches and its velocity for ``_euler``: the DiT's reads
        its lead frames' x from the caches, the U-Net's gives every conv and attention layer its left
        context from them."""
        est, spks, b = self.estimator, inputs.spks, inputs.mu.size(0)
        totals, sizes = inputs.total_frames.tolist(), self.cache_sizes
        if isinstance(est, CausalConditionalDecoder) and sizes is not None:
            unet = UNetWindow(_unet_caches(caches), totals, _unet_layout(est, sizes, noise))
            mu_in, spks_in, cond_in = _guided(unet.queries(inputs.mu), spks, unet.queries(inputs.cond))

            def unet_velocity(x: Tensor, t: Tensor, step: int) -> Tensor:
                x_in = torch.cat([x, x]).to(spks.dtype)
                return est.forward_window(x_in, mu_in, t.expand(2 * b), spks_in, cond_in, unet.step(step))

            return unet, unet_velocity
        if not isinstance(est, DiT) or sizes is None:
            raise TypeError(f"frame reuse needs the DiT or U-Net estimator, not {type(est).__name__}")
        dit = DiTWindow(caches, totals, _dit_layout(est, sizes, noise))
        mu_in, spks_in, cond_in = _guided(dit.frames(inputs.mu), spks, dit.frames(inputs.cond))

        def dit_velocity(x: Tensor, t: Tensor, step: int) -> Tensor:  # the lead's x from the cache
            dit.keep_x(step, x)
            x_win = torch.cat([dit.lead_x(step, x), x], dim=2)  # [B,80,lead+Q]
            x_in = torch.cat([x_win, x_win]).to(spks.dtype)
            return est.forward_window(x_in, mu_in, t.expand(2 * b), spks_in, cond_in, dit, step)

        return dit, dit_velocity


def _unet_caches(caches: Sequence[DiTCache]) -> list[UNetCache]:
    out = [c for c in caches if isinstance(c, UNetCache)]
    if len(out) != len(caches):
        raise TypeError("frame reuse with the U-Net needs a UNetCache per row")
    return out


def _unet_layout(est: CausalConditionalDecoder, sizes: CacheSizes, x: Tensor) -> UNetLayout:
    """The U-Net's cache (``CausalCFM.cache_sizes``): keys/values of its attention layers and its convs'
    states in its weights' dtype."""
    return UNetLayout(*sizes, est.final_proj.weight.dtype, x.dtype, x.device, est.conv_states())


def _dit_layout(est: DiT, sizes: CacheSizes, x: Tensor) -> CacheLayout:
    """The DiT's cache (``CausalCFM.cache_sizes``): keys/values in its weights' dtype, x as the solver
    keeps it."""
    return CacheLayout(*sizes, est.proj_out.weight.dtype, x.dtype, x.device)


def _guided(mu: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """As ``CausalCFM.forward``: rows [0, b) conditioned, [b, 2b) their unconditioned twins (zeros), in
    spks' dtype: mu, cond [B,80,T] -> [2B,80,T]; spks [B,80] -> [2B,80]."""
    mu_in = torch.cat([mu, torch.zeros_like(mu)]).to(spks.dtype)
    cond_in = torch.cat([cond, torch.zeros_like(cond)]).to(spks.dtype)
    return mu_in, torch.cat([spks, torch.zeros_like(spks)]), cond_in


class _TokenFlow(nn.Module):
    """Shared inference path; subclasses own the modules (in state-dict order) and ``_encode``."""

    input_embedding: nn.Embedding
    spk_embed_affine_layer: nn.Linear
    decoder: CausalCFM
    pre_lookahead_len: int
    token_mel_ratio: int

    def _encode(self, emb: Tensor, lens: Tensor, context_len: int, streaming: bool) -> Tensor:
        """Token embeddings [B,T,C] -> mu frames [B, ratio*(T-context_len), 80]."""
        raise NotImplementedError

    @torch.inference_mode()
    def prepare(self, batch: FlowBatch, streaming: bool, finalize: bool) -> CfmInputs:
        """Everything before the solver (the reference's flow.inference up to ``self.decoder(...)``)."""
        spks = self.spk_embed_affine_layer(F.normalize(batch.embedding, dim=1))
        tokens, lens = _join_rows(batch.prompt_token, batch.prompt_token_len, batch.token, batch.token_len)
        context_len = 0 if finalize else self.pre_lookahead_len
        if int(lens.min()) <= context_len:
            raise ValueError(
                f"flow: every row needs more than {context_len} tokens, got lengths {lens.tolist()}"
            )
        valid = pad_mask(lens, tokens.size(1)).unsqueeze(-1).to(spks.dtype)
        emb = self.input_embedding(torch.clamp(tokens, min=0)) * valid
        mu = self._encode(emb, lens, context_len, streaming).transpose(1, 2).contiguous()
        total = (lens - context_len) * self.token_mel_ratio
        feat_len, prompt_feat = batch.prompt_feat_len.to(total.device), batch.prompt_feat
        if bool((feat_len > total).any()) or bool((feat_len > prompt_feat.size(1)).any()):
            raise ValueError(f"flow: prompt_feat_len {feat_len.tolist()} exceeds the frames {total.tolist()}")
        width = int(feat_len.max())
        frames = pad_mask(feat_len, width).unsqueeze(-1).to(mu.dtype)
        cond = torch.zeros_like(mu)
        cond[:, :, :width] = (prompt_feat[:, :width].to(mu.dtype) * frames).transpose(1, 2)
        mask = pad_mask(total, mu.size(2)).unsqueeze(1).to(mu.dtype)
        return CfmInputs(mu, mask, spks, cond, feat_len, total)

    @torch.inference_mode()
    def inference(
        self,
        batch: FlowBatch,
        streaming: bool,
        finalize: bool,
        caches: Sequence[DiTCache | PagedCache] | None = None,
    ) -> Tensor:
        """-> generated mel [B,80,T_gen] float32, prompt frames cut; rows shorter than the longest are
        zero-padded on the right (their lengths: ``mel_lengths``). ``caches`` (streaming, non-final, one
        per row): reuse and extend each row's finished frames; the frames before a row's cache come back
        as zeros (``CausalCFM.forward_cached``)."""
        inputs = self.prepare(batch, streaming, finalize)
        if caches is None:
            feat = self.decoder(inputs, streaming)
        elif streaming and not finalize and len(caches) == inputs.mu.size(0):
            feat = self.decoder.forward_cached(inputs, caches)
        else:
            raise ValueError("frame reuse needs streaming non-final calls and one cache per row")
        return _cut_rows(feat, inputs.prompt_frames, inputs.total_frames)

    def mel_lengths(
        self, token_len: Tensor, prompt_token_len: Tensor, prompt_feat_len: Tensor, finalize: bool
    ) -> Tensor:
        """Generated frames per row: ratio * (P + N - context) - prompt frames."""
        context_len = 0 if finalize else self.pre_lookahead_len
        return (prompt_token_len + token_len - context_len) * self.token_mel_ratio - prompt_feat_len


def _join_rows(prompt: Tensor, prompt_len: Tensor, token: Tensor, token_len: Tensor) -> tuple[Tensor, Tensor]:
    """Per row prompt[:p] ‖ token[:n], right-padded with 0 -> ([B, max(p+n)], [B])."""
    lens = (prompt_len + token_len).to(token.device)
    if prompt.size(0) == 1 and int(prompt_len) == prompt.size(1) and int(token_len) == token.size(1):
        return torch.cat([prompt, token], dim=1), lens
    out = token.new_zeros(token.size(0), int(lens.max()))
    for row, (p, n) in enumerate(zip(prompt_len.tolist(), token_len.tolist())):
        out[row, :p], out[row, p : p + n] = prompt[row, :p], token[row, :n]
    return out, lens


def _cut_rows(feat: Tensor, start: Tensor, stop: Tensor) -> Tensor:
    """feat [B,80,T] -> rows' frames [start, stop) moved to the front, zero-padded to the longest."""
    if feat.size(0) == 1:
        return feat[:, :, int(start) : int(stop)]
    width = int((stop - start).max())
    out = feat.new_zeros(feat.size(0), feat.size(1), width)
    for row, (a, b) in enumerate(zip(start.tolist(), stop.tolist())):
        out[row, :, : b - a] = feat[row, :, a:b]
    return out


@dataclass(frozen=True)
class CosyVoice2FlowConfig:
    """``CausalMaskedDiffWithXvec``. Defaults: the released CosyVoice2-0.5B flow (§2.6)."""

    vocab_size: int = 6561
    input_size: int = 512
    output_size: int = MEL_DIM
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: UNetConfig = field(default_factory=UNetConfig)
    cfm: CfmConfig = field(default_factory=CfmConfig)

    def __post_init__(self) -> None:
        _check_common(self.output_size, self.vocab_size, self.spk_embed_dim, self.estimator.in_channels)
        mine = (self.input_size, self.token_mel_ratio, self.pre_lookahead_len)
        if mine != (self.encoder.input_size, self.encoder.up_stride, self.encoder.pre_lookahead_len):
            raise ValueError(
                f"flow (input_size, token_mel_ratio, pre_lookahead_len) {mine} vs {self.encoder}"
            )

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> CosyVoice2FlowConfig:
        expect_tag(node, "CausalMaskedDiffWithXvec")
        decoder = yaml_field(node, "decoder")
        return cls(
            **_top_fields(node),
            encoder=EncoderConfig.from_yaml(yaml_field(node, "encoder")),
            estimator=UNetConfig.from_yaml(yaml_field(decoder, "estimator")),
            cfm=CfmConfig.from_yaml(decoder),
        )


@dataclass(frozen=True)
class CosyVoice3FlowConfig:
    """``CausalMaskedDiffWithDiT``. Defaults: the released Fun-CosyVoice3-0.5B flow (§2.7)."""

    vocab_size: int = 6561
    input_size: int = MEL_DIM
    output_size: int = MEL_DIM
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    estimator: DiTConfig = field(default_factory=DiTConfig)
    cfm: CfmConfig = field(default_factory=CfmConfig)

    def __post_init__(self) -> None:
        est = self.estimator
        _check_common(
            self.output_size, self.vocab_size, self.spk_embed_dim, 2 * est.mel_dim + est.mu_dim + est.spk_dim
        )
        if self.input_size != est.mu_dim or self.pre_lookahead_channels < 1 or self.token_mel_ratio < 1:
            raise ValueError(f"bad CosyVoice3FlowConfig (mu = pre-lookahead output, input_size wide): {self}")

    @classmethod
    def from_yaml(cls, node: dict[str, Any]) -> CosyVoice3FlowConfig:
        expect_tag(node, "CausalMaskedDiffWithDiT")
        decoder, pre = yaml_field(node, "decoder"), yaml_field(node, "pre_lookahead_layer")
        expect_tag(pre, "PreLookaheadLayer")
        top = _top_fields(node)
        pre_io = (int(yaml_field(pre, "in_channels")), int(yaml_field(pre, "pre_lookahead_len")))
        if pre_io != (top["input_size"], top["pre_lookahead_len"]):
            raise ValueError(f"flow yaml: pre_lookahead_layer {pre} disagrees with the flow node")
        return cls(
            **top,
            pre_lookahead_channels=int(yaml_field(pre, "channels")),
            estimator=DiTConfig.from_yaml(yaml_field(decoder, "estimator")),
            cfm=CfmConfig.from_yaml(decoder),
        )


_TOP_KEYS = (
    "vocab_size",
    "input_size",
    "output_size",
    "spk_embed_dim",
    "token_mel_ratio",
    "pre_lookahead_len",
)


def _top_fields(node: dict[str, Any]) -> dict[str, int]:
    return {k: int(yaml_field(node, k)) for k in _TOP_KEYS}


def _check_common(output_size: int, vocab_size: int, spk_embed_dim: int, estimator_in: int) -> None:
    if output_size != MEL_DIM:
        raise ValueError(f"flow output_size must be {MEL_DIM} (the CFM hard-codes it), got {output_size}")
    if vocab_size < 1 or spk_embed_dim < 1:
        raise ValueError(f"vocab_size and spk_embed_dim must be >= 1, got {vocab_size}, {spk_embed_dim}")
    if estimator_in != 4 * MEL_DIM:
        raise ValueError(f"estimator input must be x ‖ mu ‖ spks ‖ cond = {4 * MEL_DIM}, got {estimator_in}")


class CosyVoice2Flow(_TokenFlow):
    def __init__(self, cfg: CosyVoice2FlowConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or CosyVoice2FlowConfig()
        self.pre_lookahead_len, self.token_mel_ratio = cfg.pre_lookahead_len, cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalCFM(cfg.cfm, CausalConditionalDecoder(cfg.estimator))

    def _encode(self, emb: Tensor, lens: Tensor, context_len: int, streaming: bool) -> Tensor:
        h, _ = self.encoder(emb, lens, context_len, streaming)
        return self.encoder_proj(h)


class CosyVoice3Flow(_TokenFlow):
    def __init__(self, cfg: CosyVoice3FlowConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or CosyVoice3FlowConfig()
        self.pre_lookahead_len, self.token_mel_ratio = cfg.pre_lookahead_len, cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(
            cfg.input_size, cfg.pre_lookahead_channels, cfg.pre_lookahead_len
        )
        self.decoder = CausalCFM(cfg.cfm, DiT(cfg.estimator))

    def _encode(self, emb: Tensor, lens: Tensor, context_len: int, streaming: bool) -> Tensor:
        h = self.pre_lookahead_layer(emb, lens)[:, : emb.size(1) - context_len]
        return h.repeat_interleave(self.token_mel_ratio, dim=1)


Flow = CosyVoice2Flow | CosyVoice3Flow


def build_flow(node: dict[str, Any]) -> Flow:
    """The yaml ``flow`` node (engine.yaml_data.read_yaml(...)["flow"]) -> an uninitialised flow module."""
    tag = tag_of(node)
    if tag == "CausalMaskedDiffWithXvec":
        return CosyVoice2Flow(CosyVoice2FlowConfig.from_yaml(node))
    if tag == "CausalMaskedDiffWithDiT":
        return CosyVoice3Flow(CosyVoice3FlowConfig.from_yaml(node))
    raise ValueError(f"flow yaml: unsupported flow class {node.get('__tag__')!r} (CosyVoice2/3 only)")
