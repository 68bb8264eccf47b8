"""The only place that knows CUDA vs Ascend NPU vs CPU: device choice, dtypes, sync, memory stats."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def npu_available() -> bool:
    """True when torch_npu is installed and sees a device (imports it: registers the ``npu`` backend)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (side effect: torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve(device: str = "auto") -> torch.device:
    """'auto' -> cuda, then npu, then cpu. An explicit device that is absent is an error."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("npu") if npu_available() else torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if device == "npu" and not npu_available():
        raise RuntimeError("--device npu asked for, but torch_npu is missing or sees no NPU")
    return torch.device(device)


def is_accelerator(device: torch.device) -> bool:
    return device.type in ("cuda", "npu")


def default_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """Compute dtype: fp32 on CPU (parity with the reference), bf16 on accelerators unless told otherwise."""
    if requested != "auto":
        return getattr(torch, requested)
    return torch.bfloat16 if is_accelerator(device) else torch.float32


def configure(device: torch.device) -> None:
    """Process-wide math settings for serving: TF32 matmuls on CUDA (cuDNN already uses TF32)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def cudnn_attention(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """While entered, SDPA tries cuDNN's fused attention first (it takes a dense mask as a bias, bf16 and
    fp16 only), then its usual kernels in their usual order (so float32 callers, Whisper's, still run).
    The choice is process-wide torch state, read when a call dispatches and when Inductor traces one.
    CUDA only: there is no cuDNN attention elsewhere, and asking for it there is a configuration error."""
    if device.type != "cuda":
        raise ValueError(f"cuDNN attention (flow_attention 'cudnn') needs a CUDA device, not {device.type}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)  # torch's order
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *kernels], set_priority=True)


def describe(device: torch.device) -> str:
    """The device's kind as compiled code depends on it: "cpu", or the accelerator's name and capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return device.type


def _runtime(device: torch.device) -> Any:
    """torch.cuda or torch.npu (torch_npu's mirror of it) for an accelerator; None on CPU."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return torch.npu  # type: ignore[attr-defined]
    return None


def empty_cache(device: torch.device) -> None:
    """Give cached, unused device memory back (after an out-of-memory error)."""
    if (rt := _runtime(device)) is not None:
        rt.empty_cache()


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def staging_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host buffer [nbytes] uint8 that copies to ``device`` go through: page-locked where it is an
    accelerator (a copy from it runs at the bus's speed instead of through the driver's own staging of
    pageable memory), plain host memory on the CPU. On an NPU (torch_npu's page-locked memory) untested."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_accelerator(device))


def synchronize(device: torch.device) -> None:
    if (rt := _runtime(device)) is not None:
        rt.synchronize(device)


def memory_mb(device: torch.device) -> float:
    """Device memory currently allocated by torch, in MiB (0 on CPU)."""
    rt = _runtime(device)
    return 0.0 if rt is None else rt.memory_allocated(device) / 2**20


def peak_memory_mb(device: torch.device) -> float:
    """The most device memory torch had allocated since the last ``reset_peak_memory`` (MiB; 0 on CPU)."""
    rt = _runtime(device)
    return 0.0 if rt is None else rt.max_memory_allocated(device) / 2**20


def free_memory_bytes(device: torch.device) -> int:
    """Device memory free now, by the driver (what other processes, vLLM's included, left); 0 on CPU."""
    rt = _runtime(device)
    return 0 if rt is None else int(rt.mem_get_info(device)[0])


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory, by the driver; 0 on CPU."""
    rt = _runtime(device)
    return 0 if rt is None else int(rt.mem_get_info(device)[1])


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for ``peak_memory_mb`` (per benchmark level)."""
    if (rt := _runtime(device)) is not None:
        rt.reset_peak_memory_stats(device)


def onnx_providers(device: torch.device) -> list[str]:
    """onnxruntime execution providers for the frontend's ONNX models on this device. On a GPU/NPU whose
    provider onnxruntime lacks (its CPU build: requirements.txt's), the speech tokenizer (0.5-0.9 GB at
    full size) runs on the CPU for every new voice: said once, loudly, with what to install."""
    import onnxruntime

    available = onnxruntime.get_available_providers()
    wanted = {"cuda": "CUDAExecutionProvider", "npu": "CANNExecutionProvider"}.get(device.type, "")
    if wanted in available:
        return [wanted, "CPUExecutionProvider"]
    if wanted:
        package = "onnxruntime-gpu" if device.type == "cuda" else "onnxruntime-cann"
        log.warning(
            "onnxruntime has no %s (it has %s): the speech tokenizer runs on the CPU, so each new voice's "
            "prompt takes longer; install %s built for this device's runtime in place of onnxruntime",
            wanted, ", ".join(available), package,
        )  # fmt: skip
    return ["CPUExecutionProvider"]


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def graphs_supported(device: torch.device) -> bool:
    """Whole-call graph capture/replay: CUDA only (Ascend's aclgraph is not wired up here)."""
    return device.type == "cuda"


# Uncaptured runs before a capture: one initialises every library handle and picks each kernel's algorithm
# (cuBLAS, cuDNN, Inductor's loaded kernels), as vLLM's own captures do (cudagraph_num_of_warmups 1). A
# capture is Python-bound (a flow graph ~1.5 s on an H200 host with two: 3 runs of a 10-step solve), and
# ~60 of them lie between a start and full speed
CAPTURE_WARMUPS = 1


class CapturedCall:
    """``fn`` recorded once on static tensors, replayed with new values copied into them (CUDA graphs).

    ``fn`` must not synchronise with the host; it returns a tensor or a tuple of tensors. A call returns
    copies of the static outputs: callers keep results across calls (a request's mel history), and the
    next replay rewrites the static tensors.
    """

    def __init__(
        self, fn, inputs: tuple[torch.Tensor, ...], pool=None, warmup: int = CAPTURE_WARMUPS, stream=None
    ):
        # Pass one side stream for many captures: the caching allocator keeps freed blocks per stream, so
        # with a fresh stream per capture no capture's warmup reuses the memory of the last one.
        stream = stream if stream is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # kernels pick their algorithms before capture
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: captures happen lazily in the token2wav thread while request threads (and ONNX
        # Runtime's speech tokenizer) may allocate or sync on the device; "global" would fail their calls
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            out = fn(*inputs)
        self.outputs: tuple[torch.Tensor, ...] = out if isinstance(out, tuple) else (out,)
        self.output = self.outputs[0]
        self.inputs = inputs

    def __call__(self, *values: torch.Tensor) -> torch.Tensor:
        """Replay; the first (or only) output."""
        return self.replay(*values)[0]

    def replay(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay; every output."""
        for static, value in zip(self.inputs, values):
            static.copy_(value)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


def worker_stream(device: torch.device, urgent: bool = False) -> Any | None:
    """A device stream for a worker thread to keep (CUDA; None elsewhere). ``urgent``: a high-priority one,
    whose queued kernels (a graph's too) the GPU schedules ahead of those of normal-priority streams (the
    default stream's) as blocks free up; running blocks are not preempted."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=-1 if urgent else 0)  # lower is sooner; 0 is the default's


def on_stream(stream: Any | None, after: Any | None = None) -> contextlib.AbstractContextManager[Any]:
    """The with-block's device work on ``stream`` (a ``worker_stream``; None: where it is), ordered after
    the work queued on ``after`` so far (an event wait on the device, no host sync)."""
    if stream is None:
        return contextlib.nullcontext()
    if after is not None:
        stream.wait_stream(after)
    return torch.cuda.stream(stream)


def current_stream(device: torch.device) -> Any | None:
    """The calling thread's current device stream (CUDA); None elsewhere (no streams to order)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def used_on(tensor: torch.Tensor, stream: Any | None) -> None:
    """``tensor``, made on this thread's stream, is used on ``stream`` from now on: once it is freed its
    memory is not reused until ``stream``'s work queued by then is done (the caching allocator keeps freed
    blocks per stream: a block freed by another stream's thread could otherwise be written under its reads).
    A no-op without a stream or off CUDA."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)


def capture_stream():
    """A side stream for warming up and capturing graphs (share it between captures)."""
    return torch.cuda.Stream()


def graph_pool():
    """A memory pool that several captured calls share (they never run at the same time)."""
    return torch.cuda.graph_pool_handle()


MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_PIPE, MPS_LOG = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # a client's SM share, read when its context is created
# a client's scheduling priority, read when its context is created: 0 normal (the default), 1 below normal,
# whose kernels' blocks wait while a normal client's are ready to run
MPS_PRIORITY, MPS_BELOW_NORMAL = "CUDA_MPS_CLIENT_PRIORITY", "1"
# a Unix socket's path holds at most 107 bytes; the daemon's sockets live in the pipe directory
MPS_PIPE_MAX_CHARS = 80
# Sends ``quit`` once its stdin reaches end of file: when ``CudaMps.close`` closes it, or when this process
# ends in any way (its end of the pipe closes with it), so a crash does not leave a daemon behind. The
# daemon lets its current clients finish before it exits.
MPS_QUIT_WAIT_S = 5.0  # close() waits at most this long for the quit to be passed on (seconds)
_MPS_STOPPER = (
    "import subprocess, sys; sys.stdin.buffer.read(); subprocess.run([sys.argv[1]], input=b'quit\\n')"
)


class CudaMps:
    """A CUDA MPS control daemon of our own (``nvidia-cuda-mps-control -d``) for this process and the ones
    it starts (vLLM's engine core): their kernels share the GPU side by side through one MPS server
    instead of in time slices between separate contexts. Its pipe and log directories go under ``root``
    and into this process's environment, which the processes it starts later inherit.

    Start it before anything in this process initialises CUDA: a process connects to MPS when CUDA first
    initialises, or never. Nothing here changes the GPU's settings (its compute mode stays as it is).
    Every failure to start raises with the reason.
    """

    def __init__(self, root: Path, timeout_s: float = 30.0, required: bool = True):
        self.pipe, self.log_dir, self.timeout_s = root / "pipe", root / "log", timeout_s
        self.required = required  # False (auto): no server after the start is a warning, not an error
        self.exe: str | None = None
        self.stopper: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CudaMps:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.exe = self._executable()
        self._check_environment()
        for d in (self.pipe, self.log_dir):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._ask("get_server_list").returncode == 0:
            raise RuntimeError(
                f"--cuda-mps: an MPS daemon already answers on {self.pipe}; stop it first "
                f"(echo quit | {MPS_PIPE}={self.pipe} {MPS_CONTROL})"
            )
        # its output to a file, not a pipe: the daemon it forks may keep the pipe open for as long as it runs
        out = self.log_dir / "start.out"
        with out.open("wb") as sink:
            rc = subprocess.run(
                [self.exe, "-d"], env=self._env(), stdout=sink, stderr=sink, timeout=self.timeout_s
            )
        if rc.returncode != 0:
            raise RuntimeError(
                f"--cuda-mps: {MPS_CONTROL} -d failed (rc {rc.returncode}): "
                f"{out.read_text(errors='replace').strip()} {self._log_tail()}"
            )
        # from here on the daemon is told to quit however this process goes on (or ends)
        self.stopper = subprocess.Popen(
            [sys.executable, "-c", _MPS_STOPPER, self.exe],
            stdin=subprocess.PIPE,
            env=self._env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._until_answering()
        except BaseException:
            self.close()
            raise
        os.environ.update(self._env_vars())
        log.info("CUDA MPS: control daemon started (pipe %s, log %s)", self.pipe, self.log_dir)

    def connect(self, device: str, sm_percent: int | None = None, below_normal: bool = False) -> torch.device:
        """Resolve ``device`` (it must be CUDA) and create this process's context on it now, as an MPS
        client that may fill ``sm_percent`` of the SMs (None: all), at below-normal priority where
        ``below_normal``. Both hold for this context only: the processes started later (vLLM's engine core)
        keep every SM and the normal priority, so their kernels go first."""
        client = {MPS_THREADS: str(sm_percent)} if sm_percent is not None else {}
        if below_normal:
            client[MPS_PRIORITY] = MPS_BELOW_NORMAL
        with _environment(client):
            try:  # CUDA's initialisation, where a process connects to MPS, then its first allocation
                dev = resolve(device)
                if dev.type == "cuda":
                    torch.empty(1, device=dev)
            except RuntimeError as err:  # a server that cannot start shows as no device or a CUDA error
                raise RuntimeError(
                    f"--cuda-mps: no CUDA context through MPS: {err} {self._log_tail()}"
                ) from err
            if dev.type != "cuda":
                raise RuntimeError(f"--cuda-mps needs a CUDA device, and this engine runs on {dev.type}")
        if sm_percent is not None:
            log.info("CUDA MPS: this process's kernels may fill %d %% of the SMs", sm_percent)
        if below_normal:
            log.info("CUDA MPS: this process's kernels at below-normal priority (vLLM's LM: normal)")
        return dev

    def servers(self) -> list[int]:
        """The MPS servers' process ids: one runs once a client (this process, vLLM's) initialised CUDA."""
        answer = self._ask("get_server_list")
        if answer.returncode != 0:
            raise RuntimeError(f"--cuda-mps: the MPS daemon does not answer: {answer.stderr.strip()}")
        return [int(word) for word in answer.stdout.split() if word.isdigit()]

    def check_serving(self) -> list[int]:
        """After CUDA's initialisation: raise unless an MPS server runs (else nobody became its client, as
        when CUDA initialised before the daemon started); returns the servers' ids."""
        found = self.servers()
        if not found and not self.required:
            log.warning("CUDA MPS (auto): the daemon runs but no MPS server does: the GPU is time-sliced")
            return found
        if not found:
            raise RuntimeError(
                "--cuda-mps: the MPS daemon runs but no MPS server does, so neither this process nor vLLM's "
                f"engine core is its client (was CUDA initialised before it started?) {self._log_tail()}"
            )
        log.info("CUDA MPS: serving through server(s) %s", found)
        return found

    def close(self) -> None:
        """Tell the daemon to quit (it lets its clients, this process included, finish first)."""
        for name in self._env_vars():
            os.environ.pop(name, None)
        stopper, self.stopper = self.stopper, None
        if stopper is not None and stopper.stdin is not None:
            stopper.stdin.close()
            # the quit delivered before close returns: a start right after must not find the old daemon
            # answering, nor have a late quit stop the new one (the front end only passes the command on)
            with contextlib.suppress(subprocess.TimeoutExpired):
                stopper.wait(MPS_QUIT_WAIT_S)
            log.info("CUDA MPS: the control daemon was told to quit")

    def _executable(self) -> str:
        exe = shutil.which(MPS_CONTROL)
        if exe is None:
            raise RuntimeError(
                f"--cuda-mps: {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)"
            )
        return exe

    def _check_environment(self) -> None:
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "--cuda-mps: CUDA is already initialised in this process, which would not be "
                "an MPS client: start MPS before anything uses the GPU"
            )
        if os.environ.get(MPS_PIPE):
            raise RuntimeError(
                f"--cuda-mps: {MPS_PIPE} is already set ({os.environ[MPS_PIPE]}): an MPS "
                "daemon is configured outside the engine; leave --cuda-mps off to use it"
            )
        if len(str(self.pipe)) > MPS_PIPE_MAX_CHARS:
            raise RuntimeError(
                f"--cuda-mps: the pipe directory {self.pipe} is longer than "
                f"{MPS_PIPE_MAX_CHARS} characters (its sockets would not fit): use a shorter "
                "cache root"
            )

    def _env_vars(self) -> dict[str, str]:
        return {MPS_PIPE: str(self.pipe), MPS_LOG: str(self.log_dir)}

    def _env(self) -> dict[str, str]:
        return os.environ | self._env_vars()

    def _ask(self, command: str) -> subprocess.CompletedProcess[str]:
        """One command to the daemon through its front end (rc != 0: no daemon answers)."""
        if self.exe is None:
            raise RuntimeError("CudaMps: start first")
        return subprocess.run(
            [self.exe],
            input=command + "\n",
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
        )

    def _until_answering(self) -> None:
        """The daemon forks away from ``-d`` and opens its pipe a moment later: ask until it answers."""
        deadline = time.monotonic() + self.timeout_s
        while (answer := self._ask("get_server_list")).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--cuda-mps: the MPS daemon did not answer within {self.timeout_s:.0f} s: "
                    f"{answer.stderr.strip()} {self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self, lines: int = 5) -> str:
        """The daemon's and its server's last log lines, for an error message."""
        tails = []
        for name in ("control.log", "server.log"):
            path = self.log_dir / name
            if path.is_file():
                tails.append(f"({name}: " + " | ".join(path.read_text().splitlines()[-lines:]) + ")")
        return " ".join(tails)


def mps_auto_skip(device: str, lm_in_own_process: bool) -> str | None:
    """Why CUDA MPS in auto stays off here (None: start it), decided before this process initialises CUDA
    (NVML counts the devices). MPS lets the LM's kernels in vLLM's engine core run beside the flow's here
    instead of in time slices: it pays only with the LM in a process of its own."""
    if device not in ("auto", "cuda"):
        return f"the device is {device}"
    if not lm_in_own_process:
        return "the LM runs in this process (native backend)"
    if torch.cuda.is_initialized():
        return "CUDA is already initialised in this process"
    if os.environ.get(MPS_PIPE):
        return f"{MPS_PIPE} is set: an MPS daemon outside the engine is in charge"
    if shutil.which(MPS_CONTROL) is None:
        return f"{MPS_CONTROL} is not on PATH"
    if torch.version.cuda is None or torch.cuda.device_count() == 0:
        return "no CUDA device"
    return None


@contextlib.contextmanager
def auto_mps(root: Path, device: str, lm_in_own_process: bool):
    """``CudaMps`` where ``mps_auto_skip`` finds nothing against it, else None; a daemon that fails to start
    is logged and the engine goes on time-sliced (``--cuda-mps`` makes each of these an error)."""
    skip = mps_auto_skip(device, lm_in_own_process)
    if skip is not None:
        log.info("CUDA MPS (auto): off, %s", skip)
        yield None
        return
    mps = CudaMps(root, required=False)
    try:
        mps.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        log.warning("CUDA MPS (auto): not started, the GPU is time-sliced: %s", err)
        yield None
        return
    try:
        yield mps
    finally:
        mps.close()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in this process's environment while entered; what was there before afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
