"""One flow estimator program compiled whole in a child process (``EngineConfig.flow_compile_child``), for
``engine.flow.precompiled``: where a call needs a program the cache root lacks (a cold start), the serving
process describes the call (each tensor's shape, strides, dtype, device; the other arguments as they are;
the grad and inference modes) and the estimator (its class, config and compute dtype), and waits for the
child, which builds the estimator at that architecture with random weights, compiles the program for that
call through its own ``Precompiled`` (the same file name: the same module identity, key and sources) and
saves it. The server then loads the file as a warm start would.

Why: a compile in the serving process is minutes of Dynamo, AOTAutograd and Inductor, much of it Python
holding the interpreter that the requests served beside it need (a cold H100 start: 338 s for the flow's two
programs in the background while the first visitors were served). The child has an interpreter of its own;
the server only waits on a process. A child that fails (or builds a program the call's guards refuse)
leaves the compile to the server, as without it.

The child makes the call's tensors at their full sizes (zeros), the page pool's too: Inductor may guard a
program on its sizes (e.g. 32-bit indexing), so a program traced at a smaller pool could be refused here.
A cold start on a GPU therefore needs room for a second pool for the minutes of the compile (v3 on an H100:
26.4 GiB): where that and a copy of the module pass 90 % of the free memory no child starts, and a child
that runs out of memory anyway fails; the server compiles, as without it. Untested on a GPU.

    python -m engine.flow.compile_child JOB.json      # what compile_elsewhere runs
"""

from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)
ROOM_SHARE = 0.9  # a child starts only where its call's tensors and module fit in this share of free memory
PARENT_CHECK_S = 1.0  # the child looks this often whether the server that waits for it is still there
JOB_EXIT = {"identity": 3, "orphaned": 4}  # the child's exit statuses besides 0 (saved) and 1 (failed)


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of the call: a tensor's layout (``dtype`` set), or any other value as it is."""

    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: str | None = None  # "bfloat16"...; None: not a tensor
    inference: bool = False
    value: bool | int | float | str | None = None

    @classmethod
    def of(cls, a: object) -> Arg:
        if isinstance(a, Tensor):
            dtype = str(a.dtype).removeprefix("torch.")
            return cls(tuple(a.shape), tuple(a.stride()), dtype, a.is_inference())
        if a is not None and not isinstance(a, bool | int | float | str):
            raise TypeError(f"a child compile takes tensors and plain values, not {type(a).__name__}")
        return cls(value=a)

    @property
    def nbytes(self) -> int:
        """The bytes ``example`` allocates (0 for a plain value)."""
        if self.dtype is None:
            return 0
        return _storage_size(self.shape, self.stride) * getattr(torch, self.dtype).itemsize

    def example(self, device: torch.device) -> object:
        """Zeros of this layout (values do not change a program; zero indices stay in range), or the value."""
        if self.dtype is None:
            return self.value
        flat = torch.zeros(
            _storage_size(self.shape, self.stride), dtype=getattr(torch, self.dtype), device=device
        )
        return flat.as_strided(self.shape, self.stride)


@dataclasses.dataclass(frozen=True)
class Job:
    """What the child compiles: ``estimator``'s class (``engine.flow.aot_package.ESTIMATORS``) at ``config``
    (JSON), its parameters in ``dtype``, ``method`` called with ``args`` under the modes given, saved under
    ``root`` as ``Precompiled`` names it; ``identity`` is the server's module's (the child checks its own)."""

    estimator: str
    config: str
    dtype: str
    device: str
    folded: bool
    method: str
    root: str
    grad: bool
    inference: bool
    args: tuple[Arg, ...]
    identity: str

    @classmethod
    def of(cls, module: nn.Module, method: str, root: Path, args: Sequence[object]) -> Job:
        from engine.flow.aot_package import estimator_kind

        kind, config = estimator_kind(module, "child compile")
        param, folded = next(module.parameters()), bool(getattr(module, "fold_masks", False))
        return cls(
            kind, config, str(param.dtype).removeprefix("torch."), str(param.device), folded,
            method, str(root), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple(Arg.of(a) for a in args), identity(module),
        )  # fmt: skip

    @classmethod
    def read(cls, path: Path) -> Job:
        fields = json.loads(path.read_text())
        layout = ("shape", "stride")
        args = tuple(Arg(**{**a, **{k: tuple(a[k]) for k in layout}}) for a in fields["args"])
        return cls(**{**fields, "args": args})

    def module(self) -> nn.Module:
        """The estimator at this architecture, randomly initialised, parameters in ``dtype`` (buffers keep
        theirs, as ``compiled_estimator.cast_parameters``), on the device, in eval mode."""
        from engine.flow.aot_package import random_estimator

        dev, dtype = torch.device(self.device), getattr(torch, self.dtype)
        module: Any = random_estimator(self.estimator, self.config, dev, dtype)  # a DiT or U-Net
        module.fold_masks = self.folded  # the attention rule, as CausalCFM.fold_attention sets it
        return module.eval()

    def examples(self) -> list[object]:
        """The call's arguments, made under its modes (an inference tensor where the server's was one)."""
        dev = torch.device(self.device)
        out = []
        for a in self.args:
            with torch.inference_mode(a.inference):
                out.append(a.example(dev))
        return out


