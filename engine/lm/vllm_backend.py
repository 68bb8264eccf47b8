"""The speech LM on vLLM (CUDA; vllm-ascend on NPU): the ONLY module that imports vllm.

* ``export_hf`` (engine/lm/hf_export.py): the speech LM as a stock Hugging Face Qwen2 directory vLLM can
  serve. v2's decoder bias is saved beside it and added by our logits processor: AsyncLLM's engine core
  runs in a spawned process where a model class registered at run time in this process is unknown, while
  the processor is imported there by its "module:Class" name, so this keeps v2 exact with no plugin install.
* ``RASLogitsProcessor``: adds the bias, then samples each request's row with the SAME batched RAS code as
  the native backend (engine.lm.sampling, seeded per request) and forces that id (all other logits -inf;
  requests run greedy). Stop ids are masked before min_len there too, so vLLM's min_tokens is not used.
* ``VLLMBackend``: AsyncLLM with prompt embeddings and delta outputs; ``generate`` streams ids; closing the
  iterator aborts the vLLM request.
* ``VLLMSession`` (text-streaming input, engine/lm/bistream.py; in ``engine.lm.vllm_session``, which
  imports no vLLM, as does ``generate``'s body): each round a new request over everything fed so far.
* ``hosted``: the backend as ``engine.lm.lm_host``'s process builds it (vLLM's client out of the server).
Untested in CI (no vLLM there); exercised by tests marked ``gpu`` and by bench/ on an H200.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.config import SamplingConfig
from engine.lm import fork_server
from engine.lm.backend import LMRequest
from engine.lm.hf_export import BIAS_FILE, export_hf  # noqa: F401  (export_hf: the backend's input)
from engine.lm.ras_graphs import ras_stepper
from engine.lm.sampling import DeviceRAS
from engine.lm.speech_lm import SpeechLM
from engine.lm.vllm_session import Sampling, VLLMSession, generate, on_host

if TYPE_CHECKING:
    from engine.lm.lm_host import HostSpec

log = logging.getLogger(__name__)
_ARGS = "cosystream"  # key of our per-request data in SamplingParams.extra_args


class RASLogitsProcessor(LogitsProcessor):
    """Per-request RAS in vLLM's persistent batch, its state on the GPU (``DeviceRAS``: no host sync), each
    step replayed from a graph of its batch's bucket where the device has graphs (``GraphedRAS``)."""

    graphs = True

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.rows = vllm_config.scheduler_config.max_num_seqs
        self.steps = vllm_config.model_config.max_model_len
        self.ras: DeviceRAS | None = None  # built on the first request (it carries the sampling config)
        self._step: Callable[[torch.Tensor], torch.Tensor] | None = None
        bias = Path(vllm_config.model_config.model) / BIAS_FILE
        self.bias = torch.load(bias, weights_only=True).float().to(device) if bias.is_file() else None

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            if self.ras is not None:
                self.ras.remove(index)
        for index, params, _, output_ids in batch_update.added:
            self._add(index, (params.extra_args or {}).get(_ARGS), output_ids)
        for a, b, direction in batch_update.moved:
            if self.ras is not None:
                self.ras.move(a, b, swap=direction == MoveDirectionality.SWAP)

    def _add(self, index: int, args: dict[str, Any] | None, output_ids: list[int]) -> None:
        if args is None:  # not one of ours: leave the row alone
            if self.ras is not None:
                self.ras.remove(index)
            return
        if self.ras is None:
            vocab = self.bias.numel() if self.bias is not None else args["vocab"]
            self.ras = DeviceRAS(
                vocab, self.device, SamplingConfig(**args["sampling"]), self.rows, self.steps
            )
            self._step = ras_stepper(self.ras, self.device, self.graphs)
        history = [*args.get("history", ()), *output_ids]  # bistream: the earlier rounds' tokens
        self.ras.add(index, args["seed"], args["min_len"], args["stop_ids"], bool(args["greedy"]), history)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            logits += self.bias  # [B, V] fp32: the v2 decoder bias vLLM's Qwen2 head lacks
        return logits if self._step is None else self._step(logits)


