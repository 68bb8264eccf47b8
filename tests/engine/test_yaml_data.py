"""The released yaml read as data: tags become mappings, refs and arithmetic resolve, nothing executes."""

from __future__ import annotations

import pytest

from engine.yaml_data import ARGS_KEY, TAG_KEY, read_yaml, tag_of

YAML = """
__set_seed1: !apply:random.seed [1986]
chunk_size: 25
token_mel_ratio: 2
qwen_pretrain_path: ''
llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_k: 25
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
evil: !new:os.system ["touch /tmp/should-not-exist"]
"""


def test_tags_refs_and_arithmetic(tmp_path):
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(YAML)
    data = read_yaml(path, {"qwen_pretrain_path": "/models/x/CosyVoice-BlankEN"})
    assert tag_of(data["llm"]) == "Qwen2LM" and data["llm"][TAG_KEY] == "new:cosyvoice.llm.llm.Qwen2LM"
    assert data["llm"]["llm"]["pretrain_path"] == "/models/x/CosyVoice-BlankEN"
    assert data["llm"]["sampling"]["top_k"] == 25 and tag_of(data["llm"]["sampling"]) == "ras_sampling"
    assert data["flow"]["static_chunk_size"] == 50
    assert data["__set_seed1"][ARGS_KEY] == [1986]
    assert data["evil"] == {TAG_KEY: "new:os.system", ARGS_KEY: ["touch /tmp/should-not-exist"]}


def test_a_ref_expression_with_code_is_refused(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 2\nb: !ref <a> + __import__('os').getpid()\n")
    with pytest.raises(ValueError, match="unsupported"):
        read_yaml(path)
