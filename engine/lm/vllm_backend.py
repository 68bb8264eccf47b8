"""The speech LM on vLLM (CUDA; vllm-ascend on NPU): the ONLY module that imports vllm.

* ``export_hf``: the loaded ``SpeechLM`` as a Hugging Face Qwen2 directory vLLM can serve: embed_tokens :=
  speech_embedding, lm_head := llm_decoder, vocab = the speech vocabulary, bf16. v2's decoder has a bias,
  which vLLM's Qwen2 head lacks, so v2 uses ``CosyVoice2ForCausalLM`` (registered by "module:Class" string
  inside ``register()``, so nothing touches CUDA at import). Re-exported only when llm.pt changes.
* ``RASLogitsProcessor``: samples each request's row with the SAME batched RAS code as the native backend
  (engine.lm.sampling, seeded per request) and forces that id (all other logits -inf; requests run greedy).
  Stop ids are masked before min_len there too, so vLLM's own min_tokens is not used.
* ``VLLMBackend``: AsyncLLM with prompt embeddings and delta outputs; ``generate`` streams ids; closing the
  iterator aborts the vLLM request.
Untested in CI (no vLLM there); exercised by tests marked ``gpu`` and by bench/ on an H200.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.config import SamplingConfig
from engine.lm.backend import LMRequest
from engine.lm.sampling import SamplerState, sample_step

log = logging.getLogger(__name__)
EXPORT_VERSION = 1
_ARGS = "cosystream"  # key of our per-request data in SamplingParams.extra_args


class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2 with a biased lm_head (v2 ``llm_decoder`` has a bias)."""

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = self.config
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, bias=True, prefix=f"{prefix}lm_head")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)


def register() -> None:
    """Make the v2 class known to vLLM (lazily, by string: safe in spawned workers)."""
    vllm.ModelRegistry.register_model("CosyVoice2ForCausalLM", f"{__name__}:CosyVoice2ForCausalLM")


class RASLogitsProcessor(LogitsProcessor):
    """Per-request RAS in vLLM's persistent batch; state is keyed by batch row as vLLM's API dictates."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[SamplerState, SamplingConfig]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, _ in batch_update.added:
            args = (params.extra_args or {}).get(_ARGS)
            if args is None:
                self.rows.pop(index, None)
                continue
            state = SamplerState.seeded(args["seed"], args["min_len"], args["max_len"], args["stop_ids"])
            self.rows[index] = (state, SamplingConfig(**args["sampling"]))
        for a, b, direction in batch_update.moved:
            moved_a, moved_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if moved_a is not None:
                self.rows[b] = moved_a
            if direction == MoveDirectionality.SWAP and moved_b is not None:
                self.rows[a] = moved_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(self.rows)
        cfg = self.rows[index[0]][1]
        picks = sample_step(logits[index], [self.rows[i][0] for i in index], cfg)
        rows = torch.tensor(index, device=logits.device)
        forced = torch.full((len(index), logits.shape[1]), -float("inf"), device=logits.device)
        forced[torch.arange(len(index)), torch.tensor(picks, device=logits.device)] = 0.0
        logits[rows] = forced
        return logits


def _fingerprint(llm_pt: Path) -> str:
    stat = llm_pt.stat()
    return hashlib.sha256(
        f"{llm_pt.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{EXPORT_VERSION}".encode()
    ).hexdigest()[:16]


def export_hf(
    lm: torch.nn.Module, qwen_config: dict[str, Any], llm_pt: Path, cache_dir: Path, dtype: str = "bfloat16"
) -> Path:
    """Write (once per llm.pt) the HF Qwen2 directory vLLM loads; returns it."""
    from safetensors.torch import save_file

    out = cache_dir / f"vllm-{_fingerprint(llm_pt)}-{dtype}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in lm.state_dict().items():
        if key.startswith("llm.model.model."):
            tensors["model." + key.removeprefix("llm.model.model.")] = value
    tensors["model.embed_tokens.weight"] = lm.speech_embedding.weight
    tensors["lm_head.weight"] = lm.llm_decoder.weight
    bias = lm.llm_decoder.bias is not None
    if bias:
        tensors["lm_head.bias"] = lm.llm_decoder.bias
    tensors = {k: v.detach().to(getattr(torch, dtype)).contiguous().cpu() for k, v in tensors.items()}
    config = dict(qwen_config, vocab_size=lm.speech_embedding.weight.shape[0], tie_word_embeddings=False)
    config.update(torch_dtype=dtype, architectures=["CosyVoice2ForCausalLM" if bias else "Qwen2ForCausalLM"])
    config.pop("bos_token_id", None), config.pop("eos_token_id", None)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    log.info("exported the speech LM for vLLM to %s", out)
    return out


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
    ):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        register()
        repo = str(Path(__file__).resolve().parents[2])  # engine core processes import this module by name
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        args = AsyncEngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            logits_processors=[f"{__name__}:RASLogitsProcessor"],
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.sampling, self.dtype = sampling, getattr(torch, dtype)
        self._active = 0

    @property
    def active(self) -> int:
        return self._active

    def _params(self, req: LMRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        args = {
            "seed": req.seed,
            "min_len": req.min_len,
            "max_len": req.max_len,
            "stop_ids": list(req.stop_ids),
            "sampling": dataclasses.asdict(self.sampling),
        }
        return SamplingParams(
            temperature=0.0,
            max_tokens=req.max_len,
            stop_token_ids=list(req.stop_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            extra_args={_ARGS: args},
        )

    async def generate(self, req: LMRequest) -> AsyncIterator[int]:
        prompt = {"prompt_embeds": req.prefix.detach().to("cpu", self.dtype)}
        self._active += 1
        finished = False
        try:
            async for out in self.engine.generate(prompt, self._params(req), req.request_id):
                for tok in out.outputs[0].token_ids:
                    if tok not in req.stop_ids:
                        yield tok
                finished = out.finished
        finally:
            self._active -= 1
            if not finished:
                await self.engine.abort(req.request_id)

    async def greedy(self, req: LMRequest) -> list[int]:
        """Argmax decoding of exactly ``req.max_len`` tokens, stop ids masked by vLLM's own min_tokens (our
        RAS processor leaves the row alone): the export/prompt-embeds parity check against the native LM."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0,
            min_tokens=req.max_len,
            max_tokens=req.max_len,
            stop_token_ids=list(req.stop_ids),
            detokenize=False,
        )
        prompt = {"prompt_embeds": req.prefix.detach().to("cpu", self.dtype)}
        final = None
        async for out in self.engine.generate(prompt, params, req.request_id):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    def close(self) -> None:
        self.engine.shutdown()