class EagerRASLogitsProcessor(RASLogitsProcessor):
    """The same RAS, each step's ops launched one by one (``VLLMBackend(ras_graphs=False)``: the A/B arm)."""

    graphs = False


def _processor(ras_graphs: bool) -> str:
    """The logits processor's class name for vLLM's engine arguments (it builds one in its engine core)."""
    return (RASLogitsProcessor if ras_graphs else EagerRASLogitsProcessor).__name__


def _kv_cache_size(args: type, gib: float | None) -> dict[str, int]:
    """vLLM's KV cache at ``gib`` GiB (``kv_cache_memory_bytes``: its start then skips profiling the
    device's memory), or nothing (None: sized from gpu_memory_utilization); a vLLM without the field is
    refused rather than left to size it otherwise."""
    if gib is None:
        return {}
    if "kv_cache_memory_bytes" not in {f.name for f in dataclasses.fields(args)}:
        raise RuntimeError(
            "this vLLM has no kv_cache_memory_bytes (0.26 has): lm_kv_cache_gib needs it; "
            "--lm-kv-cache-gib 0 sizes the KV cache from --gpu-memory-utilization instead"
        )
    return {"kv_cache_memory_bytes": int(gib * 2**30)}


def _profiler(args: type, profile_dir: str | None) -> dict[str, Any]:
    """vLLM's torch profiler into ``profile_dir`` (its engine core's steps only: no stacks, no front end,
    whose Python the profiler would slow), or nothing when None."""
    if profile_dir is None:
        return {}
    if "profiler_config" not in {f.name for f in dataclasses.fields(args)}:
        raise RuntimeError("this vLLM has no profiler_config (0.26 has): the LM profiler needs it")
    from vllm.config import ProfilerConfig

    directory = Path(profile_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    config = ProfilerConfig(
        profiler="torch",
        torch_profiler_dir=str(directory),
        torch_profiler_with_stack=False,
        ignore_frontend=True,
    )
    return {"profiler_config": config}


def _capture_limit(args: type, max_num_seqs: int) -> dict[str, int]:
    """vLLM captures its CUDA graphs for batches of up to ``min(2 * max_num_seqs, 512)`` tokens by default
    (``CompilationConfig.max_cudagraph_capture_size``), one capture per size (1, 2, 4, then every 8); a
    decode step of ours holds at most ``max_num_seqs`` tokens, one per sequence, and a step past that is a
    prefill, whose launches matter little: the sizes above it only lengthen vLLM's start. Set where this
    vLLM's engine arguments have the field (checked, not assumed)."""
    names = {f.name for f in dataclasses.fields(args)}
    return {"max_cudagraph_capture_size": max_num_seqs} if "max_cudagraph_capture_size" in names else {}


class VLLMBackend:
    """AsyncLLM serving the speech LM; the same ``generate`` contract as ``NativeLM``."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        sampling: SamplingConfig,
        gpu_memory_utilization: float,
        max_num_seqs: int = 128,
        dtype: str = "bfloat16",
        lm: SpeechLM | None = None,
        profile_dir: str | None = None,
        ras_graphs: bool = True,
        kv_cache_gib: float | None = None,
    ):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        repo = str(Path(__file__).resolve().parents[2])  # engine core processes import this module by name
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        # spawn, not fork: the weights load onto the GPU in another thread while vLLM starts, so CUDA can
        # come up between vLLM's "is CUDA initialised?" check and its fork (seen on the H200: "Cannot
        # re-initialize CUDA in forked subprocess"); an operator's own choice is kept
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if fork_server.started():  # the core forks from it, vLLM imported there (EngineConfig.lm_fork_server)
            from vllm.v1.engine import utils as engine_procs

            engine_procs.get_mp_context = fork_server.context  # what vLLM 0.26 makes its engine core with
        args = AsyncEngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            enable_prefix_caching=True,  # bistream rounds re-submit their grown prompt
            scheduling_policy="priority",  # LMRequest.priority: a waiting listener's segment goes first
            logits_processors=[f"{__name__}:{_processor(ras_graphs)}"],
            **_capture_limit(AsyncEngineArgs, max_num_seqs),
            **_kv_cache_size(AsyncEngineArgs, kv_cache_gib),
            **_profiler(AsyncEngineArgs, profile_dir),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.sampling, self.dtype, self.lm = sampling, getattr(torch, dtype), lm
        self.profile_dir = None if profile_dir is None else Path(profile_dir).resolve()
        self.vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        self._active = 0

    @property
    def active(self) -> int:
        return self._active

    async def start_profile(self) -> None:
        """vLLM's torch profiler on, in its engine core (built with ``profile_dir``)."""
        if self.profile_dir is None:
            raise RuntimeError("the LM profiler needs the backend built with profile_dir")
        await self.engine.start_profile()

    async def stop_profile(self) -> Path:
        """The profiler off -> its table of kernels and ops by device time (the traces lie beside it)."""
        if self.profile_dir is None:
            raise RuntimeError("the LM profiler needs the backend built with profile_dir")
        await self.engine.stop_profile()
        return self.profile_dir / "profiler_out_0.txt"

    @property
    def healthy(self) -> bool:
        return not self.engine.errored  # AsyncLLM: its engine-core process died or its output loop stopped

    def session(self, request_id: str, seed: int) -> VLLMSession:
        if self.lm is None:
            raise RuntimeError("text-streaming input needs the VLLMBackend built with the SpeechLM")
        return VLLMSession(self, self.lm, request_id, seed)

    def params(self, req: LMRequest, sampling: Sampling | None = None) -> Any:
        """vLLM's SamplingParams: greedy, our processor (``_ARGS``) sampling each id."""
        sampling = sampling or Sampling()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        args = {
            "seed": req.seed,
            "min_len": req.min_len,
            "max_len": req.max_len,
            "stop_ids": list(req.stop_ids),
            "sampling": dataclasses.asdict(self.sampling),
            "greedy": sampling.greedy,
            "vocab": self.vocab,
            "history": list(sampling.history),
        }
        return SamplingParams(
            temperature=0.0,
            max_tokens=req.max_len,
            stop_token_ids=list(req.stop_ids if sampling.ends is None else sampling.ends),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            extra_args={_ARGS: args},
        )

    def generate(self, req: LMRequest) -> AsyncIterator[int]:
        return generate(self, req)

    async def tokens(self, prompt: dict[str, Any], params: Any, req: LMRequest) -> AsyncGenerator[int, None]:
        """Every id vLLM emits for one request; closed before its end (or failing), the request is aborted
        there. Callers close it explicitly (``contextlib.aclosing``) so the abort is not left to the GC."""
        self._active += 1
        finished = False
        try:
            stream = self.engine.generate(prompt, params, req.request_id, priority=req.priority)
            async for out in stream:
                for tok in out.outputs[0].token_ids:
                    yield tok
                finished = out.finished
        finally:
            self._active -= 1
            if not finished:
                await self.engine.abort(req.request_id)

    async def greedy(self, req: LMRequest) -> list[int]:
        """Argmax decoding through our processor (bias added, stop ids masked before min_len): the
        export/prompt-embeds parity check against the native LM."""
        params = self.params(req, Sampling(greedy=True))
        prompt = {"prompt_embeds": on_host(req.prefix, self.dtype)}
        tokens: list[int] = []
        async for out in self.engine.generate(prompt, params, req.request_id):
            tokens.extend(out.outputs[0].token_ids)
        return tokens

    def close(self) -> None:
        self.engine.shutdown()


def hosted(spec: HostSpec) -> VLLMBackend:
    """The backend as ``engine.lm.lm_host``'s process builds it. Its engine core forks from the host (vLLM's
    imports done there; the host has no CUDA context, which vLLM checks before a fork) unless the operator
    chose a method."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    return VLLMBackend(
        spec.export, spec.sampling, spec.gpu_memory_utilization, profile_dir=spec.profile_dir,
        ras_graphs=spec.ras_graphs, kv_cache_gib=spec.kv_cache_gib,
    )  # fmt: skip
