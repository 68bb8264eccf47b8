"""Engine configuration: frozen dataclasses checked in ``__post_init__``; defaults = the released models."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
DEMO_TINY = "demo-tiny"  # --model: a tiny random-weight model built offline (engine.demo); its audio is noise
BACKENDS = ("auto", "native", "vllm")
DEVICES = ("auto", "cpu", "cuda", "npu")
LLM_VARIANTS = ("base", "rl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
FLOW_ATTENTION = ("mask", "folded", "cudnn")  # EngineConfig.flow_attention
# flow reuse's memory when ``EngineConfig.flow_reuse_gb`` is None: the eager solver's budget (GiB), and the
# share of the device memory free after vLLM's start that the CUDA-graph solver's page pool takes (on the
# H200 with vLLM at 0.3: ~38 GB, ~420 pages of 90 MB, 11 pages for a 10 s stream after a 3.5 s prompt)
EAGER_REUSE_GB = 4.0
AUTO_POOL_SHARE = 0.4


@dataclass(frozen=True)
class SamplingConfig:
    """RAS sampler (cosyvoice yaml ``ras_sampling``) and the token-length ratios of the LM."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10  # tokens of history the repetition check looks at
    tau_r: float = 0.1  # repetition threshold as a fraction of win_size
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 1 or self.win_size < 1:
            raise ValueError("top_k and win_size must be >= 1")
        if not 0.0 < self.tau_r <= 1.0:
            raise ValueError(f"tau_r must be in (0, 1], got {self.tau_r}")
        if not 0 <= self.min_token_text_ratio <= self.max_token_text_ratio:
            raise ValueError("need 0 <= min_token_text_ratio <= max_token_text_ratio")


@dataclass(frozen=True)
class StreamConfig:
    """Chunk schedule of CosyVoice2/3 streaming (cli/model.py): hop 25 tokens doubling to 100."""

    token_hop: int = 25  # must equal the flow's training static_chunk_size (tokens)
    max_token_hop: int = 100
    hop_growth: int = 2
    lookahead: int = 3  # flow pre_lookahead_len (tokens)
    mel_cache_frames: int = 8  # v2 vocoder cache (frames)
    source_cache_samples: int = 3840  # v2 vocoder source cache (samples) = 8 frames x 480
    # Split the reference's first chunk (hop + pad tokens) at the chunk grid into pad tokens, then hop,
    # when pad >= min_first_hop; every later boundary is unchanged, so the first audio needs `hop` fewer
    # LM tokens. v3's flow and HiFT are causal, so its audio is the same sample for sample; v2 moves one
    # vocoder seam. The extra chunk costs one more flow + HiFT pass and leaves a thin first buffer, so
    # None (auto) splits only while few requests start at once (fast_start_burst_s), v2's too since its
    # A/B with the first-chunk lane (both on against both off, one load, v2 at 1 request/s, H100): TTFA
    # p95 296 / 291 ms against 329 / 312 (two seeds; 324 against 374 on another H100), 0 underrun.
    # On a GPU with the bf16 flow it cut the 1-stream TTFA by about a third, RTF unchanged; with the fp32
    # solver the split-off first flow call was once seen to take ~1.4 s (BENCHMARKS.md), so use "off" with
    # --flow-dtype float32 on a GPU.
    fast_start: bool | None = None
    # tokens (0.48 s of speech): the least grid offset (pad) that splits. Offsets are the prompt's length
    # modulo the chunk, so where prompts' lengths fall anywhere 13 of 25 offsets split and the rest keep the
    # reference's 25-36-token first chunk; the bench's 3.5-s prompt has offset 13 (bench --prompt-spread
    # gives every offset; --ab short-split: 8)
    min_first_hop: int = 12
    # tokens: at most this many cut from the start of the FLOW's prompt (the LM keeps it whole, as the
    # reference's cross-lingual mode gives the flow a prompt the LM does not see) where a split first chunk
    # would otherwise fall short of min_first_hop: the cut moves the prompt's end to an offset of exactly
    # min_first_hop, so every prompt length gets the fast start. The flow then clones from a prompt up to
    # 0.48 s shorter: exact for that shorter prompt, not the reference's audio for the visitor's whole one.
    # 0 (off, the default) until its A/B (bench --ab prompt-trim, with --prompt-spread)
    fast_start_trim: int = 0
    # auto: at most this many requests started within fast_start_burst_s (or, without it, compute), this
    # one included. 4 against 2 in one load (H100, v3, 3 requests/s Poisson, two seeds; two arms equal to 2
    # ran, so the noise is seen): 75-78 % of first chunks split against 48-52 %, TTFA p50 163-170 ms against
    # 194-217, p95 292-303 against 292-333, 0 underrun (BENCHMARKS.md, capacity-wide-start-803867a). Most
    # first chunks left unsplit start while 8 or more compute (fast_start_busy)
    fast_start_max_active: int = 4
    # auto's load rule (None: count the requests computing instead, fast_start_max_active at most): count
    # the requests that started within this many seconds (this one included) and split while the engine is
    # below adaptive_min_active. The split's thin first buffer is at risk when first chunks coincide (a wave
    # crowds the flow with them); streams that started earlier are past their first chunk. Under random
    # arrivals most requests then get the split, where counting those computing gave most of them the
    # reference's 41-token first chunk from a few requests/s on. 0.5 s: about a split first chunk's audio
    # (12 tokens, 0.48 s). Its A/B is bench --ab burst-start (BENCHMARKS "Open loop": capacity up a step).
    fast_start_burst_s: float | None = 0.5
    # auto's burst rule also while adaptive_min_active or more requests compute (False: the reference's first
    # chunk then, as its thin first buffer shares a busier flow). Its A/B (bench --ab busy-start, one load,
    # H100, v3, 3 requests/s Poisson, two seeds): TTFA p95 262 / 254 ms against 295 / 286, first chunks left
    # unsplit 16-31 of 360 against 81-83, 0 underrun either way (BENCHMARKS.md,
    # capacity-busy-start-first-lane-d20012e)
    fast_start_busy: bool = True
    # Adaptive hops (serving.streaming.ChunkPlanner): while a stream's client has hold_buffer_s of audio
    # buffered, its next chunk waits to span more of the reference's chunks, up to max_adaptive_hop tokens:
    # fewer, larger flow calls under load. Exact for v3 (chunks end on the reference's boundaries; CPU test
    # on the tiny model); v2's vocoder seams would move, so None (auto) adapts only v3 streams that start
    # while at least adaptive_min_active requests compute.
    adaptive_hop: bool | None = None
    adaptive_min_active: int = 8
    hold_buffer_s: float = 3.0
    max_adaptive_hop: int = 200  # tokens (8 s of speech)
    # token2wav scheduling (serving.job_queue): a chunk whose audio is needed within this many seconds is
    # urgent and joins the next batch even when it makes that flow call longer
    urgent_slack_s: float = 0.3
    # a chunk whose client has more than relaxed_slack_s of audio buffered is relaxed: it joins a batch only
    # while the call stays within about relaxed_call_s at the speed the worker measured (serving.call_cost).
    # A flow call cannot be preempted, so a first chunk (a TTFA) queued meanwhile waits at most that long
    # behind work nobody needs yet; the relaxed chunks go in the next calls (EngineConfig.t2w_relaxed_cap)
    relaxed_slack_s: float = 2.0
    relaxed_call_s: float = 0.2

    def __post_init__(self) -> None:
        if not 1 <= self.token_hop <= self.max_token_hop:
            raise ValueError("need 1 <= token_hop <= max_token_hop")
        if self.hop_growth < 1 or self.lookahead < 0:
            raise ValueError("hop_growth must be >= 1 and lookahead >= 0")
        if self.fast_start not in (None, True, False):
            raise ValueError(f"fast_start must be None (auto), True or False, got {self.fast_start!r}")
        if self.fast_start_max_active < 1:
            raise ValueError("fast_start_max_active must be >= 1")
        if not isinstance(self.fast_start_busy, bool):
            raise ValueError(f"fast_start_busy must be True or False, got {self.fast_start_busy!r}")
        if self.fast_start_burst_s is not None and not 0.0 < self.fast_start_burst_s <= 60.0:
            raise ValueError(f"fast_start_burst_s must be in (0, 60] s or None: {self.fast_start_burst_s}")
        if not 5 <= self.min_first_hop < self.token_hop:
            raise ValueError("need 5 <= min_first_hop < token_hop (v3 holds back 4 tokens of each chunk)")
        if not 0 <= self.fast_start_trim <= self.min_first_hop:
            raise ValueError(f"need 0 <= fast_start_trim <= min_first_hop, got {self.fast_start_trim}")
        if self.adaptive_hop not in (None, True, False):
            raise ValueError(f"adaptive_hop must be None (auto), True or False, got {self.adaptive_hop!r}")
        if self.adaptive_min_active < 1 or self.hold_buffer_s < 0 or self.urgent_slack_s < 0:
            raise ValueError("need adaptive_min_active >= 1, hold_buffer_s >= 0 and urgent_slack_s >= 0")
        if self.relaxed_slack_s < self.urgent_slack_s or self.relaxed_call_s <= 0:
            raise ValueError("need relaxed_slack_s >= urgent_slack_s and relaxed_call_s > 0")
        if self.max_adaptive_hop < self.max_token_hop:
            raise ValueError("max_adaptive_hop must be >= max_token_hop (it merges whole reference chunks)")

    def splits_first_chunk(self, active: int, recent: int | None = None) -> bool:
        """Whether a request that starts with ``active`` requests computing (itself included) gets the
        split first chunk: as set, or in auto while the engine is lightly loaded; with
        ``fast_start_burst_s``, while at most ``fast_start_max_active`` requests started within it
        (``recent``, itself included) and fewer than ``adaptive_min_active`` compute (or however many do,
        with ``fast_start_busy``)."""
        if self.fast_start is not None:
            return self.fast_start
        if self.fast_start_burst_s is None or recent is None:
            return active <= self.fast_start_max_active
        calm = self.fast_start_busy or active < self.adaptive_min_active
        return recent <= self.fast_start_max_active and calm

    def flow_prompt_cut(self, prompt_tokens: int) -> int:
        """Tokens to cut from the start of the flow's prompt (``fast_start_trim``): the least that brings
        its grid offset up to ``min_first_hop`` where this schedule splits (``fast_start`` resolved on),
        the offset is shorter and at least one chunk of prompt is left; else 0."""
        pad = -prompt_tokens % self.token_hop
        cut = self.min_first_hop - pad
        if not self.fast_start or not 0 < cut <= self.fast_start_trim:
            return 0
        return cut if prompt_tokens - cut >= self.token_hop else 0

    def adapts_hops(self, family: str, active: int) -> bool:
        """Whether a request that starts with ``active`` requests computing gets adaptive hops: as set, or
        in auto for v3 under load."""
        if self.adaptive_hop is not None:
            return self.adaptive_hop
        return family == "cosyvoice3" and active >= self.adaptive_min_active


