"""Any Hugging Face causal LM: three chat-template families, none with ``<|latent|>`` built in.

Each family is a tiny random model of its own architecture (Qwen3 / Llama / OLMo-2) with a
byte-level BPE tokenizer trained here, in that family's format: ChatML as Qwen3 writes it (tool
results as ``<tool_response>`` user turns, ``<think>`` on the last turn), Llama 3 headers
(``<|start_header_id|>user<|end_header_id|>\\n\\n``, tool results as ``ipython``, eos
``<|end_of_text|>`` but turns ending with ``<|eot_id|>``, an untied head) and Tulu/OLMo
(``<|user|>\\n`` as plain text, not a special token; turns end with the eos). ``lopd model prepare``
must make each usable: the sentinel added, the reference block placed by the template's own header,
latent injection exact, and the whole pipeline (bank, cold start, one LOPD step) running.
"""

import copy
import json
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as bpe_models
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils.chat_template_utils import render_jinja_template

from lopd import agent, chat, latent, models, pipeline, policies, trainer
from lopd.cli import main
from lopd.composer import Composer, ComposerPolicy
from lopd.config import ComposerConfig
from lopd.envs import get_env
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.teacher import action_logits, scoring_batch

SPEC = ComposerConfig(num_latents=4, depth=2, num_heads=4, max_experience_tokens=96)
SIZES = {"train": 12, "eval": 2, "pretrain": 0}
ENV_SETS = ["--set", "env.train_size=12", "--set", "env.eval_size=2", "--set", "env.pretrain_size=0"]

# Tools as one signature line each, in every family: the tiny models read short prompts.
_TOOL_LINES = ("{%- for tool in tools -%}{%- set fn = tool.function if tool.function is defined "
               "else tool -%}{{- '\\n' + fn.name + '(' + (fn.parameters.properties.keys() | "
               "join(', ')) + ')' -}}{%- endfor -%}")

QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' or tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}{{- '\\n\\n# Tools\\n<tools>' -}}" + _TOOL_LINES + "{{- '\\n</tools>' -}}"
    "{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}{%- if message.role == 'user' -%}"
    "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if loop.last and loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0].role == 'system' or tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\\n' -}}{%- endif -%}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}{{- '\\n\\nFunctions:' -}}" + _TOOL_LINES + "{%- endif -%}"
    "{{- '<|eot_id|>' -}}{%- endif -%}"
    "{%- for message in messages -%}{%- if not (loop.first and message.role == 'system') -%}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}")

# OLMo-2's template (Tulu format), plus a tool role and the tool list (OLMo-2's own drops tool
# messages: see test_prepare_refuses_a_template_that_drops_tool_results).
OLMO2_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{{- '<|system|>\\n' + message.content -}}"
    "{%- if tools -%}{{- '\\nFunctions:' -}}" + _TOOL_LINES + "{%- endif -%}{{- '\\n' -}}"
    "{%- elif message.role == 'user' -%}{{- '<|user|>\\n' + message.content + '\\n' -}}"
    "{%- elif message.role == 'tool' -%}{{- '<|tool|>\\n' + message.content + '\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if not loop.last -%}{{- '<|assistant|>\\n' + message.content + eos_token + '\\n' -}}"
    "{%- else -%}{{- '<|assistant|>\\n' + message.content + eos_token -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Family:
    template: str
    header: str
    """The first user message's opening, as text."""
    turn_end: str
    eos: str
    pad: str
    bos: str | None
    special: tuple[str, ...]
    arch: str
    llama_split: bool = False
    tied: bool = True


FAMILIES = {
    "chatml": Family(QWEN3_TEMPLATE, "<|im_start|>user\n", "<|im_end|>", eos="<|im_end|>",
                     pad="<|endoftext|>", bos=None, arch="qwen3",
                     special=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
    "llama3": Family(LLAMA3_TEMPLATE, "<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>",
                     eos="<|end_of_text|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                     arch="llama", llama_split=True, tied=False,
                     special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                              "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>")),
    "tulu": Family(OLMO2_TEMPLATE, "<|user|>\n", "<|endoftext|>", eos="<|endoftext|>", pad="<|pad|>",
                   bos="<|endoftext|>", arch="olmo2", llama_split=True,
                   special=("<|endoftext|>", "<|pad|>")),
}


