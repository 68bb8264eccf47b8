"""bench/gpu/run.sh, the H200 recipe, on the CPU: the part-per-call unpack installs only once every part is
in, steps that need vLLM stop with a clear message before it is, bad arguments are refused, and compare
prints the before/after table."""

from __future__ import annotations

import io
import json
import lzma
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xz") is None, reason="bash, xz")


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout holding run.sh and a two-part stand-in bundle in .vb/ (as `run.sh bundle` lays it out)."""
    root = tmp_path / "repo"
    (root / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "gpu" / "run.sh", root / "bench" / "gpu" / "run.sh")
    package = tar_bytes({"vllm/__init__.py": b"__version__ = 'stand-in'\n"})
    slim = lzma.compress(package, format=lzma.FORMAT_XZ)
    bundle = tar_bytes({"vllm-slim.tar.xz": slim})
    half = len(bundle) // 2
    (root / ".vb").mkdir()
    (root / ".vb" / "bundle.part.aa").write_bytes(bundle[:half])
    (root / ".vb" / "bundle.part.ab").write_bytes(bundle[half:])
    (root / ".vb" / "PARTS").write_text("bundle.part.aa\nbundle.part.ab\n")
    return root


def run_sh(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "VB": str(root.parent / "vb"),
        "SITE": str(root.parent / "site"),
        "OUT": str(root.parent / "out"),
        "CACHE": str(root.parent / "cache"),
        "HOME": str(root.parent / "home"),
    }
    cmd = ["bash", str(root / "bench" / "gpu" / "run.sh"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def carry_only(root: Path, part: str) -> None:
    """What one device call sees: PARTS and this one part (the others stayed on the earlier calls)."""
    for p in (root / ".vb").glob("bundle.part.*"):
        if p.name != part:
            p.rename(root.parent / p.name)
    if not (root / ".vb" / part).exists():
        (root.parent / part).rename(root / ".vb" / part)


def test_unpack_installs_once_the_last_part_arrives(checkout: Path) -> None:
    site = checkout.parent / "site"
    carry_only(checkout, "bundle.part.aa")
    first = run_sh(checkout, "unpack")
    assert first.returncode == 0, first.stderr
    assert "parts still to come: bundle.part.ab" in first.stdout
    assert not (site / "vllm").exists()
    carry_only(checkout, "bundle.part.ab")
    second = run_sh(checkout, "unpack")
    assert second.returncode == 0, second.stderr
    assert (site / "vllm" / "__init__.py").read_text() == "__version__ = 'stand-in'\n"
    assert (site / ".vllm-done").exists()


def test_steps_that_need_vllm_stop_before_unpack(checkout: Path) -> None:
    steps = (
        ("gpu-tests",), ("check", "v3"), ("bench", "v3", "stream", "1,16"), ("speed", "v3", "after"),
        ("kernels", "v2"), ("startup", "v3"), ("capacity", "v3"), ("overlap", "v3"), ("aot-check", "v3"),
        ("weights", "v3"),
    )  # fmt: skip
    for args in steps:
        done = run_sh(checkout, *args)
        assert done.returncode == 2
        assert "vLLM is not installed" in done.stderr and "unpack" in done.stderr


def test_a_startup_pair_runs_in_either_order(checkout: Path, monkeypatch) -> None:
    """B_FLAGS adds a second warm start (B) after A; B_FIRST=1 puts it before A (pairs alternate), the
    cold start staying first; B_FIRST without a pair to turn, or another value, stops at once."""
    root = checkout.parent / "filled-root"
    (root / "compile").mkdir(parents=True)
    monkeypatch.setenv("STARTUP_ROOT", str(root))
    monkeypatch.setenv("B_FLAGS", "--no-lm-handover")
    for runs, first, order in (("warm", "0", "warm warm-b"), ("warm", "1", "warm-b warm"),
                               ("cold warm", "1", "cold warm-b warm")):  # fmt: skip
        monkeypatch.setenv("RUNS", runs)
        monkeypatch.setenv("B_FIRST", first)
        done = run_sh(checkout, "startup", "v3")  # as far as the missing vLLM install
        assert f"starts, in order: {order}\n" in done.stdout and "vLLM is not installed" in done.stderr
    monkeypatch.setenv("B_FIRST", "yes")
    assert "B_FIRST: 0 or 1, got 'yes'" in run_sh(checkout, "startup", "v3").stderr
    monkeypatch.setenv("B_FIRST", "1")
    monkeypatch.delenv("B_FLAGS")
    assert "B_FIRST=1 needs B_FLAGS" in run_sh(checkout, "startup", "v3").stderr


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "usage"),
        (("fly",), "unknown step 'fly'"),
        (("bench", "v4", "stream", "1"), "FAMILY must be v2 or v3"),
        (("bench", "v3"), "usage: run.sh bench"),
        (("compare", "a.json"), "usage: run.sh compare"),
        (("speed", "v3"), "usage: run.sh speed"),
        (("speed", "v5", "after"), "FAMILY must be v2 or v3"),
        (("kernels",), "usage: run.sh kernels"),
        (("capacity",), "usage: run.sh capacity"),
        (("capacity", "v4"), "FAMILY must be v2 or v3"),
        (("kernels", "v4"), "FAMILY must be v2 or v3"),
        (("startup",), "usage: run.sh startup"),
        (("startup", "v4"), "FAMILY must be v2 or v3"),
        (("aot-check",), "usage: run.sh aot-check"),
        (("aot-check", "v4"), "FAMILY must be v2 or v3"),
        (("overlap",), "usage: run.sh overlap"),
        (("overlap", "v4"), "FAMILY must be v2 or v3"),
        (("check",), "usage: run.sh check"),
        (("check", "v4"), "FAMILY must be v2 or v3"),
        (("weights",), "usage: run.sh weights"),
        (("weights", "v4"), "FAMILY must be v2 or v3"),
    ],
)
def test_bad_arguments_are_refused_with_the_usage(checkout: Path, args: tuple[str, ...], message: str):
    done = run_sh(checkout, *args)
    assert done.returncode == 2 and message in done.stderr


def test_compile_caches_go_out_in_parts_and_come_back_on_a_fresh_machine(checkout: Path) -> None:
    """cache-out packs the engine's and vLLM's compile caches into $OUT; carried back in .cc/, cache-in
    restores them where they were (a fresh machine then loads kernels instead of compiling them)."""
    kernel = checkout.parent / "cache" / "compile" / "inductor" / "fx" / "graph.py"
    vllm = checkout.parent / "home" / ".cache" / "vllm" / "torch_compile_cache" / "model.bin"
    assert "no compile cache" in run_sh(checkout, "cache-out").stderr
    for path, data in ((kernel, b"compiled"), (vllm, os.urandom(20_000))):
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
    done = run_sh(checkout, "cache-out")
    assert done.returncode == 0, done.stderr
    out = checkout.parent / "out"
    parts = sorted(out.glob("compile-cache.tgz.*"))
    assert [p.name for p in parts] == ["compile-cache.tgz.aa"] and "1 part(s)" in done.stdout
    assert (out / "compile-cache.PARTS").read_text().split() == ["compile-cache.tgz.aa"]
    assert "carry .cc/compile-cache.PARTS" in run_sh(checkout, "cache-in").stderr
    # a cache of two parts (a stand-in second one), carried a part a call: restored once both are in
    whole = parts[0].read_bytes()
    half = len(whole) // 2
    (out / "compile-cache.tgz.aa").write_bytes(whole[:half])
    (out / "compile-cache.tgz.ab").write_bytes(whole[half:])
    (out / "compile-cache.PARTS").write_text("compile-cache.tgz.aa\ncompile-cache.tgz.ab\n")
    data = vllm.read_bytes()
    shutil.rmtree(checkout.parent / "cache")
    shutil.rmtree(checkout.parent / "home")
    (checkout / ".cc").mkdir()
    for name in ("compile-cache.tgz.aa", "compile-cache.tgz.ab"):
        for old in (checkout / ".cc").glob("compile-cache.tgz.*"):
            old.unlink()  # what one call carries: the list and this part
        shutil.copy(out / "compile-cache.PARTS", checkout / ".cc")
        shutil.copy(out / name, checkout / ".cc")
        done = run_sh(checkout, "cache-in")
        assert done.returncode == 0, done.stderr
        if name.endswith("aa"):
            assert "cache parts still to come: compile-cache.tgz.ab" in done.stdout and not kernel.exists()
    assert kernel.read_bytes() == b"compiled" and vllm.read_bytes() == data


def test_compare_prints_the_before_after_table(tmp_path: Path) -> None:
    def results(ttfa: float, git: str) -> dict:
        level = {
            "system": "cosystream", "mode": "stream", "concurrency": 1, "requests": 8, "underrun_requests": 0,
            "ttfa_ms": {"p50": ttfa, "p95": ttfa}, "rtf": {"p50": 0.1}, "audio_s_per_s": 9.0,
        }  # fmt: skip
        return {"meta": {"model": "m", "command": "python -m bench", "git": git}, "levels": [level]}

    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(results(200.0, "a")))
    after.write_text(json.dumps(results(150.0, "b")))
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu" / "run.sh"), "compare", str(before), str(after)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "200 -> 150 (-25%)" in done.stdout


def test_capacity_arms_are_checked_before_anything_runs(checkout: Path, monkeypatch) -> None:
    """ARMS: ab (both arms in one load, the default) or one arm per call (a fresh machine rarely fits two
    loads in one); a wrong name stops at once."""
    monkeypatch.setenv("ARMS", "after,middle")
    done = run_sh(checkout, "capacity", "v3")
    assert done.returncode == 2 and "ARMS: ab, or before, after, lm-first and/or lm-host, got 'middle'" in (
        done.stderr
    )
    for arms in ("after", "ab"):
        monkeypatch.setenv("ARMS", arms)
        done = run_sh(checkout, "capacity", "v3")  # a good arm gets as far as the missing vLLM install
        assert done.returncode == 2 and "vLLM is not installed" in done.stderr


@pytest.mark.parametrize(
    ("arm", "lever"),
    [("lm-first", "--mps-flow-below-normal"), ("lm-host", "--lm-host")],
)
def test_a_process_level_arm_is_a_load_of_its_own(checkout: Path, monkeypatch, arm: str, lever: str) -> None:
    """ARMS=after,lm-first (this process's MPS context below normal: an MPS client's priority is fixed when
    its context is made) and lm-host,after (vLLM's client in a process of its own: the layout is fixed at
    the load): no in-load A/B, so two bench runs one after the other in the order given, only the arm's
    with its flag, each its own output folder."""
    calls = fake_device(checkout, monkeypatch)
    order = ["after", arm] if arm == "lm-first" else [arm, "after"]
    monkeypatch.setenv("ARMS", ",".join(order))
    monkeypatch.setenv("RATES", "4")
    done = run_sh(checkout, "capacity", "v3", "--prompt-spread")
    assert done.returncode == 0, done.stderr
    runs = dict(zip(order, bench_calls(calls)))
    assert lever not in runs["after"] and lever in runs[arm] and "--prompt-spread" in runs[arm]
    assert flag(runs[arm], "--out").endswith(f"/v3_capacity_{arm}") and flag(runs[arm], "--rate") == "4"


def fake_device(checkout: Path, monkeypatch) -> Path:
    """vLLM marked installed and a ``python3`` on PATH that logs each call's arguments (one line a call) to
    the returned file: what a step would run, without running it."""
    site, bin_dir, calls = checkout.parent / "site", checkout.parent / "bin", checkout.parent / "calls.txt"
    site.mkdir(exist_ok=True)
    (site / ".vllm-done").write_text("")
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def bench_calls(calls: Path) -> list[list[str]]:
    return [line.split() for line in calls.read_text().splitlines() if line.startswith("-m bench ")]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_capacity_measures_each_rate_in_a_steady_state_with_two_seeds(checkout: Path, monkeypatch) -> None:
    """The recipe's defaults: 120 s of arrivals a rate (100 requests at least), seeds 0 and 1, a 20-s warm-up
    load; ARMS=after is one arm of today's defaults; ALL_RATES=1 measures every rate; the step says how long
    measuring takes (2 seeds x (120 s + drain) a rate and arm) and when that passes its limit."""
    calls = fake_device(checkout, monkeypatch)
    monkeypatch.setenv("ARMS", "after")
    monkeypatch.setenv("ALL_RATES", "1")
    done = run_sh(checkout, "capacity", "v3")
    assert done.returncode == 0, done.stderr
    (argv,) = bench_calls(calls)
    assert flag(argv, "--rate") == "2,3,4" and flag(argv, "--seeds") == "0,1"
    assert flag(argv, "--arrival-s") == "120" and flag(argv, "--min-requests") == "100"
    assert flag(argv, "--warmup-arrival-s") == "20" and "--find-capacity" in argv and "--all-rates" in argv
    assert "--ab" not in argv and "--t2w-relaxed-cap" not in argv  # today's defaults
    assert flag(argv, "--out").endswith("/v3_capacity_after")
    # 3 rates x 2 seeds x (120 + 15) s, + the warm-up's 20 + 15 s: past the 540 s a call allows
    assert "up to 845 s of measuring" in done.stdout and "passes LIMIT_S=540" in done.stdout
    monkeypatch.setenv("LIMIT_S", "1100")  # 845 s, but not with the load's ~280 s
    calls.unlink()
    assert "passes LIMIT_S=1100" in run_sh(checkout, "capacity", "v3").stdout
    calls.unlink()
    monkeypatch.delenv("ALL_RATES")
    monkeypatch.setenv("ARMS", "ab")
    monkeypatch.setenv("RATES", "3")
    monkeypatch.setenv("LIMIT_S", "1500")  # a detached step's
    done = run_sh(checkout, "capacity", "v3")
    assert done.returncode == 0, done.stderr
    (argv,) = bench_calls(calls)
    assert flag(argv, "--ab") == "yield" and flag(argv, "--rate") == "3" and "--all-rates" not in argv
    assert flag(argv, "--out").endswith("/v3_capacity_ab-yield")
    # one rate x 2 seeds x 2 arms fits a detached step beside its load
    assert "up to 575 s of measuring" in done.stdout and "passes LIMIT_S" not in done.stdout
    assert "plus each arm's load (~280 s warm" in done.stdout
    calls.unlink()
    monkeypatch.setenv("AB", "quiet-first,first-lane")  # A and one arm a lever, in one load
    done = run_sh(checkout, "capacity", "v3")
    (argv,) = bench_calls(calls)
    assert flag(argv, "--ab") == "quiet-first,first-lane"
    assert flag(argv, "--out").endswith("/v3_capacity_ab-quiet-first_and_first-lane")
    assert "up to 845 s of measuring" in done.stdout and "x 3 arm runs" in done.stdout
    calls.unlink()
    monkeypatch.setenv("AB", "first-lane+fast-start-on")  # one B arm with both levers on
    done = run_sh(checkout, "capacity", "v2")
    (argv,) = bench_calls(calls)
    assert flag(argv, "--ab") == "first-lane+fast-start-on"
    assert flag(argv, "--out").endswith("/v2_capacity_ab-first-lane_with_fast-start-on")
    assert "x 2 arm runs" in done.stdout


def test_overlap_arms_are_checked_before_anything_runs(checkout: Path, monkeypatch) -> None:
    monkeypatch.setenv("ARMS", "sliced,mps,priority")
    done = run_sh(checkout, "overlap", "v2")
    assert done.returncode == 2
    assert "ARMS: sliced, mps, mps-share, default-stream, batch4 or ras-eager, got 'priority'" in done.stderr
    monkeypatch.setenv("ARMS", "mps,mps-share,default-stream,batch4,ras-eager")
    done = run_sh(checkout, "overlap", "v2")  # good arms get as far as the missing vLLM install
    assert done.returncode == 2 and "vLLM is not installed" in done.stderr


def test_startup_runs_are_checked_before_anything_runs(checkout: Path, monkeypatch) -> None:
    """RUNS picks the starts: a cold then a warm one (the default), warm ones only on a root an earlier
    step filled (none there: stopped), or the cold one alone; anything else stops at once, before the root
    is touched."""
    root = checkout.parent / "filled-root"
    (root / "compile").mkdir(parents=True)
    monkeypatch.setenv("STARTUP_ROOT", str(root))
    for runs in ("warm cold", "hot", "cold cold"):
        monkeypatch.setenv("RUNS", runs)
        done = run_sh(checkout, "startup", "v3")
        assert done.returncode == 2 and f"RUNS: 'cold warm', 'warm' or 'cold', got '{runs}'" in done.stderr
    for runs in ("warm", "cold warm", "cold"):
        monkeypatch.setenv("RUNS", runs)
        done = run_sh(checkout, "startup", "v3")  # good runs get as far as the missing vLLM install
        assert done.returncode == 2 and "vLLM is not installed" in done.stderr
    assert (root / "compile").is_dir()
    monkeypatch.setenv("STARTUP_ROOT", str(checkout.parent / "no-root"))
    monkeypatch.setenv("RUNS", "warm")  # a warm start on no root would be a cold one labelled warm
    done = run_sh(checkout, "startup", "v3")
    assert done.returncode == 2 and "RUNS=warm needs the root a cold start of this hold filled" in done.stderr
    monkeypatch.setenv("RUNS", "cold")  # the cold start makes its root
    assert "vLLM is not installed" in run_sh(checkout, "startup", "v3").stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("soak-start",), "usage: run.sh soak-start"),
        (("soak-start", "v4", "4"), "FAMILY must be v2 or v3"),
        (("soak-start", "v3", "4", "--slots"), "RATE and MINUTES are numbers"),
        (("soak-start", "v3", "fast"), "RATE and MINUTES are numbers"),
        (("soak-start", "v3", "4", "25"), "vLLM is not installed"),
        (("soak-collect", "v3"), "usage: run.sh soak-collect"),
        (("soak-collect", "v3", "4"), "no soak was started"),
        (("soak",), "usage: run.sh soak"),
    ],
)
def test_soak_steps_check_their_arguments(checkout: Path, monkeypatch, args: tuple[str, ...], message: str):
    monkeypatch.setenv("SOAK_DIR", str(checkout.parent / "soaks"))
    done = run_sh(checkout, *args)
    assert done.returncode == 2 and message in done.stderr


def test_soak_collect_waits_for_a_running_soak_then_brings_back_its_files(checkout: Path, monkeypatch):
    """A soak started by soak-start in an earlier call: collect says it is still running while its process
    lives (status 3), then copies soak.json, soak.md and the log to $OUT and exits with the soak's status."""
    monkeypatch.setenv("SOAK_DIR", str(checkout.parent / "soaks"))
    monkeypatch.setenv("LIMIT_S", "1")
    soak = checkout.parent / "soaks" / "soak_v3_rate4"
    soak.mkdir(parents=True)
    running = subprocess.Popen(["sleep", "60"])
    try:
        (soak / "pid").write_text(f"{running.pid}\n")
        (soak / "soak.log").write_text("bench.soak: t=   10 s  requests 40 done\n")
        done = run_sh(checkout, "soak-collect", "v3", "4")
        assert done.returncode == 3 and "still running" in done.stdout and "t=   10 s" in done.stdout
    finally:
        running.kill()
        running.wait()
    (soak / "soak.json").write_text("{}")
    (soak / "soak.md").write_text("# Open-loop soak: 4 requests/s for 25 min\nResult: **FAIL**\n")
    (soak / "rc").write_text("1\n")
    done = run_sh(checkout, "soak-collect", "v3", "4")
    assert done.returncode == 1 and "# Open-loop soak: 4 requests/s" in done.stdout
    out = checkout.parent / "out" / "soak_v3_rate4"
    assert sorted(p.name for p in out.iterdir()) == ["soak.json", "soak.log", "soak.md"]