FAST_START_CHOICES = ("auto", "on", "off")


def fast_start_choice(choice: str) -> bool | None:
    """A ``--fast-start auto|on|off`` flag -> ``StreamConfig.fast_start``."""
    if choice not in FAST_START_CHOICES:
        raise ValueError(f"fast start must be one of {FAST_START_CHOICES}, got {choice!r}")
    return {"auto": None, "on": True, "off": False}[choice]


def fast_start_flag(value: bool | None) -> str:
    """``StreamConfig.fast_start`` -> its ``--fast-start`` flag (the CLIs' default comes from the config)."""
    return {None: "auto", True: "on", False: "off"}[value]


Flags = argparse._ActionsContainer  # a parser or one of its argument groups (the server's --help groups)
MODEL_HELP = "local model dir, ModelScope / Hugging Face id, or 'demo-tiny' (offline, random weights)"


def add_model_flag(parser: Any, default: str | None = DEFAULT_MODEL, text: str = MODEL_HELP) -> None:
    """``--model`` -> ``args.model``; ``parser`` may be a mutually exclusive group (the bench's)."""
    parser.add_argument("--model", default=default, help=text)


def add_device_flags(parser: Flags, device: str = "auto", llm_variant: bool = False) -> None:
    """``--device`` and ``--backend`` (``EngineConfig.device`` / ``.backend``), with ``--llm-variant`` on
    request; ``device`` is the default (the server reads it from COSYSTREAM_DEVICE)."""
    parser.add_argument("--device", choices=DEVICES, default=device, help="auto: CUDA, then NPU, then CPU")
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="speech LM backend (auto: vllm on GPU)"
    )
    if llm_variant:
        parser.add_argument(
            "--llm-variant", choices=LLM_VARIANTS, default="base", help="rl: use llm.rl.pt if present"
        )


def add_fast_start_flag(parser: Flags) -> None:
    """``--fast-start auto|on|off`` -> ``args.fast_start`` (``fast_start_choice`` makes the config value)."""
    busy = StreamConfig.fast_start_busy  # the burst rule however many compute, or only below adaptive hops
    calm = "" if busy else f" and fewer than {StreamConfig.adaptive_min_active} compute"
    parser.add_argument(
        "--fast-start", choices=FAST_START_CHOICES, default=fast_start_flag(StreamConfig.fast_start),
        help="split the first stream chunk at the chunk grid (auto: while at most "
        f"{StreamConfig.fast_start_max_active} requests started in {StreamConfig.fast_start_burst_s:g} s"
        f"{calm})",
    )  # fmt: skip
    parser.add_argument(
        "--fast-start-trim", type=int, default=StreamConfig.fast_start_trim, metavar="TOKENS",
        help="where the first chunk's grid offset is too short to split, cut up to this many speech tokens "
        f"(at most {StreamConfig.min_first_hop}) from the start of the flow's prompt so it splits: the "
        "voice cloned from a prompt up to 0.48 s shorter (0: never, the reference's audio)",
    )  # fmt: skip


def add_flow_compile_flags(parser: Flags) -> None:
    """``--flow-compile`` / ``--no-flow-compile`` -> ``args.flow_compile`` (None when neither: auto)."""
    _add_auto_flags(
        parser, "flow-compile", "GPU: compile the flow estimator with TorchInductor (default: v3 only)",
        "GPU: run the flow estimator eagerly inside its CUDA graphs (no torch.compile)",
    )  # fmt: skip


