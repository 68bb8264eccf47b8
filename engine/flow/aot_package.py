"""The flow estimator's serving programs compiled ahead of time by AOTInductor in a process of their own,
kept under the cache root and loaded from there (``EngineConfig.flow_aot``).

Why: ``torch.compile`` in the serving process traces the estimator with Dynamo, tens of seconds of Python
during which every request beside it waits for the interpreter (BENCHMARKS.md, "Start-up"). Here a child
process exports and compiles; the server only waits for a process (not for the GIL), then loads the
packages in milliseconds. A warm start finds them on disk and starts no child.

The packages hold no weights (``package_constants_in_so`` off): the child builds the estimator at its
architecture with random values, and the server hands each loaded program its own (cast) parameters and
buffers by name, shared, not copied. A package set is found by the hash of everything that changes the
traced code (``AotSpec.key``): the estimator's class and config, the solver's, the compute dtype, the
attention rule, the device, torch's version and the flow code's source.

Programs: "final" (the estimator's whole-sequence call with full attention: every final call),
"streaming" (the same with the chunk rule: streaming calls where there is no page pool) and "paged" (one
solver step of page windows, ``forward_paged``: streaming calls with a pool). Each is exported at one
recorded call with every size left to ``torch.export`` (``Dim.AUTO``) and checked against the eager
estimator at another recorded call of other sizes before it is kept.

The child's side (recording, export, compile, check) is ``engine.flow.aot_build``, which ``AotBuild``
runs as ``python -m engine.flow.aot_build SPEC.json OUT_DIR``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine import device as devices
from engine.flow.cfm import CausalCFM, CfmConfig
from engine.flow.dit import DiT, DiTConfig
from engine.flow.unet import CausalConditionalDecoder, UNetConfig

log = logging.getLogger(__name__)
FLOW_SOURCES = Path(__file__).parent  # the traced code: a change to it is a new package set
MANIFEST = "programs.json"  # written last: a folder with it is complete
WAIT_SLICE_S = 1.0  # AotBuild.wait looks at its stop event this often
ESTIMATORS: dict[str, tuple[type[nn.Module], type]] = {
    "dit": (DiT, DiTConfig),
    "unet": (CausalConditionalDecoder, UNetConfig),
}
# a program is kept if it matches eager to this share of the output's largest magnitude (bf16 keeps 8
# bits of mantissa; the package and eager round at different places)
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class AotSpec:
    """What a package set is built for (everything but the weights). ``config`` and ``cfm`` are the
    estimator's and the solver's config dataclasses as JSON."""

    estimator: str  # a key of ESTIMATORS
    config: str
    cfm: str
    dtype: str  # the compute dtype (CompiledEstimator's)
    device: str  # "cuda", "cpu"
    folded: bool  # the attention rules folded into q/k dims (CausalCFM.fold_attention)
    cudnn: bool  # traced with cuDNN's attention first (devices.cudnn_attention)
    programs: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {self.estimator!r}")
        if self.dtype not in TOLERANCE:
            raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {self.dtype!r}")
        unknown = set(self.programs) - {"final", "streaming", "paged"}
        if unknown or not self.programs:
            raise ValueError(f"programs must be some of final, streaming, paged; got {self.programs}")

    @classmethod
    def of(
        cls, cfm: CausalCFM, dtype: torch.dtype, device: torch.device, cudnn: bool, paged: bool
    ) -> AotSpec:
        """The spec of ``cfm``'s estimator served in ``dtype`` on ``device``, with a page pool or not."""
        est = cfm.estimator
        kind, config = estimator_kind(est, "ahead-of-time programs")
        solver = json.dumps(dataclasses.asdict(cfm.cfg), sort_keys=True)
        programs = ("final", "paged" if paged else "streaming")
        folded = bool(getattr(est, "fold_masks", False))
        return cls(
            kind, config, solver, str(dtype).removeprefix("torch."), device.type, folded, cudnn, programs
        )

    def key(self) -> str:
        """The package set's folder name: a hash of this spec, the device's kind, torch and the flow code."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode())
        digest.update(f"{torch.__version__} {devices.describe(torch.device(self.device))}".encode())
        for source in sorted(FLOW_SOURCES.glob("*.py")):
            digest.update(source.read_bytes())
        return digest.hexdigest()[:20]

    def build_cfm(self) -> CausalCFM:
        """The solver around a randomly initialised estimator of this architecture, weights in ``dtype``."""
        dev = torch.device(self.device)
        estimator = random_estimator(self.estimator, self.config, dev, getattr(torch, self.dtype))
        cfm = CausalCFM(CfmConfig(**json.loads(self.cfm)), estimator).to(dev).eval()
        if self.folded:
            cfm.fold_attention()
        return cfm


def estimator_kind(estimator: nn.Module, what: str) -> tuple[str, str]:
    """``estimator``'s key of ``ESTIMATORS`` and its config as JSON; a TypeError naming ``what`` (the
    programs asked for) where it is neither kind."""
    kind = next((k for k, (c, _) in ESTIMATORS.items() if isinstance(estimator, c)), None)
    if kind is None:
        raise TypeError(f"no {what} for a {type(estimator).__name__} estimator")
    return kind, json.dumps(dataclasses.asdict(estimator.cfg), sort_keys=True)  # type: ignore[call-overload]


def random_estimator(kind: str, config: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """An estimator of ``kind`` at ``config`` (JSON), randomly initialised on ``device``, its parameters in
    ``dtype`` (buffers keep theirs): a program's architecture without its weights."""
    module, cfg = ESTIMATORS[kind]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(config).items()}
    with device:
        estimator = module(cfg(**fields))
    for param in estimator.parameters():
        param.data = param.data.to(dtype)
    return estimator