def test_soak_collect_reports_a_soak_that_died_without_a_status(checkout: Path, monkeypatch):
    monkeypatch.setenv("SOAK_DIR", str(checkout.parent / "soaks"))
    soak = checkout.parent / "soaks" / "soak_v2_rate2.5"
    soak.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (soak / "pid").write_text(f"{gone.pid}\n")
    (soak / "soak.log").write_text("Killed\n")
    done = run_sh(checkout, "soak-collect", "v2", "2.5")
    assert done.returncode == 2 and "ended without an exit status" in done.stderr and "Killed" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("detach",), "usage: run.sh detach STEP"),
        (("detach", "unpack"), "detach runs one of bench|capacity"),
        (("detach", "capacity", "v3"), "vLLM is not installed"),
        (("collect",), "nothing was detached"),
    ],
)
def test_detach_steps_check_their_arguments(checkout: Path, monkeypatch, args: tuple[str, ...], message: str):
    monkeypatch.setenv("DETACH_DIR", str(checkout.parent / "detached"))
    done = run_sh(checkout, *args)
    assert done.returncode == 2 and message in done.stderr


def test_collect_waits_for_the_detached_step_and_brings_back_what_it_wrote(checkout: Path, monkeypatch):
    """A step detached in an earlier call: collect brings back its files so far and says it still runs
    (status 3) while its process lives; once it has ended, everything, with the step's own status."""
    monkeypatch.setenv("DETACH_DIR", str(checkout.parent / "detached"))
    monkeypatch.setenv("LIMIT_S", "1")
    step = checkout.parent / "detached"
    (step / "out" / "v3_capacity_ab-burst-start").mkdir(parents=True)
    (step / "out" / "v3_capacity_ab-burst-start.log").write_text("rate 1 done\n")
    (step / "run.log").write_text("v3_capacity_ab-burst-start rc=... loading\n")
    running = subprocess.Popen(["sleep", "60"])
    try:
        (step / "pid").write_text(f"{running.pid}\n")
        done = run_sh(checkout, "collect")
        assert done.returncode == 3 and "still running" in done.stdout and "loading" in done.stdout
    finally:
        running.kill()
        running.wait()
    out = checkout.parent / "out"
    assert (out / "v3_capacity_ab-burst-start.log").read_text() == "rate 1 done\n"
    (step / "out" / "v3_capacity_ab-burst-start" / "results.json").write_text("{}")
    (step / "rc").write_text("124\n")  # the step's own time limit cut it
    done = run_sh(checkout, "collect")
    assert done.returncode == 124 and (out / "v3_capacity_ab-burst-start" / "results.json").is_file()
    assert "loading" in (out / "detached.log").read_text()


