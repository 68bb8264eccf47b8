"""A compiled program saved whole and loaded without tracing (``EngineConfig.flow_precompiled``).

Why: ``torch.compile`` traces the flow estimator with Dynamo and runs AOTAutograd again on every start;
Inductor's on-disk cache only spares the kernels' builds (a warm H200 start still spent 61-95 s in the
"flow compile"). ``aot_compile`` returns the whole program (guards, graph, Inductor's output) and
``save_compiled_function`` writes it: a later process loads it without tracing. The kernels' binaries still
come from Inductor's and Triton's caches beside it (the cache root's ``compile/``).

Programs by *specialisation key*: Dynamo specialises a size of 0 or 1 (a batch of 1 guards on it), a
non-tensor argument (``streaming``), the grad and inference modes and each tensor's dtype, device and
layout; every other size stays symbolic (``dynamic=True``, no duck shaping, as
``compiled_estimator._compiled``), so one program serves the buckets of a key, but for a guard it traced
(e.g. a batch below a model size it was broadcast against): the call it refuses gets a second program,
saved beside the first, as Dynamo would recompile. The unbound method is compiled with its module as first
argument, so a loaded program reads the module's current parameters (the serving weights, shared).

A serving worker's call never compiles (``serving_thread``): a call that no loaded program fits runs the
module eager at once, while a thread of its own loads or compiles its program (a compile on the token2wav
worker held every stream for 144 s on an H100 at 3 requests/s); the calls after it use the program. A key
that falls back (below) has its fallback run once on that thread, which compiles it, before a serving call
runs it.

Nothing here may fail a request: a program that does not trace whole (``fullgraph``) or compile leaves
that key on the fallback (today's ``torch.compile`` program), and a key with no program that does not
compile is noted beside them (``<stem>.refused``), so that later starts run its fallback without tracing it
again; a file that does not load is compiled again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as shape_config

log = logging.getLogger(__name__)
_serving = threading.local()  # .on: this thread serves requests (serving_thread), so it never compiles
Key = tuple[object, ...]
Elsewhere = Callable[[nn.Module, str, Path, Sequence[object]], bool]  # compile_child.compile_elsewhere
# programs one key may hold (Dynamo's cache holds more than one where a guard of the first refuses a call:
# the tiny DiT's batch <= 15); past it the key falls back
MAX_PROGRAMS = 4


@contextlib.contextmanager
def serving_thread() -> Iterator[None]:
    """Within it, this thread's calls never load or compile a program (seconds to minutes): one that no
    loaded program fits runs eager, its program made behind it (``Precompiled``)."""
    _serving.on = True
    try:
        yield
    finally:
        _serving.on = False


def _nearest(key: Key, held: Sequence[Key]) -> str:
    """Where ``key`` differs from the nearest key with programs (the key's parts: the two modes, then an
    argument each), so that a log says what made a call need a program of its own."""
    if not held:
        return "no key has a program yet"
    differs = min(([i for i, (a, b) in enumerate(zip(key, k)) if a != b] for k in held), key=len)
    return f"parts {differs} differ from the nearest of {len(held)} keys with programs"


def specialisation(args: Sequence[object]) -> Key:
    """What makes a call need a program of its own: per tensor its sizes of 0 and 1 (others -1), dtype,
    device, contiguity and whether it is an inference tensor; any other argument itself; the grad and
    inference modes (a loaded program's guards expect the tensors' dispatch keys of the mode it was compiled
    and loaded in). Microseconds: it runs every call."""
    parts: list[object] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for a in args:
        if isinstance(a, Tensor):
            sizes = tuple(s if s < 2 else -1 for s in a.shape)
            parts.append((sizes, a.dtype, a.device, a.is_contiguous(), a.is_inference()))
        else:
            parts.append(a)
    return tuple(parts)


class Precompiled:
    """``fn(module, *args)`` run by a program of the call's specialisation key whose guards accept the call:
    those of ``root/<name>-<hash>.<i>.bin``, loaded at the key's first call, else one compiled ahead of time
    (``aot_compile``) and saved as the next file; where that fails, ``fallback(*args)`` (the same
    computation compiled by ``torch.compile``) from then on for the key."""

    def __init__(
        self,
        fn: Callable[..., Any],
        module: nn.Module,
        root: Path,
        name: str,
        fallback: Callable[..., Any],
        elsewhere: Elsewhere | None = None,
    ) -> None:
        """``elsewhere(module, name, root, args) -> saved``: a program the root lacks is first asked of it
        (``engine.flow.compile_child``), and compiled here only where it saved none that fits."""
        self.fn, self.module, self.root, self.name, self.fallback = fn, module, root, name, fallback
        self.elsewhere = elsewhere
        # key -> its programs, checked in order (as Dynamo's cache entries); None: the fallback
        self.programs: dict[Key, list[Any] | None] = {}
        self._lock = threading.Lock()  # one load or compile at a time, whichever thread calls first
        self._lock_behind = threading.Lock()  # around ``_behind`` (never held through a load or compile)
        self._warned = False
        self._identity: bytes | None = None  # the module's and its sources' part of every stem, read once
        self._behind: set[Key] = set()  # keys whose program a thread of their own is making (serving_thread)
        self._warm: set[Key] = set()  # keys on the fallback that have run it (compiled it) once
        self._eager: set[Key] = set()  # keys whose program (or fallback) failed to be made behind: eager

    def __call__(self, *args: Any) -> Any:
        key = specialisation(args)
        programs = self.programs.get(key, ())
        serving = getattr(_serving, "on", False)
        if programs is None and (key in self._warm or not serving):
            return self._fallen_back(key, args)
        for program in programs or ():  # mostly one; its guards run here, once (the program's own are off)
            if program.guard_check(self.module, *args):
                return program(self.module, *args)
        if serving:  # no program, or a fallback that has not compiled yet
            self._make_behind(key, args)
            return self.fn(self.module, *args)  # eager: milliseconds, where the compile is minutes
        program = self._program(key, args)
        return self._fallen_back(key, args) if program is None else program(self.module, *args)

    def _fallen_back(self, key: Key, args: Sequence[object]) -> Any:
        """``fallback(*args)``, and ``key`` marked as having compiled it (a serving thread may call it)."""
        out = self.fallback(*args)
        self._warm.add(key)
        return out

    def _make_behind(self, key: Key, args: Sequence[object]) -> None:
        """``key``'s program for ``args`` loaded or compiled on a thread of its own, once at a time per key
        (the calls meanwhile run eager); ``args`` are read for their shapes and kept until it ends."""
        with self._lock_behind:
            if key in self._behind or key in self._eager:
                return
            self._behind.add(key)
        log.warning(
            "%s: no program fits a serving call of %r (%s): eager until one is made behind it",
            self.name, key, _nearest(key, [k for k, p in self.programs.copy().items() if p]),  # copy: atomic
        )  # fmt: skip
        threading.Thread(target=self._behind_one, args=(key, args), name="precompile", daemon=True).start()

    def _behind_one(self, key: Key, args: Sequence[object]) -> None:
        grad, inference = bool(key[0]), bool(key[1])  # the caller's modes, which the program's guards check
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                if self._program(key, args) is None:  # the key falls back: torch.compile's program, here
                    self._fallen_back(key, args)
        except Exception as exc:  # anything the compile stack raises: the key's serving calls stay eager
            log.warning(
                "%s: no program could be made for %r (%s); its serving calls run eager", self.name, key, exc
            )
            self._eager.add(key)
        finally:
            with self._lock_behind:
                self._behind.discard(key)

    def stem(self, key: Key) -> str:
        """The name of ``key``'s files: a hash of torch's version, the module (``module_identity``, its
        package's source), this program's name and the key."""
        if self._identity is None:  # the package's files are read at the first key, not at every one
            identity = hashlib.sha256(module_identity(self.module).encode())
            for source in package_sources(type(self.module)):
                identity.update(source.read_bytes())
            self._identity = identity.digest()
        digest = hashlib.sha256(f"{torch.__version__} {self.name} {key!r}".encode())
        digest.update(self._identity)
        return f"{self.name}-{digest.hexdigest()[:24]}"

    def _program(self, key: Key, args: Sequence[object]) -> Any:
        """A program for ``args`` (on disk or compiled now, then kept); None: the fallback runs them."""
        with self._lock:
            stem = self.stem(key)
            if key not in self.programs:
                self.programs[key] = None if self._refused(key, stem) else self._loaded(stem)
            programs = self.programs[key]
            if programs is None:
                return None
            fit = self._fitting(programs, args)
            if fit is None and len(programs) >= MAX_PROGRAMS:
                return self._fall_back(key, f"{MAX_PROGRAMS} programs refused a call", None)
            if fit is None and self._made_elsewhere(args):
                programs[:] = self._loaded(stem)  # the child's file is the next of this stem
                fit = self._fitting(programs, args)
            if fit is None:
                # a key with no program yet that does not compile is noted: later starts skip its trace
                refused = None if programs else self._note(stem)
                fit = self._compiled(key, self.root / f"{stem}.{len(programs)}.bin", args, refused)
                if fit is not None:
                    programs.append(fit)
            return fit

    def _fitting(self, programs: list[Any], args: Sequence[object]) -> Any:
        """The first of ``programs`` whose guards accept ``args``, or None."""
        return next((p for p in programs if p.guard_check(self.module, *args)), None)

    def _made_elsewhere(self, args: Sequence[object]) -> bool:
        """``elsewhere`` (if any) saved a program for ``args`` under this root."""
        return self.elsewhere is not None and self.elsewhere(self.module, self.name, self.root, args)

    def _refused(self, key: Key, stem: str) -> bool:
        """A start before found that ``key`` does not compile whole (``stem``'s ``.refused`` note): the
        fallback from the first call, without tracing it again (tens of seconds on the H200 each start)."""
        note = self._note(stem)
        if not note.exists():
            return False
        log.info("%s: %s: it did not compile whole before; torch.compile runs %r", self.name, note.name, key)
        return True

    def _note(self, stem: str) -> Path:
        """Where a key that did not compile whole is noted."""
        return self.root / f"{stem}.refused"

    def _refuse(self, note: Path, exc: Exception) -> None:
        """Write ``note``: its key (no program yet) did not compile whole, so that later starts (same torch,
        same module and sources: the same stem) go straight to the fallback. Not for running out of
        memory, which another start may not."""
        if isinstance(exc, torch.OutOfMemoryError | MemoryError):
            return
        with contextlib.suppress(OSError):  # a read-only volume: the next start tries again
            note.parent.mkdir(parents=True, exist_ok=True)
            note.write_text(f"{exc!r}\n")

    def _loaded(self, stem: str) -> list[Any]:
        """The programs saved for ``stem``, in order; a file that does not load (corrupt, or written by an
        incompatible torch) is removed (logged), and its index compiled again when a call needs it."""
        programs = []
        for i in range(MAX_PROGRAMS):
            path = self.root / f"{stem}.{i}.bin"
            if not path.exists():
                break
            try:
                with path.open("rb") as f:
                    program: Any = torch.compiler.load_compiled_function(f, f_globals=self.fn.__globals__)
            except Exception as exc:  # unpickling a corrupt or incompatible file can raise anything
                self._warn("%s: %s did not load (%s); removed", self.name, path.name, exc)
                with contextlib.suppress(OSError):  # gone already, or a read-only volume
                    path.unlink()
                break
            program.disable_guard_check()  # __call__ checks them, once
            programs.append(program)
            log.info("%s: loaded %s", self.name, path.name)
        return programs

    def _compiled(self, key: Key, path: Path, args: Sequence[object], refused: Path | None) -> Any:
        """``fn`` compiled whole at ``args`` (the key's sizes of 0 and 1; other sizes symbolic) and saved to
        ``path``; None (the key falls back) where it does not trace whole (a graph break) or compile, then
        noted in ``refused`` (if given)."""
        # aot_compile cannot restart its analysis, as torch.compile does to specialise a Python float it
        # traced as a tensor (TensorifyScalarRestartAnalysis: v2's U-Net, torch 2.13): floats specialised
        # from the start instead
        floats = torch._dynamo.config.patch(specialize_float=True)
        try:
            # torch.compile gives its function an aot_compile only with this flag: on by default from
            # torch 2.13, off in 2.11 (the H200's image), where the API is otherwise the same
            with torch._dynamo.config.patch(enable_aot_compile=True):
                compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            with shape_config.patch(use_duck_shape=False), floats:  # type: ignore[attr-defined]
                program = compiled.aot_compile(((self.module, *args), {}))  # type: ignore[attr-defined]
        except Exception as exc:  # Dynamo and Inductor raise many kinds; each means: not this way
            if refused is not None:
                self._refuse(refused, exc)
            return self._fall_back(key, "it did not compile whole", exc)
        self._save(program, path)
        program.disable_guard_check()
        return program

    def _save(self, program: Any, path: Path) -> None:
        """Written to a temporary name, then renamed: a reader never sees half a file. A failure leaves the
        program serving this process (logged); the next start compiles it again."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            program.save_compiled_function(str(tmp))
            os.replace(tmp, path)
        except Exception as exc:  # pickling the program or the disk: either way it still serves
            with contextlib.suppress(OSError):  # none made, or no folder to hold it
                tmp.unlink()
            self._warn("%s: could not save %s (%s)", self.name, path.name, exc)
            return
        log.info("%s: saved %s", self.name, path.name)

    def _fall_back(self, key: Key, why: str, exc: object) -> None:
        """``key``'s calls run by the fallback from now on (a warning, once)."""
        self._warn("%s: %s; torch.compile runs it for %r (%s)", self.name, why, key, exc)
        self.programs[key] = None

    def _warn(self, message: str, *args: object) -> None:
        """The first failure a warning, later ones (the same cause at other keys, mostly) info."""
        log.log(logging.INFO if self._warned else logging.WARNING, message, *args)
        self._warned = True


def module_identity(module: nn.Module) -> str:
    """Which model a program was traced for, so that two sharing a folder keep apart: the class, its
    ``cfg`` (a dataclass, where it has one) and every parameter's and buffer's name, shape and dtype.
    Plain settings (``fold_masks``, ``training``) are left to the programs' guards: one that changes is
    a call they refuse, and so a program of its own beside the first."""
    cls = type(module)
    cfg = getattr(module, "cfg", None)
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(), *module.named_buffers())]
    return f"{cls.__module__}.{cls.__qualname__} {cfg if dataclasses.is_dataclass(cfg) else None!r} {tensors}"


def package_sources(cls: type) -> list[Path]:
    """The source files of ``cls``'s package (its directory): the code a trace of it may reach."""
    return sorted(Path(inspect.getfile(cls)).parent.glob("*.py"))