class WholeCall(nn.Module):
    """The estimator's whole-sequence call (streaming rule or not) with positional tensors, as export
    takes them."""

    def __init__(self, estimator: nn.Module, streaming: bool):
        super().__init__()
        self.estimator, self.streaming = estimator, streaming

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, self.streaming)


class PagedWindow(nn.Module):
    """The estimator's ``forward_paged`` (one solver step of a batch of page windows) with its inputs
    named, as export takes them -> (velocity, the keys/values it keeps, the states it keeps)."""

    def __init__(self, estimator: nn.Module):
        super().__init__()
        self.estimator = estimator
        self.paged: Callable[..., tuple[Tensor, ...]] = estimator.forward_paged  # type: ignore[assignment]

    def forward(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, kv: Tensor, states: Tensor,
        prefix: Tensor, start: Tensor, total: Tensor, lead: Tensor, cfg: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        return self.paged(x, mu, t, spks, cond, kv, states, prefix, start, total, lead, cfg)


def export_and_load(
    module: nn.Module, example: tuple[Tensor, ...], dims: Any, package: Path, weights: bool = True
) -> tuple[Any, dict[str, float]]:
    """Export ``module`` at ``example`` with ``dims`` dynamic, compile it into ``package`` (without its
    weights unless ``weights``: then ``bind`` gives them), load it -> (runner, seconds of each step)."""
    timings, t0 = {}, time.perf_counter()
    program = torch.export.export(module, example, dynamic_shapes=dims)
    timings["export_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    # each step logged as it ends: a native crash in the next one (none is caught) is placed by the log
    log.info("%s: exported in %.1f s; compiling", package.name, timings["export_s"])
    configs = {} if weights else {"aot_inductor.package_constants_in_so": False}
    path = torch._inductor.aoti_compile_and_package(  # type: ignore[attr-defined]
        program, package_path=str(package), inductor_configs=configs
    )
    timings["aoti_compile_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    log.info("%s: compiled in %.1f s; loading", package.name, timings["aoti_compile_s"])
    runner = torch._inductor.aoti_load_package(path)  # type: ignore[attr-defined]
    if not weights:
        log.info("%s: loaded; binding its weights", package.name)
        bind(runner, module)
    timings["load_s"] = time.perf_counter() - t0
    return runner, {k: round(v, 3) for k, v in timings.items()}


def bind(runner: Any, module: nn.Module) -> None:
    """Hand a weightless package ``module``'s parameters and buffers by name (shared: the package reads
    them where they are); a name the package needs and the module lacks is an error."""
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    wanted = runner.get_constant_fqns()
    missing = [name for name in wanted if name not in named]
    if missing:
        raise KeyError(f"the flow program needs tensors the estimator lacks: {missing[:5]}")
    runner.load_constants({name: named[name] for name in wanted}, check_full_update=True, user_managed=True)


# --------------------------------------------------------------------------------------------- the server
@dataclass(frozen=True)
class AotPrograms:
    """The loaded programs (None: not built; that call runs the eager estimator), bound to the
    estimator's weights."""

    final: Any
    streaming: Any
    paged: Any

    @classmethod
    def load(cls, folder: Path, estimator: nn.Module) -> AotPrograms:
        """The packages in ``folder`` bound to ``estimator`` (the serving one, in the compute dtype)."""
        built = json.loads((folder / MANIFEST).read_text())
        runners = {}
        for name in ("final", "streaming", "paged"):
            if name in built:
                runners[name] = torch._inductor.aoti_load_package(str(folder / f"{name}.pt2"))  # type: ignore[attr-defined]
                bind(
                    runners[name], PagedWindow(estimator) if name == "paged" else WholeCall(estimator, False)
                )
        return cls(runners.get("final"), runners.get("streaming"), runners.get("paged"))

    def whole(self, eager: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """``estimator(x, mask, mu, t, spks, cond, streaming)`` through the program built for it."""

        def run(*args: Any) -> Tensor:
            program = self.streaming if args[-1] else self.final
            if program is None:
                return eager(*args)
            return program(*_contiguous(args[:-1]))

        return run

    def windows(
        self, eager: Callable[..., tuple[Tensor, ...]] | None
    ) -> Callable[..., tuple[Tensor, ...]] | None:
        """``forward_paged`` through its program (the eager one where it was not built)."""
        program = self.paged
        if program is None:
            return eager
        return lambda *args: tuple(program(*_contiguous(args)))


def _contiguous(args: tuple[Tensor, ...]) -> Iterator[Tensor]:
    """The programs were compiled for dense inputs (the solver passes ``t`` expanded, stride 0)."""
    return (a.contiguous() for a in args)


class AotBuild:
    """The package set of one spec under ``root``: found there, or being built by a child process."""

    def __init__(self, spec: AotSpec, root: Path):
        self.spec, self.path = spec, root / spec.key()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def done(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def start(self) -> AotBuild:
        """Start the child unless the set is on disk already; its spec and its output go beside the set's
        folder (``<key>.json``, ``<key>.log``)."""
        if self.done or self.process is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        spec_file = self.path.with_name(f"{self.path.name}.json")
        spec_file.write_text(json.dumps(dataclasses.asdict(self.spec), indent=2) + "\n")
        log_file = self.path.with_name(f"{self.path.name}.log").open("wb")
        repo = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "engine.flow.aot_build", str(spec_file), str(self.path)]
        with log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        log.info(
            "building the flow programs in a child process (pid %d) into %s", self.process.pid, self.path
        )
        return self

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Block (in the child's wait, not holding the interpreter) until the set is built -> True, or
        ``stop`` was set -> False (the child is then killed). A failed build raises with its log's end."""
        while self.process is not None and self.process.poll() is None:
            if stop is not None and stop.is_set():
                self.process.kill()
                self.process.wait()
                return False
            try:
                self.process.wait(WAIT_SLICE_S)
            except subprocess.TimeoutExpired:
                continue
        if not self.done:
            tail = self.path.with_name(f"{self.path.name}.log")
            text = tail.read_text(errors="replace")[-2000:] if tail.is_file() else "(no log)"
            raise RuntimeError(f"the flow programs were not built ({self.path}; {self._status()}):\n{text}")
        return True

    def _status(self) -> str:
        """How the child ended, in words: a native crash shows as the signal that ended it."""
        code = None if self.process is None else self.process.returncode
        if code is None:
            return "no child ran"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