def add_first_lane_flags(parser: Flags) -> None:
    """``--t2w-first-lane`` / ``--no-t2w-first-lane`` -> ``args.t2w_first_lane`` (None when neither: auto)."""
    _add_auto_flags(
        parser, "t2w-first-lane", "a second token2wav worker for streaming requests' first chunks, with its "
        "own stream and graphs (default: on a GPU whose flow solver has graphs; this: also the CPU)",
        "one token2wav worker for every chunk (no first-chunk lane)",
    )  # fmt: skip


def add_lm_handover_flags(parser: Flags) -> None:
    """``--lm-handover`` / ``--no-lm-handover`` -> ``args.lm_handover`` (None when neither: auto)."""
    _add_auto_flags(
        parser, "lm-handover", "with vLLM: serve on the native LM loop while vLLM starts, then hand over to "
        "it (default: on where --lm-kv-cache-gib fixes vLLM's KV cache)",
        "with vLLM: ready only once vLLM is up",
    )  # fmt: skip


def add_flow_aot_flag(parser: Flags) -> None:
    """``--flow-aot`` -> ``args.flow_aot`` (``EngineConfig.flow_aot``)."""
    parser.add_argument(
        "--flow-aot", action="store_true",
        help="GPU, with the flow compile: build its programs ahead of time in a child process (AOTInductor) "
        "and load them from the cache root, instead of torch.compile in the serving process",
    )  # fmt: skip


# the on/off options: ``--FLAG`` / ``--no-FLAG`` -> EngineConfig's field, and the flag's help
SWITCHES: dict[str, tuple[str, str]] = {
    "flow-precompiled": (
        "flow_precompiled",
        "GPU, where torch.compile compiles the flow (not --flow-aot): keep its programs whole under the "
        "cache root and load them there on the next start, no Dynamo trace, no AOTAutograd (default: on)",
    ),
    "flow-compile-child": (
        "flow_compile_child",
        "GPU: a flow program the cache root lacks (a cold start) is compiled by a child process with an "
        "interpreter of its own, not in the serving process beside its requests (default: off)",
    ),
    "flow-step-graphs": (
        "flow_step_graphs",
        "CUDA: capture one flow solver step per graph and replay it once a step, not the whole solve: "
        "a tenth of each capture's work at start-up, the same audio (default: on)",
    ),
    "native-lm-graphs": (
        "lm_native_graphs",
        "CUDA: the native LM loop decodes a lone request from one CUDA graph (the requests served "
        "while vLLM starts, or all where vLLM is absent; default: on)",
    ),
    "lm-fork-server": (
        "lm_fork_server",
        "with vLLM: fork its engine core from a process started first thing that has imported vLLM, "
        "instead of spawning one that imports it again (default: on)",
    ),
    "lm-start-after-ready": (
        "lm_start_after_ready",
        "with the LM handover: start vLLM once the engine is ready (the native loop serves until it is "
        "up), not beside the weights, the first graphs and the studio's import (default: off)",
    ),
    "lm-host": (
        "lm_host",
        "with vLLM: run its client (vLLM's import, its engine arguments, each step's input and output "
        "processing) in a process of its own, so this one never imports vLLM (default: off)",
    ),
    "single-stream-graphs-at-load": (
        "single_stream_graphs_at_load",
        "CUDA, with background graphs: capture every single-stream flow and vocoder graph before ready, so a "
        "lone request replays its own bucket from the first one, not the widest padded (default: off)",
    ),
    "flow-voice-pages": (
        "flow_voice_pages",
        "CUDA graphs with flow reuse: keep each voice's prompt frames (its complete chunks before the first "
        "speech token's look-ahead) in the page pool across its requests, so a later request's first flow "
        "call skips them; exact (default: off)",
    ),
    "t2w-own-stream": (
        "t2w_own_stream",
        "CUDA: the token2wav worker's calls on a stream of their own, so a new request's prompt embeddings "
        "and copies on the default stream never wait for them (default: on)",
    ),
    "lm-host-prefix": (
        "lm_host_prefix",
        "a request's LM prompt embeddings gathered from a host copy of the LM's embedding tables (~0.3 GB "
        "of host memory at full size) on the event loop, not looked up on the device and copied back "
        "(default: on)",
    ),
    "t2w-prompt-in-frontend": (
        "t2w_prompt_in_frontend",
        "a request's flow prompt tensors copied to the device in the frontend's thread, after its prompt "
        "features, not on the event loop as its audio starts (default: off)",
    ),
    "weights-onto-device": (
        "weights_onto_device",
        "GPU/NPU, warm: read the cached safetensors weights onto the device through one page-locked "
        "buffer, instead of memory-mapping them and copying tensor by tensor (default: on)",
    ),
}


def add_switch(parser: Flags, flag: str) -> None:
    """``--FLAG`` / ``--no-FLAG`` of ``SWITCHES`` -> ``args.FLAG`` (dashes as underscores), EngineConfig's
    default when neither is given; the last given wins, so an A/B can add the other one to a command."""
    field, help = SWITCHES[flag]
    default = getattr(EngineConfig, field)
    parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=default, help=help)


# numeric flags the server and the bench share: flag -> (EngineConfig field, type, help)
NUMBERS: dict[str, tuple[str, type, str]] = {
    "gil-switch-ms": (
        "gil_switch_ms",
        float,
        "the interpreter's switch interval while the engine serves (ms): how long a thread waits for the GIL "
        "before its holder is asked to drop it (default: Python's own, 5 ms)",
    ),
    "t2w-kept-prompts": (
        "t2w_kept_prompts",
        int,
        "voices whose prompt tensors stay on the device for their next requests (0: none, each request "
        "copies its own)",
    ),
}


def add_number(parser: Flags, flag: str) -> None:
    """``--FLAG N`` of ``NUMBERS`` -> ``args.FLAG`` (dashes as underscores), EngineConfig's default."""
    field, kind, help = NUMBERS[flag]
    parser.add_argument(f"--{flag}", type=kind, default=getattr(EngineConfig, field), help=help)


def add_flow_attention_flag(parser: Flags) -> None:
    """``--flow-attention`` -> ``args.flow_attention`` (``EngineConfig.flow_attention``)."""
    parser.add_argument(
        "--flow-attention", choices=FLOW_ATTENTION, default=EngineConfig.flow_attention,
        help="flow estimators' attention: a dense mask (as the reference), folded into q/k dims, or "
        "(CUDA) the dense mask with cuDNN's kernel tried first",
    )  # fmt: skip


def add_flow_reuse_flags(parser: Flags) -> None:
    """``--flow-reuse`` / ``--no-flow-reuse`` -> ``args.flow_reuse`` (None when neither: auto)."""
    _add_auto_flags(
        parser, "flow-reuse", "reuse each stream's finished flow frames (default: on, but v2's CUDA graphs)",
        "recompute each stream's whole prefix in every streaming flow call (no frame reuse)",
    )  # fmt: skip