def conversations(env, tasks):
    """Toolworld-like conversations (the oracle's actions, short tool results) for a corpus."""
    for task in tasks:
        messages = [dict(m) for m in env.reset(task).messages()]
        for text in task.oracle_texts():
            messages.append({"role": "assistant", "content": text})
            if "Task Completed" not in text:
                messages.append({"role": "tool", "content": json.dumps({"status": "ok"})})
        yield messages, task.tools


def family_tokenizer(family: Family, corpus_template: str | None = None):
    """A byte-level BPE tokenizer trained on toolworld conversations in the family's format,
    with the family's special tokens and none of lopd's (no <|latent|>)."""
    template = corpus_template or family.template
    env = get_env("toolworld", seed=0, sizes=SIZES)
    specials = {"bos_token": family.bos or "", "eos_token": family.eos}
    texts = []
    for messages, tools in conversations(env, env.tasks("train")):
        rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                            chat_template=template, **specials)
        texts.append(rendered[0])
    core = Tokenizer(bpe_models.BPE())
    if family.llama_split:
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=700, special_tokens=list(family.special), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    named = {family.eos, family.pad, family.bos}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=family.eos, pad_token=family.pad, bos_token=family.bos,
        extra_special_tokens=[t for t in family.special if t not in named])
    tokenizer.chat_template = template
    tokenizer.padding_side = "left"
    return tokenizer


