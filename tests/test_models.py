import torch

from lopd import chat, models, pipeline


def test_special_tokens_survive_save_and_load(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    loaded = models.load_tokenizer(tmp_path)
    for token in chat.SPECIAL_TOKENS:
        ids = loaded.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token                       # never split into pieces
        assert ids == tiny_tokenizer.encode(token, add_special_tokens=False)
    assert loaded.pad_token == chat.PAD_TOKEN and loaded.eos_token == chat.IM_END
    assert loaded.padding_side == "left"
    text = "<|im_start|>user\nfind order O123<|latent|><|latent|><tool_call>{}</tool_call><|im_end|>"
    assert loaded.encode(text) == tiny_tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text


TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"]}}}]
CHAT = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Where is order O1?"},
    {"role": "assistant", "content": '<tool_call>{"name": "get_order", "arguments": {"order_id": "O1"}}</tool_call>'},
    {"role": "tool", "content": '{"status":"shipped"}'},
    {"role": "assistant", "content": "Shipped. Task Completed"},
]


def test_chat_template_renders_every_role(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CHAT, tools=TOOLS, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are an agent.\nTools:\n- get_order(order_id): Look up an order.<|im_end|>\n"
        "<|im_start|>user\nWhere is order O1?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_order", "arguments": {"order_id": "O1"}}</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"status":"shipped"}<|im_end|>\n'
        "<|im_start|>assistant\nShipped. Task Completed<|im_end|>\n")
    prompt = tiny_tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are an agent.<|im_end|>\n"
                      "<|im_start|>user\nWhere is order O1?<|im_end|>\n<|im_start|>assistant\n")
    # Tools without a system message still get a system turn; rendering matches the tokenizer-free path.
    no_system = tiny_tokenizer.apply_chat_template(CHAT[1:2], tools=TOOLS, tokenize=False)
    assert no_system.startswith("<|im_start|>system\nTools:\n- get_order(order_id)")
    assert chat.render_chat(CHAT, tools=TOOLS) == text
    assert chat.render_chat(CHAT[1:2], tools=TOOLS) == no_system


def test_chat_template_tokenizes_to_a_dict(tiny_tokenizer):
    out = tiny_tokenizer.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True,
                                             return_dict=True)
    assert tiny_tokenizer.decode(out["input_ids"]).endswith("<|im_start|>assistant\n")


def test_model_save_load_gives_identical_logits(tiny_tokenizer, tiny_model, tmp_path):
    models.save_model(tiny_model, tiny_tokenizer, tmp_path)
    loaded, tokenizer = models.load_model(tmp_path)
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nhello order O12<|im_end|>")])
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, loaded(ids).logits)
    assert pipeline.model_info(tmp_path)["parameters"] == models.count_parameters(tiny_model)


def test_seed_makes_initialisation_reproducible(tiny_tokenizer):
    a = models.build_model(tiny_tokenizer, seed=3).state_dict()
    b = models.build_model(tiny_tokenizer, seed=3).state_dict()
    c = models.build_model(tiny_tokenizer, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_building_a_model_leaves_the_global_rng_alone(tiny_tokenizer):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    models.build_model(tiny_tokenizer, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_presets_have_the_documented_sizes(tiny_tokenizer):
    tiny = models.build_model(tiny_tokenizer, "qwen3-1m")
    small = models.build_model(tiny_tokenizer, "qwen3-4m")
    assert (tiny.config.hidden_size, tiny.config.num_hidden_layers) == (128, 2)
    assert (small.config.hidden_size, small.config.num_hidden_layers) == (256, 4)
    assert models.count_parameters(tiny) < models.count_parameters(small)


def test_lopd_loads_print_no_progress_bar_and_raise_no_future_warning(capfd, recwarn,
                                                                       tmp_path):
    """The demo's output is lopd's own stages: transformers' "Loading weights" and "Writing model
    shards" bars are off while lopd loads or saves a model (and as they were after), and neither the composer's LoRA wrapping (peft
    reads the model's deprecated ``is_gradient_checkpointing``) nor turning on activation
    checkpointing warns."""
    from transformers.utils import logging as hf_logging

    from lopd.composer import Composer
    from lopd.embedding import EmbedderSpec, load_embedder

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()                    # as in the demo, whatever the environment
    try:
        model, tokenizer = models.load_model("toolworld-1m")
        Composer.load(models.ASSETS / "toolworld-1m-composer", model.eval(), tokenizer)
        load_embedder(EmbedderSpec(kind="policy", path="toolworld-1m"))
        student, _ = models.load_model("toolworld-1m")
        models.enable_activation_checkpointing(student)
        assert student.is_activation_checkpointing
        models.save_model(model, tokenizer, tmp_path / "saved")
        assert hf_logging.is_progress_bar_enabled()
    finally:
        if not was_enabled:
            hf_logging.disable_progress_bar()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err
    assert [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)] == []
