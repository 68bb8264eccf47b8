"""One cache root (--cache-dir, else COSYSTREAM_CACHE, else ~/.cache/cosystream) for every writer: models,
the compile caches (Inductor, Triton, vLLM), vLLM's exported LM, saved voices; the Docker image's env."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine import cache_root as roots
from engine.cache_root import COMPILE_DIRS, ENV, cache_root, configured_root, use_cache_root

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    """No cache variable from the outside; what use_cache_root sets is undone after the test."""
    for name in (ENV, *COMPILE_DIRS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(roots, "_ours", {})
    yield monkeypatch
    for name in COMPILE_DIRS:
        os.environ.pop(name, None)


def test_the_flag_wins_over_the_environment_which_wins_over_home(clean_env, tmp_path):
    assert configured_root() is None and cache_root() == Path.home() / ".cache" / "cosystream"
    clean_env.setenv(ENV, str(tmp_path / "env"))
    assert cache_root() == configured_root() == tmp_path / "env"
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"


def test_the_compile_caches_follow_the_root_but_an_operators_choice_stays(clean_env, tmp_path):
    assert use_cache_root(tmp_path / "a") == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "a" / "compile" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "a" / "compile" / "triton"),
        "VLLM_CACHE_ROOT": str(tmp_path / "a" / "vllm-cache"),
    }
    clean_env.setenv("TRITON_CACHE_DIR", "/operator/triton")
    moved = use_cache_root(tmp_path / "b")  # ours follow the new root, the operator's stays
    assert moved["VLLM_CACHE_ROOT"] == str(tmp_path / "b" / "vllm-cache")
    assert moved["TRITON_CACHE_DIR"] == "/operator/triton"


def test_torchs_own_inductor_default_is_no_operators_choice(clean_env, tmp_path):
    """Importing torch._dynamo before the load writes Inductor's /tmp default into the environment: a
    warm start would then compile into a /tmp that a restarted Space or pod no longer has."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert roots.inductor_default() == default_cache_dir()  # the same rule as torch's
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    moved = use_cache_root(tmp_path)
    assert moved["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "operator"))
    assert use_cache_root(tmp_path / "b")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "operator")


def test_the_engine_writes_compile_caches_voices_and_demo_models_under_the_env_root(clean_env, tmp_path):
    """No --cache-dir: COSYSTREAM_CACHE alone places everything (the Docker image sets only it)."""
    import engine.serving.engine as engine_module
    from engine.config import EngineConfig
    from engine.flow.graphs import GraphedCFM
    from server.cli import build_engine
    from tests.sounds import write_wav

    root = tmp_path / "root"
    clean_env.setenv(ENV, str(root))
    clean_env.setattr(engine_module.devices, "graphs_supported", lambda dev: True)  # the compile cache's path
    clean_env.setattr(GraphedCFM, "precapture", lambda self, b, t, dev, later=None: 0)
    cfg = EngineConfig(model="demo-tiny", device="cpu", backend="native", hift_graphs=False, flow_reuse=False)
    eng = build_engine(cfg)
    try:
        assert eng.model.model_dir == root / "demo-tiny"  # the demo model is built under the root
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "compile" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(root / "compile" / "triton")
        assert os.environ["VLLM_CACHE_ROOT"] == str(root / "vllm-cache")
        converted = sorted(p.name.split("-")[0] for p in (root / "weights").rglob("*.safetensors"))
        assert converted == ["flow", "hift", "llm"]  # the next start maps these
        eng.add_voice("mine", str(write_wav(tmp_path / "p.wav", 2.0)), "a prompt")
        assert [p for p in (root / "voices").rglob("*") if p.is_file()]  # the saved voice's files
    finally:
        eng.close()


def test_hub_models_download_under_the_configured_root(clean_env, tmp_path):
    import engine.serving.engine as engine_module
    from engine.config import EngineConfig
    from engine.serving.engine import TTSEngine

    asked: list[str | None] = []

    def resolve(model: str, cache_dir: str | None, variant: str):
        asked.append(cache_dir)
        raise LookupError("stop here")

    clean_env.setattr(engine_module, "resolve_model", resolve)
    for cfg_dir, env in ((None, None), (None, tmp_path / "env"), (str(tmp_path / "flag"), tmp_path / "env")):
        if env is not None:
            clean_env.setenv(ENV, str(env))
        with pytest.raises(LookupError):
            TTSEngine.load(EngineConfig(model="owner/name", cache_dir=cfg_dir))
    # no root chosen: the hub's own cache (HF_HOME / MODELSCOPE_CACHE); else <root>/owner/name
    assert asked == [None, str(tmp_path / "env"), str(tmp_path / "flag")]


def dockerfile_env() -> dict[str, str]:
    """The image's ENV (one multi-line instruction), ARG defaults substituted."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    (env_line,) = re.findall(r"^ENV (.+)$", text, re.M)
    pairs = dict(re.findall(r"(\w+)=(\S+)", env_line))
    return {k: re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], v) for k, v in pairs.items()}


def test_the_docker_images_cache_root_is_read_and_lies_on_its_volume(clean_env):
    env = dockerfile_env()
    (volume,) = re.findall(r'^VOLUME \["([^"]+)"\]', (REPO / "Dockerfile").read_text(), re.M)
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert cache_root() == Path(env[ENV]) and cache_root().is_relative_to(volume)
    import importlib

    from server import cli

    args = importlib.reload(cli).parse_args([])
    cfg = cli.engine_config(args)
    assert (cfg.model, cfg.device) == (env["COSYSTREAM_MODEL"], env["COSYSTREAM_DEVICE"])
    assert cache_root(cfg.cache_dir) == Path(env[ENV])
    # every COSYSTREAM_ variable the image sets is read somewhere in the product code
    sources = "".join(
        p.read_text() for d in ("engine", "api", "webui", "server") for p in (REPO / d).rglob("*.py")
    )
    sources += (REPO / "app.py").read_text()
    unread = [n for n in env if n.startswith("COSYSTREAM_") and f'"{n}"' not in sources]
    assert unread == []