def family_model(family: Family, tokenizer, seed: int = 0):
    """A random tiny model of the family's architecture (hidden 64, 2 layers)."""
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2048, tie_word_embeddings=family.tied,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                 bos_token_id=tokenizer.bos_token_id)
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM),
                             "olmo2": (Olmo2Config, Olmo2ForCausalLM)}[family.arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**shape, **({"head_dim": 16} if family.arch == "qwen3" else {})))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, family, source folder, prepared folder, `lopd model prepare` figures)."""
    name = request.param
    fam = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    tokenizer = family_tokenizer(fam)
    assert chat.LATENT_TOKEN not in tokenizer.get_vocab()
    models.save_model(family_model(fam, tokenizer), tokenizer, root / "source")
    figures = root / "prepare.json"
    assert main(["model", "prepare", str(root / "source"), "--out", str(root / "prepared"),
                 "--json", str(figures)]) == 0
    return name, fam, root / "source", root / "prepared", json.loads(figures.read_text())


# ----------------------------------------------------------------------------------------------
# (a) prepare adds the sentinel, resizes, initialises its row with the mean


def test_prepare_adds_the_latent_token_with_the_mean_row(family):
    name, fam, source, prepared, figures = family
    before, old_tok = models.load_model(source)
    after, tokenizer = models.load_model(prepared)
    latent_id = tokenizer.convert_tokens_to_ids(chat.LATENT_TOKEN)
    assert figures["latent_token"] == "added" and figures["latent_id"] == latent_id == len(old_tok)
    assert len(tokenizer) == len(old_tok) + 1
    assert tokenizer.encode("a<|latent|><|latent|>b", add_special_tokens=False).count(latent_id) == 2
    old_rows = before.get_input_embeddings().weight
    new_rows = after.get_input_embeddings().weight
    assert new_rows.shape[0] == old_rows.shape[0] + 1 == after.config.vocab_size
    assert torch.equal(new_rows[:-1], old_rows)
    assert torch.allclose(new_rows[latent_id], old_rows.mean(0), atol=1e-6)
    tied = after.get_output_embeddings().weight is new_rows
    assert tied == fam.tied == figures["tied_embeddings"]
    if not tied:
        old_head, new_head = before.get_output_embeddings().weight, after.get_output_embeddings().weight
        assert torch.equal(new_head[:-1], old_head)
        assert torch.allclose(new_head[latent_id], old_head.mean(0), atol=1e-6)
    # The template's own end of turn stops generation (Llama 3: not the tokenizer's eos).
    turn_end = tokenizer.convert_tokens_to_ids(fam.turn_end)
    assert turn_end in TransformersEngine(after, tokenizer).stop_token_ids
    assert figures["turn_end_token"] == f"{fam.turn_end} (id {turn_end})"
    assert {c["check"] for c in figures["checks"] if c["ok"]} >= {
        "system message with tools", "tool-call assistant turn", "tool result message",
        "agent episode", "reference block placement", "<|latent|> token"}
    # Qwen3 re-renders the last assistant turn with an empty <think> block: rollouts then differ
    # from the template's rendering of their messages, which training does not need.
    optional = {c["check"]: c["ok"] for c in figures["checks"] if not c["required"]}
    assert optional == {"rollout text equals the template's": name != "chatml"}
    # A second prepare finds the token and changes nothing.
    assert not models.add_latent_token(after, tokenizer)
    assert len(tokenizer) == latent_id + 1


def test_info_reports_the_latent_token_and_the_checks(family, tmp_path, capsys):
    _, _, source, prepared, _ = family
    assert main(["model", "info", str(source), "--json", str(tmp_path / "src.json")]) == 0
    assert main(["model", "info", str(prepared), "--json", str(tmp_path / "prep.json")]) == 0
    src, prep = (json.loads((tmp_path / f).read_text()) for f in ("src.json", "prep.json"))
    assert src["latent_token"] is None and src["chat_template_checks"] == "failed: <|latent|> token"
    assert prep["latent_token"] == chat.LATENT_TOKEN and prep["chat_template_checks"] == "pass"
    assert prep["stops_at_turn_end"] and prep["turn_end_token"] == family[1].turn_end
    assert "reference block placement" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# The header comes from the template, and it is where the rollouts have it


def _oracle_rollouts(tokenizer, n=3):
    env = get_env("toolworld", seed=0, sizes=SIZES)
    return agent.run_episodes(env, env.tasks("train")[:n], policies.OraclePolicy(), tokenizer,
                              max_turns=8, max_new_tokens=96, batch_size=n)


def test_the_header_is_the_templates_own_and_opens_the_first_user_message(family):
    _, fam, _, prepared, _ = family
    tokenizer = models.load_tokenizer(prepared)
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    assert tokenizer.decode(fmt.header) == fam.header
    assert chat.turn_end_token(tokenizer) == fam.turn_end
    for rollout in _oracle_rollouts(tokenizer) + [agent.probe_rollout(tokenizer)]:
        assert rollout.reward == 1.0
        ids, at = latent.insert_reference(rollout.input_ids, fmt.latent_block(3), fmt)
        before = tokenizer.decode(ids[:at])
        after = tokenizer.decode(ids[at + len(fmt.latent_block(3)):])
        system, user = rollout.messages[0]["content"], rollout.messages[1]["content"]
        assert before.endswith(fam.header) and system in before and user not in before
        assert after.startswith(user)
        assert ids[at:at + len(fmt.latent_block(3))] == fmt.latent_block(3)


# Tulu closes the system text with a bare line break, which BPE merges with the text's last
# characters ("agent.\n"): no token is the template's alone, so the text goes right before the
# user header, after that line break.
SYSTEM_CLOSE = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "tulu": ""}


def test_system_placed_text_ends_the_system_message_in_every_template(family):
    name, fam, _, prepared, _ = family
    tokenizer = models.load_tokenizer(prepared)
    placement = latent.TextPlacement.for_tokenizer(tokenizer, "system", "\n\nReference: ")
    assert tokenizer.decode(placement.close) == SYSTEM_CLOSE[name]
    block = placement.text_block(tokenizer, ["cancel O1"])
    for rollout in _oracle_rollouts(tokenizer):
        ids, at = latent.insert_reference(rollout.input_ids, block, placement)
        assert ids[:at] + ids[at + len(block):] == rollout.input_ids
        before, after = tokenizer.decode(ids[:at]), tokenizer.decode(ids[at + len(block):])
        system, user = rollout.messages[0]["content"], rollout.messages[1]["content"]
        assert system in before and fam.header not in before
        assert after.startswith(SYSTEM_CLOSE[name] + fam.header + user)


def test_a_header_ending_in_a_space_that_merges_with_the_content(tmp_path):
    """"User: " + "Cancel" tokenises as "User", ":", " Cancel" under the Llama 3 split: the space
    belongs to the content's first token, so the header must stop at the colon."""
    template = ("{{- bos_token -}}{%- for message in messages -%}"
                "{%- if message.role == 'system' -%}{{- 'System: ' + message.content + '\\n\\n' -}}"
                "{%- elif message.role == 'user' -%}{{- 'User: ' + message.content + '\\n\\n' -}}"
                "{%- elif message.role == 'tool' -%}{{- 'Tool: ' + message.content + '\\n\\n' -}}"
                "{%- else -%}{{- 'Assistant: ' + message.content + eos_token + '\\n\\n' -}}{%- endif -%}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}")
    fam = Family(template, "User:", "<|eot|>", eos="<|eot|>", pad="<|pad|>", bos="<|bos|>",
                 arch="llama", llama_split=True, special=("<|bos|>", "<|eot|>", "<|pad|>"))
    tokenizer = family_tokenizer(fam)
    tokenizer.add_special_tokens({"extra_special_tokens": [chat.LATENT_TOKEN]})
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    assert tokenizer.decode(fmt.header) == "User:"
    for user in ("Cancel order O12.", "42 items", "[urgent] hold S1", "über"):
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": user}]
        ids = chat.render(tokenizer, messages)
        new, at = latent.insert_reference(ids, fmt.latent_block(2), fmt)
        assert tokenizer.decode(new[:at]).endswith("User:")
        assert tokenizer.decode(new[at + len(fmt.latent_block(2)):]).startswith(" " + user)