def _storage_size(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements a tensor of this shape and these strides spans (0 where it is empty)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0


def identity(module: nn.Module) -> str:
    """A digest of ``precompiled.module_identity``: equal where the child's file is the server's."""
    from engine.flow.precompiled import module_identity

    return hashlib.sha256(module_identity(module).encode()).hexdigest()


def compile_elsewhere(module: nn.Module, method: str, root: Path, args: Sequence[object]) -> bool:
    """Run the child for this call and wait for it (a process wait: the interpreter stays free) -> whether it
    saved a program. Its job and its output lie beside the programs (``<pid>-<n>.child.json``, ``.log``)."""
    try:
        job = Job.of(module, method, root, args)
    except TypeError as exc:  # an argument or an estimator it cannot describe: the server compiles
        log.info("%s: compiled here (%s)", method, exc)
        return False
    if (short := _no_room(job, module)) is not None:
        log.info("%s: compiled here (%s)", method, short)
        return False
    root.mkdir(parents=True, exist_ok=True)
    stem = f"{method}-{os.getpid()}-{time.monotonic_ns()}.child"
    spec, output = root / f"{stem}.json", root / f"{stem}.log"
    spec.write_text(json.dumps(dataclasses.asdict(job)) + "\n")
    return _ran(spec, output, method)


def _no_room(job: Job, module: nn.Module) -> str | None:
    """Why the child would run out of device memory (its call's tensors, the page pool's among them, and a
    copy of the module beside this process's), or None where it fits."""
    from engine import device as devices

    dev = torch.device(job.device)
    if not devices.is_accelerator(dev):
        return None
    weights = sum(p.numel() * p.element_size() for p in (*module.parameters(), *module.buffers()))
    need, free = weights + sum(a.nbytes for a in job.args), devices.free_memory_bytes(dev)
    if need <= ROOM_SHARE * free:
        return None
    return f"a child would need {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB is free"


def _ran(spec: Path, output: Path, method: str) -> bool:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "engine.flow.compile_child", str(spec)]
    began = time.monotonic()
    with output.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        log.info("%s: compiling in a child process (pid %d, log %s)", method, child.pid, out.name)
        code = child.wait()
    seconds = time.monotonic() - began
    if code != 0:
        tail = output.read_text(errors="replace")[-1500:]
        why = "%s: the child compile failed (exit %d after %.1f s); compiling here:\n%s"
        log.warning(why, method, code, seconds, tail)
        return False
    log.info("%s: the child compiled and saved the program in %.1f s", method, seconds)
    return True


def _leave_with_parent() -> None:
    """End this process once the server that waits for it is gone (its parent changes): no orphan compiles
    for minutes after a server stopped."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os._exit(JOB_EXIT["orphaned"])

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """The child: ``JOB.json`` -> the program compiled and saved (0), a module that is not the server's (3);
    a compile that fails raises (1)."""
    from engine.flow.precompiled import Precompiled

    args = sys.argv[1:] if argv is None else argv
    faulthandler.enable()  # a native crash prints every thread's Python stack into the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _leave_with_parent()
    job = Job.read(Path(args[0]))
    module = job.module()
    if identity(module) != job.identity:
        log.error("the estimator built here is not the server's (its parameters or config differ)")
        return JOB_EXIT["identity"]
    fn = getattr(type(module), job.method)
    program = Precompiled(fn, module, Path(job.root), job.method, fallback=_refuse)
    with torch.set_grad_enabled(job.grad), torch.inference_mode(job.inference):
        program(*job.examples())
    return 0


def _refuse(*args: Any) -> Any:
    raise RuntimeError("the program did not compile whole: nothing saved")


if __name__ == "__main__":
    sys.exit(main())
