"""The LM's prompt embedding rows on the host: the same prefix as the LM's own lookup, without the device."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidInput
from engine.lm.lm_config import SpeechLMConfig
from engine.lm.prompt_table import PromptTable
from engine.lm.speech_lm import SpeechLM


def tiny_lm(family: str, dtype: torch.dtype = torch.float32) -> SpeechLM:
    config = SpeechLMConfig(
        family=family, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
        intermediate_size=32, text_vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return SpeechLM(config).to(dtype).eval()


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hosts_prefix_is_the_lms_own_bit_for_bit(family, dtype):
    """sos and task come from v2's llm_embedding, v3's speech table: the host's gather gives the tensor
    SpeechLM.prefix_embeds gives, with and without the prompt's parts (instruct2, cross-lingual)."""
    lm = tiny_lm(family, dtype)
    table = PromptTable.of(lm)
    speech = lm.config.speech_token_size
    cases = [([5, 9, 63], [1, 2], [0, 7, speech - 1]), ([5, 9], [], []), ([3], [4, 8], [])]
    with torch.inference_mode():
        for text, prompt, speech_ids in cases:
            want = lm.prefix_embeds(*(torch.tensor(x, dtype=torch.long) for x in (text, prompt, speech_ids)))
            got = table.prefix(text, prompt, speech_ids)
            assert got.device.type == "cpu" and got.dtype == dtype
            assert torch.equal(got, want), (family, text, prompt, speech_ids)
    assert table.prefix([5], [], []).shape == (3, 16)  # sos, one text row, task


def test_ids_outside_a_table_are_the_callers_error():
    table = PromptTable.of(tiny_lm("cosyvoice3"))
    with pytest.raises(InvalidInput, match=r"text token ids must lie in \[0, 64\), got \[3, 64\]"):
        table.prefix([3, 64], [], [])
    with pytest.raises(InvalidInput, match="text token ids"):
        table.prefix([3], [-1], [])
    with pytest.raises(InvalidInput, match="prompt speech token ids"):
        table.prefix([3], [], [table.speech.shape[0]])


def test_a_cpu_lm_shares_its_tables_and_the_specials_are_copies():
    """On the CPU the host's tables are the LM's own (no second 0.5 GB); the two special rows are copies, so
    they hold no view of a table."""
    lm = tiny_lm("cosyvoice3")
    table = PromptTable.of(lm)
    assert table.text.data_ptr() == lm.embed_tokens.weight.data_ptr()
    assert table.speech.data_ptr() == lm.speech_embedding.weight.data_ptr()
    assert table.sos._base is None and table.task._base is None
    assert torch.equal(table.task, lm.special(lm.config.task_id))