def add_overlap_flags(parser: Flags) -> None:
    """``--cuda-mps``, ``--mps-flow-percent``, ``--mps-flow-below-normal`` -> ``args.cuda_mps``,
    ``.mps_flow_percent``, ``.mps_flow_below_normal`` (EngineConfig)."""
    _add_auto_flags(
        parser, "cuda-mps",
        "CUDA: run this process and vLLM's engine core under a CUDA MPS daemon the engine starts and stops "
        "(pipe and log under the cache root; needs nvidia-cuda-mps-control on PATH); default auto: on where "
        "the LM runs on vLLM on CUDA and the daemon starts, else off",
        "CUDA: no MPS daemon; this process and vLLM's engine core share the GPU in time slices",
    )  # fmt: skip
    parser.add_argument(
        "--mps-flow-percent", type=int, default=None, metavar="PERCENT",
        help="under MPS: the share of SMs this process's flow and vocoder may fill (the LM: all; "
        "default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--mps-flow-below-normal", action="store_true",
        help="under MPS: this process's flow and vocoder at below-normal client priority, vLLM's LM at "
        "normal, so the LM's steps go first where both have work (default: both normal)",
    )  # fmt: skip


def _add_auto_flags(parser: Flags, name: str, on: str, off: str) -> None:
    """``--NAME`` (True) / ``--no-NAME`` (False), exclusive, into one dest that stays None (auto) unset."""
    group, dest = parser.add_mutually_exclusive_group(), name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None, help=on)
    group.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False, help=off)


