"""engine/hub.py: model directory validation and hub resolution (downloads are monkeypatched: no network)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import hub
from engine.errors import ModelError

V3_ID = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"


def make_layout(root: Path, family: str = "cosyvoice3", rl: bool = False, skip: tuple[str, ...] = ()) -> Path:
    """A fake model directory: empty files are enough for path checks."""
    for name in hub.required_files(family) + ((hub.RL_LLM,) if rl else ()):
        if name not in skip:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(b"")
    return root


@pytest.mark.parametrize(("family", "tokenizer"), [("cosyvoice2", "v2"), ("cosyvoice3", "v3")])
def test_local_directory_is_validated(tmp_path, family, tokenizer):
    model = hub.resolve_model(str(make_layout(tmp_path, family)))
    assert model.family == family and model.root == tmp_path
    assert model.yaml == tmp_path / f"{family}.yaml"
    assert model.speech_tokenizer == tmp_path / f"speech_tokenizer_{tokenizer}.onnx"
    assert model.llm == tmp_path / "llm.pt" and model.llm_variant == "base"
    assert model.qwen == tmp_path / "CosyVoice-BlankEN" and model.spk2info is None
    for path in (model.flow, model.hift, model.campplus):
        assert path.is_file()


def test_missing_files_are_listed(tmp_path):
    make_layout(tmp_path, skip=("hift.pt", "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/vocab.json"))
    with pytest.raises(ModelError) as err:
        hub.validate_model_dir(tmp_path)
    message = str(err.value)
    assert "missing: hift.pt, speech_tokenizer_v3.onnx, CosyVoice-BlankEN/vocab.json" in message
    assert "llm.pt" not in message.split("missing:")[1].split(".")[0]
    assert "cosyvoice3.yaml" in message  # the full list of what the directory needs


def test_family_needs_exactly_one_yaml(tmp_path):
    with pytest.raises(ModelError, match=r"no cosyvoice2\.yaml or cosyvoice3\.yaml"):
        hub.validate_model_dir(tmp_path)
    (tmp_path / "cosyvoice.yaml").write_text("")
    with pytest.raises(ModelError, match="v1"):
        hub.validate_model_dir(tmp_path)
    make_layout(tmp_path, "cosyvoice2")
    make_layout(tmp_path, "cosyvoice3")
    with pytest.raises(ModelError, match="both"):
        hub.validate_model_dir(tmp_path)


def test_rl_variant_picks_rl_weights_or_warns(tmp_path, caplog):
    with_rl = make_layout(tmp_path / "a", rl=True)
    model = hub.validate_model_dir(with_rl, "rl")
    assert model.llm == with_rl / "llm.rl.pt" and model.llm_variant == "rl"
    assert hub.validate_model_dir(with_rl, "base").llm == with_rl / "llm.pt"
    without = make_layout(tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="engine.hub"):
        model = hub.validate_model_dir(without, "rl")
    assert model.llm == without / "llm.pt" and model.llm_variant == "base"
    assert "llm.rl.pt" in caplog.text


def test_git_lfs_pointer_is_explained(tmp_path):
    make_layout(tmp_path)
    (tmp_path / "flow.pt").write_bytes(
        b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1\n"
    )
    with pytest.raises(ModelError, match="git lfs pull"):
        hub.validate_model_dir(tmp_path)


def test_not_a_directory_nor_an_id():
    with pytest.raises(ModelError, match="neither an existing directory nor a hub id"):
        hub.resolve_model("/no/such/model/dir")


def failing(name):
    def fetch(*args, **kwargs):
        raise ConnectionError(f"{name} unreachable")

    return fetch


def test_failed_download_gives_one_clear_message(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "_installed", lambda module: True)
    monkeypatch.setattr(hub, "download_modelscope", failing("modelscope.cn"))
    monkeypatch.setattr(hub, "download_huggingface", failing("huggingface.co"))
    with pytest.raises(ModelError) as err:
        hub.resolve_model(V3_ID, cache_dir=str(tmp_path))
    message = str(err.value)
    assert V3_ID in message
    assert "ModelScope: ConnectionError: modelscope.cn unreachable" in message
    assert "Hugging Face: ConnectionError: huggingface.co unreachable" in message
    assert str(tmp_path / V3_ID) in message  # exactly where to put the files
    for name in (
        "cosyvoice3.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
    ):
        assert name in message
    assert "CosyVoice-BlankEN/" in message


def test_failed_download_without_cache_dir_or_hubs(monkeypatch):
    monkeypatch.setattr(hub, "_installed", lambda module: False)
    with pytest.raises(ModelError) as err:
        hub.resolve_model("iic/CosyVoice2-0.5B")
    assert "no hub client installed" in str(err.value) and "--model /path/to/dir" in str(err.value)
    assert "cosyvoice2.yaml" in str(err.value) and "speech_tokenizer_v2.onnx" in str(err.value)


def test_download_then_reuse_without_network(monkeypatch, tmp_path):
    calls = []

    def fake_hf(repo_id, target, skip):
        calls.append((repo_id, target, tuple(skip)))
        return str(make_layout(target, "cosyvoice2"))

    monkeypatch.setattr(hub, "_installed", lambda module: module == "huggingface_hub")
    monkeypatch.setattr(hub, "download_huggingface", fake_hf)
    model = hub.resolve_model("iic/CosyVoice2-0.5B", cache_dir=str(tmp_path))
    assert model.family == "cosyvoice2" and model.root == tmp_path / "iic/CosyVoice2-0.5B"
    repo_id, target, skip = calls[0]
    assert target == model.root
    assert repo_id == "FunAudioLLM/CosyVoice2-0.5B"  # the Hugging Face twin of the ModelScope id
    assert "llm.rl.pt" in skip and "*.batch.onnx" in skip
    monkeypatch.setattr(hub, "download_huggingface", failing("offline"))
    assert hub.resolve_model("iic/CosyVoice2-0.5B", cache_dir=str(tmp_path)).root == model.root


def test_modelscope_first_then_huggingface(monkeypatch, tmp_path):
    order = []

    def fake_hf(repo_id, target, skip):
        order.append("hf")
        return str(make_layout(target, rl=True))

    def bad_ms(*args):
        order.append("ms")
        raise OSError("ModelScope down")

    monkeypatch.setattr(hub, "_installed", lambda module: True)
    monkeypatch.setattr(hub, "download_modelscope", bad_ms)
    monkeypatch.setattr(hub, "download_huggingface", fake_hf)
    model = hub.resolve_model(V3_ID, cache_dir=str(tmp_path), llm_variant="rl")
    assert order == ["ms", "hf"] and model.llm.name == "llm.rl.pt"


def test_client_kwargs_filtered_to_the_signature():
    def old_client(model_id, cache_dir=None):
        return model_id

    assert hub._supported(old_client, {"local_dir": "/x", "cache_dir": "/c"}) == {"cache_dir": "/c"}