def wheel(folder: Path, name: str, body: bytes) -> Path:
    """A minimal pure-Python wheel ``name``-0.1 whose package's __init__ holds ``body``."""
    import zipfile

    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    return path


def test_carried_server_wheels_install_into_the_same_site(checkout: Path) -> None:
    """A SERVER=0 bundle's machine gets app.py's wheels from a later call carrying .whl/ alone."""
    for part in ("bundle.part.aa", "bundle.part.ab"):
        carry_only(checkout, part)
        assert run_sh(checkout, "unpack").returncode == 0
    shutil.rmtree(checkout / ".vb")  # the wheels' call carries one folder of .whl only
    (checkout / ".whl" / "2").mkdir(parents=True)
    wheel(checkout / ".whl" / "2", "multipart_standin", b"VERSION = 1\n")
    done = run_sh(checkout, "unpack")
    assert done.returncode == 0, done.stderr
    assert "installed 1 carried wheels" in done.stdout
    site = checkout.parent / "site"
    assert (site / "multipart_standin" / "__init__.py").read_text() == "VERSION = 1\n"
    assert (site / "vllm" / "__init__.py").exists() and (site / ".vllm-done").exists()


def bundle_checkout(tmp_path: Path, slim_bytes: int) -> Path:
    """A git checkout holding run.sh, a stand-in ``../shared/tools/vllm-bundle.sh`` beside it (its one part:
    a tar of ``slim_bytes`` of vllm-slim.tar.xz) and a ``python3`` whose pip download fetches nothing."""
    root = tmp_path / "repo"
    (root / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "gpu" / "run.sh", root / "bench" / "gpu" / "run.sh")
    notes = root / "bench" / "notes"  # small files: on disk each takes a whole block, far more than its size
    notes.mkdir()
    for i in range(40):
        (notes / f"n{i}.txt").write_text(f"{i}\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "bench"], check=True)
    tools, bin_dir = tmp_path / "shared" / "tools", tmp_path / "bin"
    tools.mkdir(parents=True)
    bin_dir.mkdir()
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "vllm-slim.tar.xz").write_bytes(os.urandom(slim_bytes))
    script = f'mkdir -p "$1" && tar -C {payload} -cf "$1/vllm-bundle.part.aa" .\n'
    (tools / "vllm-bundle.sh").write_text(script)
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python3").chmod(0o755)
    return root


