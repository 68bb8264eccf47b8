"""The one directory everything a server writes to keep lives under: downloaded and built models, the
compile caches (TorchInductor, Triton, vLLM's), vLLM's exported LM, and saved voices.

``--cache-dir`` (``EngineConfig.cache_dir``), else ``$COSYSTREAM_CACHE`` (the Docker image points it at
its /data volume), else ``~/.cache/cosystream``. On a volume it makes a restarted or recreated container
start warm: no compile runs again and no saved voice is lost. Stdlib only: it must run before torch,
Triton or vLLM read their cache variables.

What a warm start finds there (a Space's or pod's volume must keep the whole root):

* ``owner/name/``: the downloaded checkpoint (where no hub cache of its own is used); ``weights/``: its
  .pt files as safetensors, converted on the first start and memory-mapped after (engine.checkpoint);
* ``vllm-<fingerprint>-bfloat16/``: the LM exported for vLLM (engine.lm.hf_export); ``vllm-cache/``:
  vLLM's own compile cache (VLLM_CACHE_ROOT, inherited by its engine core);
* ``compile/inductor``, ``compile/triton`` (``compile/attention-cudnn/`` with cuDNN attention): the flow
  compile's Inductor caches (FX graph and AOTAutograd) and Triton kernels; ``compile/aot/``: the flow's
  AOTInductor packages (``--flow-aot``), which a warm start loads instead of compiling;
  ``compile/precompiled/``: the flow compile's whole programs (on by default), loaded untraced;
* ``voices/`` (saved voices), ``mps/`` (the MPS daemon's pipes and logs), ``demo-tiny*/``.

Rebuilt on every start, whatever the cache holds (GPU only, measured by bench.startup): the CUDA graphs
(flow, vocoder, vLLM's: a capture is tied to the process's memory) and, with ``--no-flow-precompiled``
(and no ``--flow-aot``), Dynamo's tracing of the flow estimator (its Inductor output comes from the cache;
the tracing itself is not kept).
"""

from __future__ import annotations

import getpass
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "COSYSTREAM_CACHE"
# the libraries' own cache variables -> where under the root they point (unless the operator set them)
COMPILE_DIRS = {
    "TORCHINDUCTOR_CACHE_DIR": "compile/inductor",
    "TRITON_CACHE_DIR": "compile/triton",
    "VLLM_CACHE_ROOT": "vllm-cache",
}
_ours: dict[str, str] = {}  # the variables use_cache_root set, and to what


def configured_root(cache_dir: str | None = None) -> Path | None:
    """The root the operator chose (flag, then environment), None when neither is set."""
    chosen = cache_dir or os.environ.get(ENV)
    return Path(chosen).expanduser() if chosen else None


def cache_root(cache_dir: str | None = None) -> Path:
    """The cache root: ``configured_root`` or ``~/.cache/cosystream``."""
    return configured_root(cache_dir) or Path.home() / ".cache" / "cosystream"


def inductor_default() -> str:
    """Inductor's own default cache (a temp dir named for the user, gone with the machine's /tmp), which
    importing ``torch._dynamo`` writes into the environment when the variable is unset: found there, it is
    torch's doing, not the operator's choice, and the cache root replaces it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def _replaceable(name: str) -> bool:
    """Unset, set by ``use_cache_root`` earlier, or torch's own default: not an operator's choice."""
    value = os.environ.get(name)
    if value is None or _ours.get(name) == value:
        return True
    return name == "TORCHINDUCTOR_CACHE_DIR" and os.path.abspath(value) == os.path.abspath(inductor_default())


def use_cache_root(root: Path) -> dict[str, str]:
    """Point the compile caches under ``root`` (a variable the operator set is kept) -> what they are now.
    Called before torch compiles, Triton builds or vLLM starts: they read these variables then (vLLM's
    engine core inherits them: its compile cache lands under ``vllm-cache/``)."""
    for name, sub in COMPILE_DIRS.items():
        if _replaceable(name):
            os.environ[name] = _ours[name] = str(root / sub)
    log.info("cache root %s (compile caches: %s)", root, ", ".join(os.environ[n] for n in COMPILE_DIRS))
    return {name: os.environ[name] for name in COMPILE_DIRS}


def set_by_cache_root(name: str) -> bool:
    """Whether ``name``'s current value is the one ``use_cache_root`` gave it (a later, more specific
    choice of the engine may replace it; an operator's may not)."""
    return name in _ours and os.environ.get(name) == _ours[name]