@dataclass(frozen=True)
class Limits:
    """Everything a caller can exceed, in one place (UI and API map these to messages / status codes)."""

    max_text_chars: int = 2000
    max_prompt_s: float = 30.0
    min_prompt_s: float = 1.0
    max_upload_bytes: int = 20 * 1024 * 1024
    max_concurrency: int = 16  # streams computing at once
    max_queue: int = 64  # requests waiting for a slot
    request_timeout_s: float = 300.0
    text_idle_s: float = 30.0  # a text-streaming request fails when no piece comes for this long
    # an HTTP request body: each piece within this many seconds of the last (the whole within 30 times
    # it), else 408 and the connection closed
    body_timeout_s: float = 10.0
    # benchmarks over HTTP: the API takes ``forced_tokens`` (a fixed speech length, end-of-speech ignored)
    # so every request costs the same; off by default, as it lets a short text ask for 120 s of audio
    forced_tokens: bool = False
    # admission by SLO: refuse a new request (429, Retry-After from the load) while a running stream's next
    # chunk has this little playback slack (s) left; None: admit on slots alone
    admit_slack_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_text_chars < 1 or self.max_upload_bytes < 1:
            raise ValueError("max_text_chars and max_upload_bytes must be positive")
        if not 0 < self.min_prompt_s < self.max_prompt_s <= 30.0:
            raise ValueError("need 0 < min_prompt_s < max_prompt_s <= 30 (the speech tokenizer's limit)")
        if self.max_concurrency < 1 or self.max_queue < 0 or self.request_timeout_s <= 0:
            raise ValueError("max_concurrency >= 1, max_queue >= 0, request_timeout_s > 0 required")
        if self.text_idle_s <= 0:
            raise ValueError(f"text_idle_s must be > 0, got {self.text_idle_s}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.admit_slack_s is not None and not 0 <= self.admit_slack_s <= 10:
            raise ValueError(f"admit_slack_s must be within [0, 10] s or None, got {self.admit_slack_s}")


@dataclass(frozen=True)
class EngineConfig:
    """How to build a ``TTSEngine``: which checkpoint, where, with what backend and precision."""

    model: str = DEFAULT_MODEL  # local dir, ModelScope id, Hugging Face id, or "demo-tiny"
    device: str = "auto"
    backend: str = "auto"  # vllm where vLLM and CUDA/NPU are present, else native
    dtype: str = "auto"  # LM/flow compute dtype; auto = bf16 LM on GPU, fp32 on CPU
    llm_variant: str = "base"  # "rl" loads llm.rl.pt when present
    cache_dir: str | None = None
    voices_dir: str | None = None
    examples_dir: str | None = None  # example voices (name.wav + name.txt); None: the repo's assets/voices
    # Whisper for prompt transcription: "auto" (large-v3-turbo on a GPU, small on CPU), a Hugging Face id
    # or a local dir, "none" (the library default; app.py and the CLI default to "auto")
    asr_model: str = "none"
    gpu_memory_utilization: float = 0.3
    # vLLM's KV cache at a fixed size (GiB) instead of what gpu_memory_utilization leaves after vLLM has
    # profiled the device's memory: no profiling, so the first graphs may be captured beside its start
    # (vLLM 0.26 stops with an assertion if the free memory grows while it profiles; first_graphs_early).
    # The 0.5B LMs take 12 KiB a token: 6 GiB hold 128 streams of 4096 tokens (max_num_seqs x max_model_len).
    # None: sized by vLLM from gpu_memory_utilization (40 GiB on the H200), and the first graphs after it
    lm_kv_cache_gib: float | None = 6.0
    # vLLM's torch profiler (its engine core's steps, kernels by device time: profiler_out_0.txt) writes
    # here between the LM backend's start_profile and stop_profile (bench.overlap --lm-profile); None: off
    lm_profile_dir: str | None = None
    # vLLM's per-step RAS (our logits processor) replayed from a graph per batch bucket (CUDA), not ~40
    # kernels launched one by one after every forward (engine.lm.ras_graphs); False: the eager A/B arm
    lm_ras_graphs: bool = True
    # the native LM loop's lone request decoded from one CUDA graph over a fixed key/value buffer
    # (engine.lm.decode_slot; CUDA only, elsewhere op by op): the first requests of a start (served while
    # vLLM starts) and every request where vLLM is absent. On the H200 the first five requests after a warm
    # ready took 350-636 ms to first audio with it, 238-896 ms without (BENCHMARKS.md, start-up)
    lm_native_graphs: bool = True
    cuda_graphs: bool = True  # replay the flow solver as CUDA graphs at bucketed shapes (CUDA only)
    # also v3's non-final HiFT calls (with cuda_graphs): eager they are launch-bound, about as long whatever
    # the mel's length; replayed they lower TTFA, p95 and device memory (figures: BENCHMARKS.md).
    hift_graphs: bool = True
    # The flow solver's compute dtype on GPU (float32 | bfloat16; the CPU path is always float32). bf16
    # serves about a quarter more audio s/s at 16 streams for ~25 ms more 1-stream TTFA (BENCHMARKS.md);
    # its mel RMS error is 0.7 % of the mel's std against float32 (full-size random weights).
    flow_dtype: str = "bfloat16"
    # how the flow estimators' attention hides what a frame may not see: "mask" (a dense [B,1,T,T] mask,
    # as the reference; SDPA's memory-efficient kernel on the H200) or "folded" (the rule folded into
    # extra q/k dimensions, engine.flow.attention: no mask tensor, so SDPA may pick its flash kernel;
    # the same softmax, equal on CPU) in whole-sequence calls and the CUDA graphs' page windows (the eager
    # solver's reuse windows keep the mask), or "cudnn" (CUDA only: the dense mask, SDPA trying cuDNN's
    # fused attention before its other kernels, process-wide while the engine is open). On the H200 (the
    # solver alone, BENCHMARKS.md) cudnn was within 2 % of the mask and folded 5-29 % slower: mask stays
    flow_attention: str = "mask"
    # With the CUDA graphs: the flow estimator compiled by TorchInductor (fused elementwise chains; one
    # dynamic program for every bucket), kernels kept on disk under cache_dir/compile so a restart reuses
    # them. False = the eager estimator inside the graphs (the A/B; bench --no-flow-compile). None (auto):
    # on for v3 (measured on the H200: BENCHMARKS.md), off for v2: compiled, its U-Net served +13-15 % audio
    # s/s at 16-64 streams there, but 1 stream slower (TTFA 249 -> 280 ms) and a 376 s cold start (118 s
    # eager): worth it for serving many v2 streams (--flow-compile), not for a demo's fresh machine.
    flow_compile: bool | None = None
    # With flow_compile: the compiled programs built ahead of time by AOTInductor in a child process and
    # kept under cache_dir/compile/aot (engine.flow.aot_package), so the serving process traces nothing: a
    # warm start loads them from disk in milliseconds. Off by default: not yet measured on a GPU.
    flow_aot: bool = False
    # Where torch.compile compiles the flow (flow_compile on, or auto's v3; not flow_aot): its programs kept
    # whole under cache_dir/compile/precompiled (guards, graph, Inductor's output; engine.flow.precompiled)
    # and loaded there by the next start, which then neither traces with Dynamo nor runs AOTAutograd. On the
    # H200 a warm start's "flow compile" took 12.9-20.0 s with it (59-66 s traced, with Inductor's cache
    # holding every kernel) and its full speed came at 111-120 s (175-205 s): BENCHMARKS.md, start-up.
    flow_precompiled: bool = True
    # A program flow_precompiled's folder lacks (a cold start) compiled by a child process (its own
    # interpreter, the estimator at random weights: a program holds no weights) while this one only waits
    # on it, then loaded from the folder as a warm start would (engine.flow.compile_child). Why: a cold
    # H100 start compiled the flow's two programs for 338 s in the serving process, beside its first
    # requests (BENCHMARKS.md "Start-up"). Off until measured on a GPU
    flow_compile_child: bool = False
    # Each flow graph holds one solver step, replayed once a step (engine.flow.stepped), instead of the whole
    # 10-step solve: a tenth of a capture's Python work and graph nodes, the same audio to the bit. For the
    # start: the ~110 flow captures ran ~65 s in the serving process after ready on the H200. On an H100 (v3
    # warm, one machine, BENCHMARKS.md "Start-up"): the first graphs 8.8 s instead of 16.6 s, the 20 1-stream
    # flow graphs 1.7 s instead of 15.8 s; equal to the whole-solve graphs' output on CUDA (gpu tests). Not
    # yet measured: the 10 replays a call under load (bench v3 stream 16 with and without)
    flow_step_graphs: bool = True
    # load pre-captures the flow (and v3 HiFT) graphs for mel up to this long (prompt + speech) after vLLM
    # has started; from then on no request captures (longer mel runs uncaptured), so no request's TTFA holds
    # a capture (~1 s for a large flow bucket: the 1-stream p95 of 597 ms on the H200). 16 s at flow_batch
    # 16 = 80 flow + 40 HiFT buckets (load time in BENCHMARKS.md). 0 = capture each bucket on first use.
    graph_warmup_s: float = 16.0
    # of those graphs, load captures the first of each kind (the compiles: the widest mel at batch 1 and at
    # the largest batch) and the engine serves; the rest are captured on a background thread in serving
    # order (engine.graph_builder) while requests replay the smallest captured graph that holds them,
    # padded (engine.graph_cache.GraphCache.covering): the computation their own graph will replay.
    # With flow_compile the first graphs are the eager estimator's and the compile runs first on that thread
    # ("flow compile": > 155 s for the DiT on a fresh H200), its graphs then replacing the eager ones.
    # False = every graph before serving (the load of before: ~2-4 min on a fresh H200)
    background_graphs: bool = True
    # the first graphs captured while vLLM starts in its engine core process (after the weights, beside the
    # core's imports) instead of after it; the pool for frame reuse is then sized from the memory vLLM will
    # leave. The captures allocate and free device memory (each empties torch's cache), and a vLLM that
    # profiles the device's memory stops with an assertion if the free memory grows meanwhile, so the auto
    # default (None) captures early only where it does not profile (lm_kv_cache_gib set) and the rest of the
    # graphs come in the background. On the H200 this takes v3's first graphs (~15 s) off its warm start's
    # path (BENCHMARKS.md "Start-up"). True: early even where vLLM profiles (a race); False: after its start
    first_graphs_early: bool | None = None
    # With background_graphs, every single-stream graph (flow and vocoder, batch 1, each frame bucket) is
    # captured before ready, not only the widest. A warm start's first requests (H200,
    # startup-lm-host-4518c88) replayed the widest graphs padded (a flow call of 200 frames in the
    # 800-frame graph, the vocoder's 100 in 800): their first chunk's flow + vocoder took 131-155 ms against
    # 45-48 steady, while the builder's single-stream graphs came 10-11 s after ready, behind the vocoder's
    # other 30. Costs ready those captures (~1-3 s warm). Not yet measured (bench/gpu/run.sh startup with
    # B_FLAGS="--single-stream-graphs-at-load")
    single_stream_graphs_at_load: bool = False
    # Ready waits up to this long (s) after the warm-up for the graph builder's jobs (the background graphs,
    # the flow's programs), begun then if not before: where what is left is short, a first request meets a
    # steady engine instead of a capture in flight. With ready held for vLLM (no handover) the builder
    # begins in that wait and is mostly done by ready: on two H100s its last captures still ran then, and
    # the first request's frontend took 50-90 ms against 15-25 (startup-pairs-8ba3fcf); on an H200 the
    # bench's own engine had 1.0 s of them left (capacity-steady-spread-44d5d9d). 0: ready at once (the
    # default). Not yet measured (bench/gpu/run.sh startup with B_FLAGS adding --ready-graph-wait-s 5)
    ready_graph_wait_s: float = 0.0
    # Serve within seconds, upgrade in place (engine.lm.handover): where vLLM serves the LM, the native loop
    # serves from the moment the weights are loaded while vLLM starts, then hands new requests over (those in
    # flight finish on it) and is closed. It needs vLLM's KV cache at a fixed size (lm_kv_cache_gib: a vLLM
    # that profiles the device's memory would meet the native loop's KV caches there). None (auto): on
    # wherever vLLM may serve with a fixed KV cache (the default). On H200s (v3 warm, BENCHMARKS.md
    # "Start-up") ready came at 41.9 s with it (and the text workers started first) against 54.3 s without
    # (two machines), the requests before vLLM was up (8 s) taking 340-680 ms on the native loop; alone,
    # at 59.1 s, it gained nothing: the text workers' start then lay on the path. False: ready only once
    # vLLM is up (benchmarks that measure vLLM alone)
    lm_handover: bool | None = None
    # vLLM's engine core forked from a fork server started at launch (server.main, before the web app's
    # imports; else first thing in the load), which imports vLLM there
    # beside this process's start (engine.lm.fork_server), instead of spawned as a fresh interpreter that
    # imports torch, transformers and vLLM again. On an H100 (v3 warm, one machine, BENCHMARKS.md "Start-up")
    # vLLM was up 44.3 s after launch with it and the step graphs, 63.7 s without either. Untested with
    # vllm-ascend on an NPU (--no-lm-fork-server there if its engine core does not start)
    lm_fork_server: bool = True
    # With the handover, vLLM's start (its import and engine arguments in this process: Python, holding the
    # interpreter) waits until the engine is ready instead of running beside the ready path's own Python.
    # Why: alone, an H100 loads v3's weights in 1.1-1.3 s; inside a warm start, beside vLLM's start, 13.6-18.5
    # s (BENCHMARKS.md "Start-up"); the cost: vLLM comes up that much later after ready. Off until measured
    lm_start_after_ready: bool = False
    # vLLM's client (AsyncLLM: its import, engine arguments, each step's input and output processing) in a
    # host process of its own that answers over a Unix socket (engine.lm.lm_host), forked from the fork
    # server with vLLM imported: none of it runs on this process's interpreter. Why: the same as
    # lm_start_after_ready, without holding vLLM back. On an H200 (v3, warm) ready came 2.0-3.9 s sooner with
    # it (BENCHMARKS.md "Start-up", 4518c88); off until its cost under many streams is measured
    lm_host: bool = False
    # a warm start's converted weights (the cache root's safetensors) read onto the GPU/NPU through one
    # page-locked buffer in large chunks (engine.weights_file), not memory-mapped and copied tensor by tensor
    # from faulted-in pages. Alone on an H100 either way takes 1.1-1.3 s (the reader ~0.1 s slower with the
    # page cache warm); what a disk read after a reboot makes of it is not measured
    weights_onto_device: bool = True
    # chunks of different requests run through one flow call (and one v3 HiFT call) up to this many; the
    # graph buckets go up to its power of two. 1 = request by request (the A/B for batching)
    flow_batch: int = 16
    # prompt features (speech tokens, mel, speaker embedding) kept per prompt audio; 0 = recompute for every
    # request (the A/B for the cache; the reference recomputes)
    prompt_cache_size: int = 64
    # the main token2wav worker's calls on a CUDA stream of their own instead of the default stream that
    # request threads use (the LM's prompt embeddings, a new request's prompt tensors): on the default stream
    # a new request's device work waits for the call running, and the event loop with its first copy
    # (BENCHMARKS.md has the A/B). bench --ab own-stream switches it per batch.
    t2w_own_stream: bool = True
    # a request's LM prompt embeddings from a host copy of the LM's embedding tables (engine.lm.prompt_table,
    # ~0.3 GB of host memory at full size in bf16): no device lookups, syncs or copy back before vLLM (which
    # takes them on the host), and no thread hop, where a burst of arrivals waited on the device and the GIL.
    # BENCHMARKS.md has the A/B; bench --ab host-prefix switches it
    lm_host_prefix: bool = True
    # the interpreter's switch interval (ms) while the engine is open (engine.serving.switch_interval): how
    # long a thread waits for the GIL before its holder is asked to drop it; the event loop waits that long
    # after each blocking device call while the token2wav threads run. None: Python's own (5 ms). bench --ab
    # gil-switch tries 1 ms against the engine's; not measured yet
    gil_switch_ms: float | None = None
    # voices whose prompt tensors (speech tokens, mel, speaker embedding) stay on the device for their next
    # requests (engine.serving.kept_prompts): a kept voice's request makes no blocking copy on the event loop,
    # where a burst's copies each waited for the GIL. 0: every request copies its own. bench --ab
    # kept-prompts tries 64 against none; not measured yet
    t2w_kept_prompts: int = 0
    # a request's flow prompt tensors made (blocking copies) in the frontend's thread right after its prompt
    # features, not on the event loop as its audio starts: the loop, which hands every stream its tokens,
    # then never waits on the device or for the GIL after a copy; the request's own wait moves into its
    # frontend. bench --ab prompt-in-frontend tries it against the loop; not measured yet
    t2w_prompt_in_frontend: bool = False
    # CUDA MPS (engine.device.CudaMps): the engine starts its own MPS control daemon (pipe and log under
    # cache_root/mps) before this process or vLLM's engine core initialise CUDA, so the LM's kernels and the
    # flow's run side by side instead of in time slices of two contexts; stopped on close. Never changes the
    # GPU's settings (compute mode). None (auto): on where the LM runs on vLLM (its own process), the device
    # is CUDA and nvidia-cuda-mps-control is on PATH, else off, and a daemon that fails to start leaves it
    # off with a warning; True: on, every failure an error. bench.overlap on an H200: TTFA -19 % at 1 stream
    # and -26 % at 16, RTF -5 to -13 % (BENCHMARKS.md "The LM and the flow on one GPU").
    cuda_mps: bool | None = None
    # with cuda_mps: the share of the GPU's SMs (percent) this process's kernels (flow, HiFT, prompt work)
    # may fill, so the LM's small kernels in vLLM's engine core (which keeps every SM) always find SMs free
    # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for this process's context only); None: every SM
    mps_flow_percent: int | None = None
    # with cuda_mps: this process's context at below-normal MPS client priority (CUDA_MPS_CLIENT_PRIORITY 1,
    # for this context only), vLLM's engine core at normal: where both have kernels ready, the LM's blocks
    # are dispatched first, so its steps (a stream's first tokens among them) wait less behind the flow's
    # calls. Fixed when the contexts are made, so its A/B takes a load per arm (bench/gpu/run.sh capacity
    # ARMS=after,lm-first). Off until measured
    mps_flow_below_normal: bool = False
    # token2wav takes chunks in arrival order, every queued chunk of a kind in one batch, instead of
    # earliest playback deadline first inside frame buckets (serving.job_queue): the A/B for the scheduler
    t2w_fifo: bool = False
    # calls made of chunks with plenty of audio buffered are kept short (StreamConfig.relaxed_slack_s) so a
    # first chunk, or a stream's second chunk behind a thin first one, does not wait behind them. True:
    # always; False: never (such chunks fill every batch up to flow_batch rows); None (auto): while a stream
    # in the engine, waiting for its first audio or playing, has under relaxed_slack_s of audio buffered,
    # and so could run dry behind such a call (the open-loop trace in BENCHMARKS "Open loop": the long calls
    # are of chunks with seconds to spare, and split-start streams' thin second chunks ran dry behind
    # them). Always on costs a synchronized wave its full batches; auto keeps them, since a wave past its
    # first chunks has no thin stream (the fake-clock model in tests/engine/serving/test_job_queue.py)
    t2w_relaxed_cap: bool | None = None
    # a call cannot be preempted, but between its flow and its vocoder the worker may run an urgent batch
    # (a first chunk queued meanwhile, a stream about to run dry) whole, when every row of that call has over
    # relaxed_slack_s to spare: the first chunk then waits for the rest of the flow only. The open-loop
    # trace (BENCHMARKS "Open loop"): most first chunks that still waited for the worker waited behind
    # such a call, more of it in the vocoder than in the flow. Exact (the same calls, in another order);
    # False: every call runs whole before the next (the A/B)
    t2w_yield_to_urgent: bool = True
    # while a streamed request's LM decodes its first chunk's tokens (v3: ~12-16, v2: 41), the token2wav
    # worker does not start a call whose rows all have over relaxed_slack_s of audio buffered: it waits
    # until that first chunk is queued, the rows' slack falls to relaxed_slack_s, or 0.25 s passes (urgent
    # calls never wait). Why: the LM (vLLM's process) and the flow share the GPU under MPS, and a 16-row
    # flow call slows the LM's decode step 4-5x while it runs (BENCHMARKS.md "CUDA MPS", bench.overlap), so
    # a new request's first tokens decode slowly behind calls nobody needs yet. The price is the worker's
    # idle time, which near capacity is throughput lost (tests/engine/serving/worker_sim.py). Off: its A/B
    # at 3 requests/s on an H100 (bench --ab quiet-first) gave the LM's first tokens no sooner and TTFA
    # 14-19 ms worse (BENCHMARKS.md); True: on
    t2w_quiet_first: bool = False
    # A second token2wav worker for streaming requests' first chunks (engine.serving.first_lane): its own
    # thread, device stream and graphs at a first chunk's shapes, so a first chunk need not wait behind a
    # call of rows with seconds of audio buffered (the steady-state trace's wait for the worker). The price:
    # its calls share the GPU with the main worker's. Its A/B (bench --ab first-lane, one load, H100, v3, 3
    # requests/s Poisson, two seeds): the lane took 284-289 first chunks of 360, their wait for the worker
    # 3 ms against 18-27 (mean), their flow + vocoder 59-61 ms against 51, TTFA p95 274 / 265 ms against
    # 295 / 286, 0 underrun (BENCHMARKS.md, capacity-busy-start-first-lane-d20012e); v2's, with its split
    # first chunk: see StreamConfig.fast_start. None (auto): where the device replays graphs and the flow
    # solver has them (first_lane.refusal); not on the CPU, where a second worker would share its few cores
    # with the first; True: on wherever it can run; False: off
    t2w_first_lane: bool | None = None
    # The first-chunk lane's calls on a high-priority device stream (CUDA), so the GPU schedules their
    # kernels ahead of the main worker's queued ones: in the lane's A/B its first chunks' flow + vocoder took
    # 59-61 ms against 51 on the one worker, beside the main worker's calls. Off until its A/B has run on a
    # GPU (bench --ab lane-priority); True: on
    t2w_lane_priority: bool = False
    # streaming flow calls reuse each request's finished frames (keys/values of every attention layer and
    # Euler step: engine.flow.dit_cache for v3's DiT, engine.flow.unet_cache for v2's U-Net, which also
    # keeps its causal convs' left frames) and compute only the frames after them: exact, as the streaming
    # estimators are chunk-causal and the noise fixed. The eager solver (CPU, NPU, cuda_graphs off): v3 and
    # v2; the CUDA-graph solver: both, from a page pool (engine.flow.dit_pages, unet_pages; windows that fail
    # to compile at load leave the graphs recomputing). Costs
    # memory per frame cached at full size: ~3.6 MB (v3) and ~4.6 MB (v2) in float32, 1.8 MB in the graphs'
    # bf16, until the request's final call. False = recompute every call (the A/B). None (auto): on, but
    # for v2 in CUDA graphs, where its eager U-Net windows were slower than the recompute (higher TTFA,
    # fewer audio s/s, more underruns at 64 streams: BENCHMARKS.md); --flow-reuse turns them on.
    flow_reuse: bool | None = None
    # the memory all streams' reuse caches may hold together (GiB); a stream that finds it full keeps what
    # it has cached and recomputes the rest, so the bound costs speed, never audio. None (auto): 4 GiB for
    # the eager solver (~1,200 frames, 24 s of prompt + speech, of the released v3 in float32; ~930 of v2);
    # with the CUDA graphs a page pool of ``AUTO_POOL_SHARE`` of the device memory free once vLLM started
    # (allocated at load: the graphs read it at fixed addresses)
    flow_reuse_gb: float | None = None
    # a voice's prompt frames kept across its requests in the page pool (engine.flow.voice_pages): the
    # prompt's complete chunks before its first speech token's look-ahead depend on the voice alone, so a
    # later request of the voice starts its first flow call after them (exact; up to 1/8 of the pool, a new
    # voice in the place of one unused for 60 s). CUDA graphs with a page pool only. Off: at 4 requests/s on
    # an H100 (v3) it cut a kept voice's first flow call from 256 query frames to 106 (median) for 0-2 ms,
    # as that call at batch 1 is bound by its per-step latency, not its frames (BENCHMARKS.md)
    flow_voice_pages: bool = False
    # processes that normalise and tokenise request texts (engine.text.pool: that work holds the GIL, so
    # threads queue behind each other); 0 = a thread of the server process; None (auto) = 4 on a GPU/NPU
    # server, 0 on the CPU (tests, small demos: each worker costs a second or two to start and ~0.3 GiB)
    text_workers: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        variants = ("base", "rl")
        checks = (("backend", BACKENDS), ("device", DEVICES), ("dtype", DTYPES), ("llm_variant", variants))
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not self.model:
            raise ValueError("model must name a directory or a hub id")
        if not self.asr_model:
            raise ValueError("asr_model must be 'auto', 'none', a Hugging Face id or a local dir")
        if self.flow_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"flow_dtype must be float32 or bfloat16, got {self.flow_dtype!r}")
        if self.flow_attention not in FLOW_ATTENTION:
            raise ValueError(f"flow_attention must be one of {FLOW_ATTENTION}, got {self.flow_attention!r}")
        if not 0.0 <= self.graph_warmup_s <= 300.0:
            raise ValueError("graph_warmup_s must be within [0, 300] (0: capture each bucket on first use)")
        if self.gil_switch_ms is not None and not 0.05 <= self.gil_switch_ms <= 100.0:
            raise ValueError(f"gil_switch_ms must be None or within [0.05, 100] ms, got {self.gil_switch_ms}")
        if not 0 <= self.t2w_kept_prompts <= 4096:
            raise ValueError(f"t2w_kept_prompts must be within [0, 4096], got {self.t2w_kept_prompts}")
        if not 0 <= self.prompt_cache_size <= 4096:
            raise ValueError(f"prompt_cache_size must be within [0, 4096], got {self.prompt_cache_size}")
        if self.text_workers is not None and not 0 <= self.text_workers <= 64:
            raise ValueError(f"text_workers must be within [0, 64] or None (auto), got {self.text_workers}")
        if not isinstance(self.flow_aot, bool):
            raise ValueError(f"flow_aot must be True or False, got {self.flow_aot!r}")
        if not 0.0 <= self.ready_graph_wait_s <= 600.0:  # NaN fails it too
            raise ValueError(f"ready_graph_wait_s must be within [0, 600] s, got {self.ready_graph_wait_s!r}")
        if not isinstance(self.single_stream_graphs_at_load, bool):
            got = self.single_stream_graphs_at_load
            raise ValueError(f"single_stream_graphs_at_load must be True or False, got {got!r}")
        if not isinstance(self.lm_native_graphs, bool):
            raise ValueError(f"lm_native_graphs must be True or False, got {self.lm_native_graphs!r}")
        if not isinstance(self.flow_precompiled, bool):
            raise ValueError(f"flow_precompiled must be True or False, got {self.flow_precompiled!r}")
        if not isinstance(self.flow_compile_child, bool):
            raise ValueError(f"flow_compile_child must be True or False, got {self.flow_compile_child!r}")
        if not isinstance(self.flow_voice_pages, bool):
            raise ValueError(f"flow_voice_pages must be True or False, got {self.flow_voice_pages!r}")
        if not isinstance(self.flow_step_graphs, bool):
            raise ValueError(f"flow_step_graphs must be True or False, got {self.flow_step_graphs!r}")
        if not isinstance(self.lm_fork_server, bool):
            raise ValueError(f"lm_fork_server must be True or False, got {self.lm_fork_server!r}")
        if not isinstance(self.lm_start_after_ready, bool):
            raise ValueError(f"lm_start_after_ready must be True or False, got {self.lm_start_after_ready!r}")
        if not isinstance(self.lm_host, bool):
            raise ValueError(f"lm_host must be True or False, got {self.lm_host!r}")
        if self.lm_start_after_ready and self.lm_handover is False:
            raise ValueError("lm_start_after_ready needs the LM handover (--lm-handover)")
        if not isinstance(self.weights_onto_device, bool):
            raise ValueError(f"weights_onto_device must be True or False, got {self.weights_onto_device!r}")
        if self.flow_compile not in (None, True, False):
            raise ValueError(f"flow_compile must be None (auto), True or False, got {self.flow_compile!r}")
        if self.flow_reuse not in (None, True, False):
            raise ValueError(f"flow_reuse must be None (auto), True or False, got {self.flow_reuse!r}")
        if self.t2w_relaxed_cap not in (None, True, False):
            raise ValueError(f"t2w_relaxed_cap must be None (auto), True or False: {self.t2w_relaxed_cap!r}")
        if not isinstance(self.t2w_yield_to_urgent, bool):
            raise ValueError(f"t2w_yield_to_urgent must be True or False, got {self.t2w_yield_to_urgent!r}")
        if not isinstance(self.t2w_quiet_first, bool):
            raise ValueError(f"t2w_quiet_first must be True or False, got {self.t2w_quiet_first!r}")
        if not isinstance(self.t2w_lane_priority, bool):
            raise ValueError(f"t2w_lane_priority must be True or False, got {self.t2w_lane_priority!r}")
        if not (self.t2w_first_lane is None or isinstance(self.t2w_first_lane, bool)):
            raise ValueError(f"t2w_first_lane must be None (auto), True or False: {self.t2w_first_lane!r}")
        if self.t2w_fifo and self.t2w_quiet_first:
            raise ValueError("t2w_fifo (arrival order) has no slack to hold calls on: t2w_quiet_first off")
        if self.t2w_fifo and self.t2w_relaxed_cap:
            raise ValueError("t2w_fifo (arrival order) has no relaxed rule: t2w_relaxed_cap off or auto")
        if self.flow_reuse_gb is not None and not 0.0 <= self.flow_reuse_gb <= 1024.0:
            raise ValueError(f"flow_reuse_gb must be within [0, 1024] GiB, got {self.flow_reuse_gb}")
        if not 1 <= self.flow_batch <= 64:
            raise ValueError(f"flow_batch must be within [1, 64], got {self.flow_batch}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.95:
            raise ValueError("gpu_memory_utilization must be within [0.05, 0.95]")
        if self.lm_kv_cache_gib is not None and not 0.0 < self.lm_kv_cache_gib <= 1024.0:
            raise ValueError(
                f"lm_kv_cache_gib must be within (0, 1024] GiB, or None, got {self.lm_kv_cache_gib}"
            )
        if self.first_graphs_early is True and not self.background_graphs:
            # every graph before serving (minutes) would still be capturing while vLLM measures the memory
            raise ValueError("first_graphs_early captures the first graphs only: it needs background_graphs")
        if self.lm_handover not in (None, True, False):
            raise ValueError(f"lm_handover must be None (auto), True or False, got {self.lm_handover!r}")
        if self.lm_handover and (self.backend == "native" or self.lm_kv_cache_gib is None):
            raise ValueError(
                "lm_handover hands the native loop over to vLLM: it needs backend vllm or auto, and vLLM's "
                "KV cache at a fixed size (lm_kv_cache_gib; a profiling vLLM would race the native loop)"
            )
        if self.lm_profile_dir is not None and not self.lm_profile_dir.strip():
            raise ValueError("lm_profile_dir must name a directory, or be None")
        if self.cuda_mps not in (None, True, False):
            raise ValueError(f"cuda_mps must be None (auto), True or False, got {self.cuda_mps!r}")
        if self.cuda_mps and self.device not in ("auto", "cuda"):
            raise ValueError(f"cuda_mps needs a CUDA device (device auto or cuda), got {self.device!r}")
        mps_may_run = self.cuda_mps is not False
        if self.mps_flow_percent is not None and not (mps_may_run and 1 <= self.mps_flow_percent <= 100):
            raise ValueError(
                f"mps_flow_percent needs cuda_mps (on or auto) and 1-100 %, got {self.mps_flow_percent}"
            )
        if self.mps_flow_below_normal and not mps_may_run:
            raise ValueError("mps_flow_below_normal is an MPS client priority: needs cuda_mps (on or auto)")

    @property
    def hands_over(self) -> bool:
        """lm_handover resolved: the native loop serves while vLLM starts (where vLLM serves the LM)."""
        if self.lm_handover is not None:
            return self.lm_handover
        return self.backend != "native" and self.lm_kv_cache_gib is not None

    @property
    def graphs_early(self) -> bool:
        """first_graphs_early resolved: the first graphs captured beside the LM backend's start."""
        if self.first_graphs_early is not None:
            return self.first_graphs_early
        return self.background_graphs and self.lm_kv_cache_gib is not None

    def compiles_flow(self, family: str) -> bool:
        """Whether the graphed flow solver compiles its estimator: as set, or in auto for v3 only."""
        if self.flow_compile is not None:
            return self.flow_compile
        return family == "cosyvoice3"

    def opens_first_lane(self, graphs: bool) -> bool:
        """Whether the engine opens the first-chunk lane: as set, or in auto where the device replays graphs
        (``graphs``; the lane's refusal, no graphed solver, may still keep it closed there)."""
        if self.t2w_first_lane is not None:
            return self.t2w_first_lane
        return graphs

    def reuses_flow(self, family: str, graphed: bool) -> bool:
        """Whether streaming flow calls reuse finished frames: as set, or in auto everywhere but v2's
        CUDA-graph solver (``graphed``)."""
        if self.flow_reuse is not None:
            return self.flow_reuse
        return not (graphed and family == "cosyvoice2")