SPARE = 1000  # CALL_SPARE of room_env's calls


def room_env(tmp_path: Path, root: Path, room: int) -> dict[str, str]:
    """run.sh's environment for a call that carries ``room`` bytes beside ``root`` (and the spare), with
    bundle_checkout's stand-in tools first on the path."""
    env = os.environ | {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "CALL_BYTES": str(tree_bytes(root) + SPARE + room),
        "CALL_SPARE": str(SPARE),
    }
    env.pop("PART_MB", None)
    return env


def tree_bytes(root: Path) -> int:
    listed = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True, check=True)
    # what the files take on disk in whole blocks (st_blocks counts 512-byte units), as the device tool counts
    return sum((root / name).stat().st_blocks * 512 for name in listed.stdout.split())


@pytest.mark.skipif(shutil.which("git") is None, reason="git")
def test_server_wheels_come_in_folders_that_each_fit_a_call_beside_the_checkout(tmp_path: Path) -> None:
    """The server's wheels (Gradio alone is ~32 MB) go into .whl/1, .whl/2, ..., each at most what a call
    carries beside the checkout, largest first into the first folder with room: here 600 + 300 + 100 kB
    and 500 kB, for a room of 1 MB."""
    root = bundle_checkout(tmp_path, 1000)
    sizes = {"big": 600_000, "mid": 500_000, "small": 300_000, "tiny": 100_000}
    writes = "".join(f'head -c {n} /dev/zero > "$d/{name}-1-py3-none-any.whl"\n' for name, n in sizes.items())
    pip = f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -d ] && d=$2; shift; done\n{writes}'
    (tmp_path / "bin" / "python3").write_text(pip)
    env = room_env(tmp_path, root, 1_000_000)
    cmd = ["bash", "bench/gpu/run.sh", "server-wheels"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    folders = {f.name: sorted(w.name.split("-")[0] for w in f.iterdir()) for f in (root / ".whl").iterdir()}
    assert folders == {"1": ["big", "small", "tiny"], "2": ["mid"]}
    assert ".whl/1 .whl/2" in done.stdout
    env = room_env(tmp_path, root, 500_000)  # the largest wheel (as Gradio's) would not fit
    refused = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "does not fit beside the checkout" in refused.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="git")
