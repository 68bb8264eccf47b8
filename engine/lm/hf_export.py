"""The speech LM's weights as a stock Hugging Face Qwen2 directory, the form vLLM loads.

embed_tokens := speech_embedding, lm_head := llm_decoder (no bias: v2's bias is saved beside it and added
by the vLLM backend's logits processor), vocab = the speech vocabulary, in ``dtype``. Written once per
llm.pt (path, size, mtime: ``fingerprint``) under the cache root. It needs only llm.pt's state dict, whose
keys are the SpeechLM's (the checkpoint loads strictly), so the engine can start vLLM from the file while
the model loads onto the device, and a warm start reads nothing at all. No vllm import here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
EXPORT_VERSION = 1
BIAS_FILE = "cosystream_lm_head_bias.pt"  # v2 llm_decoder.bias, beside the exported weights
WEIGHTS_FILE = "model.safetensors"  # written last: its presence marks a finished export


def fingerprint(llm_pt: Path) -> str:
    stat = llm_pt.stat()
    return hashlib.sha256(
        f"{llm_pt.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{EXPORT_VERSION}".encode()
    ).hexdigest()[:16]


def export_dir(llm_pt: Path, cache_dir: Path, dtype: str = "bfloat16") -> Path:
    """Where ``llm_pt``'s export lives (finished once it holds ``WEIGHTS_FILE``)."""
    return cache_dir / f"vllm-{fingerprint(llm_pt)}-{dtype}"


def finished_export(llm_pt: Path, cache_dir: Path, dtype: str = "bfloat16") -> Path | None:
    """``llm_pt``'s export when a finished one is cached (a warm start then reads nothing), else None."""
    out = export_dir(llm_pt, cache_dir, dtype)
    return out if (out / WEIGHTS_FILE).exists() else None


def export_hf(
    lm: torch.nn.Module | Mapping[str, torch.Tensor],
    qwen_config: dict[str, Any],
    llm_pt: Path,
    cache_dir: Path,
    dtype: str = "bfloat16",
) -> Path:
    """Write (once per llm.pt) the HF Qwen2 directory vLLM loads from the SpeechLM or its state dict (as
    llm.pt holds it); returns it."""
    from safetensors.torch import save_file

    done = finished_export(llm_pt, cache_dir, dtype)
    if done is not None:
        return done
    out = export_dir(llm_pt, cache_dir, dtype)
    out.mkdir(parents=True, exist_ok=True)
    state = lm.state_dict() if isinstance(lm, torch.nn.Module) else lm
    tensors = {
        "model." + key.removeprefix("llm.model.model."): value
        for key, value in state.items()
        if key.startswith("llm.model.model.")
    }
    tensors["model.embed_tokens.weight"] = state["speech_embedding.weight"]
    tensors["lm_head.weight"] = state["llm_decoder.weight"]
    bias = state.get("llm_decoder.bias")
    if bias is not None:
        torch.save(bias.detach().float().cpu().clone(), out / BIAS_FILE)
    tensors = {k: v.detach().to(getattr(torch, dtype)).contiguous().cpu() for k, v in tensors.items()}
    vocab = state["speech_embedding.weight"].shape[0]
    config = dict(qwen_config, vocab_size=vocab, tie_word_embeddings=False)
    config.update(torch_dtype=dtype, architectures=["Qwen2ForCausalLM"])
    config.pop("bos_token_id", None), config.pop("eos_token_id", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / WEIGHTS_FILE))
    log.info("exported the speech LM for vLLM to %s", out)
    return out