def test_templates_that_cannot_place_the_block_fail_in_one_line(tiny_tokenizer):
    broken = copy.deepcopy(tiny_tokenizer)
    broken.chat_template = ("{%- for m in messages -%}{%- if m.role != 'user' -%}"
                            "{{- m.role + ': ' + m.content + '\\n' -}}{%- endif -%}{%- endfor -%}")
    with pytest.raises(ValueError, match=r"^the chat template does not render a user message's "
                                         r"content \(no user role\?\)[^\n]*$"):
        latent.ReferenceFormat.for_tokenizer(broken)
    broken.chat_template = None
    with pytest.raises(ValueError, match="^the tokenizer has no chat template$"):
        latent.ReferenceFormat.for_tokenizer(broken)


def test_a_tokenizer_without_the_sentinel_is_told_to_prepare(family):
    _, _, source, _, _ = family
    with pytest.raises(ValueError, match="lopd model prepare"):
        latent.ReferenceFormat.for_tokenizer(models.load_tokenizer(source))


def test_prepare_refuses_a_template_that_drops_tool_results(tmp_path, capsys):
    """OLMo-2's own template has no branch for tool messages: the tool result never reaches the
    model, so prepare stops and writes nothing."""
    fam = FAMILIES["tulu"]
    tokenizer = family_tokenizer(fam)
    tokenizer.chat_template = fam.template.replace(
        "{%- elif message.role == 'tool' -%}{{- '<|tool|>\\n' + message.content + '\\n' -}}", "")
    models.save_model(family_model(fam, tokenizer), tokenizer, tmp_path / "olmo2")
    capsys.readouterr()
    assert main(["model", "prepare", str(tmp_path / "olmo2"), "--out", str(tmp_path / "out")]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert error.startswith("lopd model: error:") and "tool result message: missing" in error
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# (b) latent injection is exact on every family: generation and teacher scoring


def _known_ids(tokenizer, n):
    ids = tokenizer.encode("order status shipped refund policy", add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


def _pair(tokenizer, fmt, prompts, n):
    """Each prompt with a latent block, and with known tokens where the sentinels are."""
    known = fmt.latent_block(n)
    known[len(fmt.prefix):len(fmt.prefix) + n] = _known_ids(tokenizer, n)
    return ([latent.insert_reference(p, fmt.latent_block(n), fmt)[0] for p in prompts],
            [latent.insert_reference(p, known, fmt)[0] for p in prompts])


def test_latents_reproduce_the_plain_run_through_the_engine_and_the_composer_policy(family):
    _, _, _, prepared, _ = family
    model, tokenizer = models.load_model(prepared)
    model.eval()
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    env = get_env("toolworld", seed=0, sizes=SIZES)
    tasks = env.tasks("train")[:3]
    prompts = [chat.render(tokenizer, env.reset(t).messages(), t.tools, add_generation_prompt=True)
               for t in tasks]
    n = SPEC.num_latents
    known = model.get_input_embeddings()(torch.tensor([_known_ids(tokenizer, n)])).detach()
    with_latents, plain = _pair(tokenizer, fmt, prompts, n)
    engine = TransformersEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    reference = engine.generate(plain, params)
    spliced = engine.generate(with_latents, params, latents=known.expand(len(prompts), -1, -1))
    for a, b in zip(reference, spliced):
        assert a.token_ids == b.token_ids
        assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-5

    # The Base + Composer agent inserts the block by the same header and splices at prefill.
    composer = Composer(copy.deepcopy(model), tokenizer, SPEC).eval()
    policy = ComposerPolicy(TransformersEngine(composer.base, tokenizer), composer, None, params,
                            n_ret=1)
    policy._latents_for = lambda ts: known.expand(len(ts), -1, -1)
    contexts = [policies.TurnContext(t, 0, p) for t, p in zip(tasks, prompts)]
    for a, b in zip(reference, policy.act(contexts, 12, tokenizer)):
        assert a.token_ids == b.token_ids
        assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-5


def test_latents_reproduce_the_plain_run_through_the_teacher(family):
    _, _, _, prepared, _ = family
    model, tokenizer = models.load_model(prepared)
    model.eval()
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    rollouts = _oracle_rollouts(tokenizer, 2) + [agent.probe_rollout(tokenizer)]
    n = SPEC.num_latents
    known_block = fmt.latent_block(n)
    known_block[len(fmt.prefix):len(fmt.prefix) + n] = _known_ids(tokenizer, n)
    ids, masks = [r.input_ids for r in rollouts], [r.action_mask for r in rollouts]
    pad = tokenizer.pad_token_id
    with_latents = scoring_batch(ids, masks, pad, [fmt.latent_block(n)] * len(rollouts), fmt)
    plain = scoring_batch(ids, masks, pad, [known_block] * len(rollouts), fmt)
    assert torch.equal(with_latents.action_mask, plain.action_mask)
    latents = model.get_input_embeddings()(torch.tensor([_known_ids(tokenizer, n)] * len(rollouts)))
    with torch.no_grad():
        a = action_logits(model, plain).token_logprobs()
        b = action_logits(model, with_latents, latents, fmt.latent_id).token_logprobs()
    assert a.numel() == sum(r.generated_tokens for r in rollouts) > 0
    assert (a - b).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------
# The sentinel's rows never move


def test_freeze_token_rows_keeps_the_latent_rows_through_an_update(family):
    _, fam, _, prepared, _ = family
    model, tokenizer = models.load_model(prepared)
    latent_id = tokenizer.convert_tokens_to_ids(chat.LATENT_TOKEN)
    handles = models.freeze_token_rows(model, [latent_id])
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert len(handles) == (1 if fam.tied else 2)
    before = {"embedding": embedding.detach().clone(), "head": head.detach().clone()}
    # The student's optimiser: AdamW without weight decay (train.weight_decay's default; decay is
    # applied apart from the gradient and would shrink any row).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=generator)
    ids[:, ::5] = latent_id                               # the input row gets a gradient too
    for _ in range(2):
        logits = model(input_ids=ids).logits
        # Every vocabulary row is touched: the latent id is a target and the log-normaliser.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(1, 1).flatten())
        optimizer.zero_grad()
        loss.backward()
        assert embedding.grad[latent_id].abs().sum() == 0
        optimizer.step()
    for name, weight in (("embedding", embedding), ("head", head)):
        assert torch.equal(weight[latent_id], before[name][latent_id]), name
        assert not torch.equal(weight[:latent_id], before[name][:latent_id]), name
    for handle in handles:
        handle.remove()


# ----------------------------------------------------------------------------------------------
# (c) the whole pipeline on each family: prepare -> bank -> cold start -> one LOPD step


def test_prepare_bank_cold_start_and_one_lopd_step(family, tmp_path):
    _, _, _, prepared, figures = family
    prepared_vocab = figures["latent_id"] + 1
    composer_sets = ["--set", f"composer.num_latents={SPEC.num_latents}",
                     "--set", f"composer.depth={SPEC.depth}", "--set", f"composer.num_heads={SPEC.num_heads}",
                     "--set", f"composer.max_experience_tokens={SPEC.max_experience_tokens}",
                     "--set", "bank.n_ret=2"]
    bank, composer, run = tmp_path / "bank", tmp_path / "composer", tmp_path / "run"
    assert main(["bank", "build", "--out", str(bank), "--model", str(prepared), "--agent", "oracle",
                 "--set", "bank.embedder=policy", *ENV_SETS]) == 0
    assert main(["cold-start", "--model", str(prepared), "--bank", str(bank), "--out", str(composer),
                 "--set", "cold_start.max_steps=2", "--set", "cold_start.validation_tasks=0",
                 "--set", "cold_start.batch_size=4", *composer_sets, *ENV_SETS,
                 "--json", str(tmp_path / "cold.json")]) == 0
    cold = json.loads((tmp_path / "cold.json").read_text())
    assert cold["steps"] == 2 and cold["successes"] > 2
    assert (composer / Composer.CONFIG_FILE).is_file()
    assert main(["train", "--algo", "lopd", "--out", str(run), "--composer", str(composer),
                 "--bank", str(bank), "--set", f"model.name_or_path={prepared}",
                 "--set", "train.max_steps=1", "--set", "train.rollouts_per_step=2",
                 "--set", "train.eval_tasks=2", "--set", "rollout.max_turns=2",
                 "--set", "rollout.max_completion_length=24", "--set", "rollout.batch_size=2",
                 *composer_sets, *ENV_SETS, "--json", str(tmp_path / "train.json")]) == 0
    last = json.loads((tmp_path / "train.json").read_text())
    assert last["step"] == 1 and last["action_tokens"] > 0 and last["kl"] >= 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert [p.name for p in trainer.checkpoints(run)] == ["step-000001"]
    student, _ = models.load_model(trainer.checkpoints(run)[0] / "student")
    assert student.config.vocab_size == prepared_vocab


def _episodes_both_ways(monkeypatch, tokenizer, policy_of, n=6):
    env = get_env("toolworld", seed=0, sizes=SIZES)
    tasks = env.tasks("train")[:n] * 2                         # a task opened twice: a group
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(agent, "FAST_TEMPLATE", fast)
        monkeypatch.setattr(agent, "_TEMPLATE_MEMO", agent.weakref.WeakKeyDictionary())
        runs.append(agent.run_episodes(env, tasks, policy_of(), tokenizer, max_turns=8,
                                       max_new_tokens=96, batch_size=4))
        if fast:
            forms = agent._template_memo(tokenizer)["forms"]
    return (*runs, forms)


def test_rendering_the_template_once_per_opening_and_piece_form_changes_no_token(family,
                                                                              monkeypatch):
    """The loop's shortcuts (an opening rendered once, a tool message's piece from the text its
    content sits between) give the same rollouts as rendering the whole conversation every turn:
    gold replays and random actions (malformed calls, error observations) of every family."""
    _, _, _, prepared, _ = family
    tokenizer = models.load_tokenizer(prepared)
    for policy_of in (policies.OraclePolicy, lambda: policies.RandomPolicy(seed=3)):
        fast, full, forms = _episodes_both_ways(monkeypatch, tokenizer, policy_of)
        assert sum(r.num_turns for r in fast) > len(fast)
        assert [r.input_ids for r in fast] == [r.input_ids for r in full]
        assert [r.action_mask for r in fast] == [r.action_mask for r in full]
        assert forms and None not in forms.values()               # the shortcut was taken


def test_a_template_that_edits_tool_content_is_rendered_in_full(monkeypatch):
    """Tool content trimmed by the template: no verbatim form, so every piece is rendered."""
    tokenizer = family_tokenizer(FAMILIES["tulu"])
    tokenizer.chat_template = OLMO2_TEMPLATE.replace(
        "'<|tool|>\\n' + message.content + '\\n'", "'<|tool|>\\n' + message.content | trim + '\\n'")
    assert "| trim" in tokenizer.chat_template
    fast, full, forms = _episodes_both_ways(monkeypatch, tokenizer,
                                            lambda: policies.RandomPolicy(seed=3))
    assert [r.input_ids for r in fast] == [r.input_ids for r in full]
    assert forms and set(forms.values()) == {None}


def test_the_embedded_tokenizer_takes_the_template_shortcuts_exactly(monkeypatch):
    tokenizer = models.load_tokenizer(str(models.EMBEDDED["toolworld-1m"]))
    fast, full, forms = _episodes_both_ways(monkeypatch, tokenizer,
                                            lambda: policies.RandomPolicy(seed=5))
    assert [r.input_ids for r in fast] == [r.input_ids for r in full]
    assert forms and None not in forms.values()


# ----------------------------------------------------------------------------------------------
# Models whose own template has no tools: a tool template lopd ships, applied only when asked

# ChatML that renders every message's content and nothing else (no tools), as many small chat
# models' templates do.
CHATML_WITHOUT_TOOLS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def toolless(tmp_path_factory):
    """A ChatML model folder whose template drops the tools."""
    fam = FAMILIES["chatml"]
    root = tmp_path_factory.mktemp("toolless")
    tokenizer = family_tokenizer(fam)
    tokenizer.chat_template = CHATML_WITHOUT_TOOLS
    models.save_model(family_model(fam, tokenizer), tokenizer, root / "source")
    return root


def test_a_template_without_tools_is_refused_naming_the_option(toolless, capsys):
    capsys.readouterr()
    out = toolless / "refused"
    assert main(["model", "prepare", str(toolless / "source"), "--out", str(out)]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "the chat template (the model's own) does not do what lopd needs" in error
    assert "system message with tools: missing 'get_order'" in error
    assert "--chat-template NAME_OR_FILE (lopd ships chatml-tools" in error
    assert not out.exists()


def test_the_shipped_tool_template_is_applied_when_asked_and_recorded(toolless, capsys):
    out = toolless / "prepared"
    assert main(["model", "prepare", str(toolless / "source"), "--out", str(out),
                 "--chat-template", "chatml-tools"]) == 0
    assert json.loads((out / pipeline.PREPARED_FILE).read_text())["chat_template"] == \
        "chatml-tools (lopd)"
    capsys.readouterr()
    assert main(["model", "info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "chatml-tools (lopd)" in shown and "chat_template_checks" in shown
    assert pipeline.model_info(toolless / "source")["chat_template_source"].startswith(
        "the model's own")

    tokenizer = models.load_tokenizer(out)
    assert tokenizer.chat_template == chat.TOOL_TEMPLATES["chatml-tools"]
    call = chat.ToolCall("get_order", {"order_id": "O1"})
    messages = [{"role": "system", "content": "Be an agent."},
                {"role": "user", "content": "Where is O1?"},
                {"role": "assistant", "content": call.to_text()},
                {"role": "tool", "content": '{"status": "shipped"}'}]
    text = chat.render(tokenizer, messages, chat.PROBE_TOOLS, tokenize=False)
    # Tools as JSON in the system message, the call in the assistant's turn, the result in its own.
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe an agent.") and '"name": "get_order"' in system
    assert f"<|im_start|>assistant\n{call.to_text()}<|im_end|>" in text
    assert '<|im_start|>tool\n{"status": "shipped"}<|im_end|>' in text
    assert chat.parse_action(call.to_text(), chat.PROBE_TOOLS) == call
    # The reference block goes where it goes in every ChatML template: after the user header.
    assert tokenizer.decode(latent.user_header(tokenizer)) == "<|im_start|>user\n"
    assert all(c["ok"] for c in agent.check_chat_template(tokenizer) if c["required"])


def test_a_template_file_is_taken_and_a_wrong_name_refused(toolless, tmp_path, capsys):
    template = tmp_path / "tools.jinja"
    template.write_text(chat.TOOL_TEMPLATES["chatml-tools"])
    assert main(["model", "prepare", str(toolless / "source"), "--out", str(tmp_path / "out"),
                 "--chat-template", str(template)]) == 0
    assert json.loads((tmp_path / "out" / pipeline.PREPARED_FILE).read_text())[
        "chat_template"] == f"file {template.resolve()}"
    capsys.readouterr()
    assert main(["model", "prepare", str(toolless / "source"), "--out", str(tmp_path / "no"),
                 "--chat-template", "chatml-tool"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("--chat-template 'chatml-tool' is neither a template lopd ships "
                          "(chatml-tools) nor a file") and "\n" not in error
    assert not (tmp_path / "no").exists()