def test_bundle_parts_fit_a_call_beside_the_checkout(tmp_path: Path) -> None:
    """With no PART_MB, each part is at most what a call carries less the checkout (and a spare): a larger
    checkout makes more, equal parts, which joined give back the bundle."""
    root = bundle_checkout(tmp_path, 300_000)
    room = 70_000
    env = room_env(tmp_path, root, room)
    cmd = ["bash", "bench/gpu/run.sh", "bundle"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = (root / ".vb" / "PARTS").read_text().split()
    sizes = [(root / ".vb" / n).stat().st_size for n in names]
    whole = b"".join((root / ".vb" / n).read_bytes() for n in names)
    assert len(names) == -(-len(whole) // room)  # the fewest parts that fit: ceil(size / room)
    assert max(sizes) <= room + len(names) and max(sizes) - min(sizes) <= len(names)
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        slim = tar.extractfile("./vllm-slim.tar.xz")
        assert slim is not None and len(slim.read()) == 300_000
    # a checkout with no room left for a part is refused by name, before the parts it has are touched
    env["CALL_BYTES"] = str(tree_bytes(root) + SPARE)
    refused = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "leaves no room for a bundle part" in refused.stderr
    assert (root / ".vb" / "PARTS").read_text().split() == names


@pytest.mark.skipif(shutil.which("git") is None, reason="git")
def test_resplit_fits_the_parts_beside_a_checkout_that_grew(tmp_path: Path) -> None:
    """``resplit`` (no network) joins the parts .vb/ holds in PARTS' order and splits them again for the
    room a call leaves now: a smaller room makes more parts, which join to the same bytes; a missing part
    is refused by name, the parts left as they were."""
    root = bundle_checkout(tmp_path, 300_000)
    (root / ".git" / "info" / "exclude").write_text("/.vb/\n")  # as in the project's .gitignore

    def run(step: str, room: int) -> subprocess.CompletedProcess[str]:
        cmd, env = ["bash", "bench/gpu/run.sh", step], room_env(tmp_path, root, room)
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)

    done = run("bundle", 160_000)
    assert done.returncode == 0, done.stderr
    before = (root / ".vb" / "PARTS").read_text().split()
    whole = b"".join((root / ".vb" / n).read_bytes() for n in before)
    done = run("resplit", 70_000)
    assert done.returncode == 0, done.stderr
    names = (root / ".vb" / "PARTS").read_text().split()
    assert len(before) == 2 and len(names) == -(-len(whole) // 70_000) == 5
    assert sorted(p.name for p in (root / ".vb").glob("bundle.part.*")) == names
    assert b"".join((root / ".vb" / n).read_bytes() for n in names) == whole
    (root / ".vb" / names[1]).unlink()
    refused = run("resplit", 50_000)
    assert refused.returncode != 0 and f"these are missing: {names[1]}" in refused.stderr
    assert (root / ".vb" / "PARTS").read_text().split() == names


def test_gpu_tests_runs_every_test_file_that_holds_a_gpu_test() -> None:
    """``run.sh gpu-tests`` lists its files (the rest import the UI, which the device lacks): a file with a
    ``gpu``-marked test that is not listed would never run on the device. The fault tests kill vLLM's
    engine core and run on their own (``run.sh gpu-tests tests/reliability/test_gpu_faults.py``)."""
    script = (REPO / "bench" / "gpu" / "run.sh").read_text(encoding="utf-8")
    listed = script.split("GPU_TESTS=(", 1)[1].split(")", 1)[0].split()
    marked = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if path != Path(__file__) and "pytest.mark.gpu" in path.read_text(encoding="utf-8")
    )
    assert sorted([*listed, "tests/reliability/test_gpu_faults.py"]) == marked
