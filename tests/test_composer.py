import copy
import re

import pytest
import torch

from lopd import latent
from lopd.composer import Composer, Compressor
from lopd.config import ComposerConfig

N_RET = 2
SPEC = ComposerConfig(num_latents=4, depth=2, num_heads=4, max_experience_tokens=64)
TASKS = ["Cancel order O12.", "Hold shipment S4."]
TRACES = [["Task: Cancel order O7.\n1. cancel_order(O7) -> ok", "Task: Cancel order O9.\n1. x"],
          ["Task: Hold S1.\n1. hold(S1) -> ok", "Task: Reroute S2.\n1. reroute(S2) -> ok"]]


@pytest.fixture()
def pair(tiny_tokenizer, tiny_model):
    """A composer over a private copy of the tiny model, and an untouched copy for reference."""
    reference = copy.deepcopy(tiny_model).eval()
    composer = Composer(copy.deepcopy(tiny_model).eval(), tiny_tokenizer, SPEC)
    return composer, reference


def _perturb_lora(composer):
    with torch.no_grad():
        for name, p in composer.encoder.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.1)


def test_the_one_shared_block_is_applied_depth_times(pair):
    """Shared parameters: one block's weights serve every depth (same state dict, same count).
    Depth: the block runs ``depth`` times (counted with a hook), the output equals the block
    applied twice by hand at depth 2, and depth 2 differs from depth 1 on the same weights."""
    torch.manual_seed(0)

    def compressor(depth):
        return Compressor(32, 48, ComposerConfig(num_latents=4, depth=depth, num_heads=4))

    one = compressor(1)
    states = torch.randn(2, 7, 32)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    outputs = {}
    for depth in (1, 2, 8):
        c = compressor(depth)
        c.load_state_dict(one.state_dict())      # strict: no per-layer parameters anywhere
        assert sum(p.numel() for p in c.parameters()) == sum(p.numel() for p in one.parameters())
        calls = []
        handle = c.block.register_forward_hook(lambda *_: calls.append(1))
        with torch.no_grad():
            outputs[depth] = c(states, mask)
        handle.remove()
        assert len(calls) == depth
    with torch.no_grad():
        queries = one.queries.expand(2, -1, -1)
        ignore = torch.cat([mask == 0, torch.zeros(2, 4, dtype=torch.bool)], dim=1)
        for _ in range(2):
            queries = one.block(queries, states, ignore)
        by_hand = one.project(one.norm_out(queries))
    torch.testing.assert_close(outputs[2], by_hand, rtol=0, atol=1e-6)
    assert (outputs[2] - outputs[1]).abs().max() > 1e-3
    assert (outputs[8] - outputs[2]).abs().max() > 1e-3
    # The composer builds its compressor with the spec's depth and uses it when encoding.
    composer, _ = pair
    calls = []
    handle = composer.compressor.block.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        composer.encode(TASKS, TRACES)
    handle.remove()
    assert composer.compressor.depth == SPEC.depth == len(calls) == 2


def test_latents_have_the_right_shape_and_token_norm(pair, tiny_model):
    composer, _ = pair
    z = composer.encode(TASKS, TRACES)
    assert z.shape == (2, N_RET * SPEC.num_latents, tiny_model.config.hidden_size)
    target = tiny_model.get_input_embeddings().weight.norm(dim=-1).mean()
    assert torch.allclose(z.norm(dim=-1), target.expand(z.shape[:2]), rtol=1e-4)


def test_teacher_pass_runs_without_the_adapter(pair, tiny_tokenizer):
    composer, reference = pair
    _perturb_lora(composer)
    ids = torch.tensor([tiny_tokenizer.encode("<|im_start|>user\nCancel order O12.<|im_end|>")])
    with torch.no_grad(), composer.teacher() as teacher:
        teacher_logits = teacher(input_ids=ids).logits
    with torch.no_grad():
        adapted = composer.base(input_ids=ids).logits          # adapter on: differs
        base_logits = reference(input_ids=ids).logits
    assert torch.equal(teacher_logits, base_logits)
    assert not torch.allclose(adapted, base_logits)


def test_gradients_reach_lora_and_compressor_but_no_base_weight(pair, tiny_tokenizer):
    composer, _ = pair
    _perturb_lora(composer)     # LoRA B starts at zero, which would block gradient to A
    fmt = latent.ReferenceFormat.for_tokenizer(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("<|im_start|>user\nCancel order O12.<|im_end|>\n")
    ids, _ = latent.insert_reference(prompt, fmt.latent_block(N_RET * SPEC.num_latents), fmt)
    ids = torch.tensor([ids, ids])
    z = composer.encode(TASKS, TRACES)
    embeds = latent.splice_embeddings(composer.base.get_input_embeddings(), ids, z, fmt.latent_id)
    composer.teacher_forward(inputs_embeds=embeds).logits.logsumexp(-1).mean().backward()
    trainable = {n for n, p in composer.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("compressor" in n for n in trainable)
    for name, p in composer.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert all("lora_" in n or n.startswith("compressor.") for n in trainable)


def test_save_load_round_trip_is_exact(pair, tiny_tokenizer, tiny_model, tmp_path):
    composer, _ = pair
    _perturb_lora(composer)
    with torch.no_grad():
        composer.compressor.queries.add_(1.0)
        before = composer.encode(TASKS, TRACES)
    composer.save(tmp_path)
    loaded = Composer.load(tmp_path, copy.deepcopy(tiny_model).eval(), tiny_tokenizer)
    with torch.no_grad():
        after = loaded.encode(TASKS, TRACES)
    assert torch.equal(before, after)
    assert loaded.spec == SPEC


def test_load_errors_are_clear(tiny_tokenizer, tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a composer folder"):
        Composer.load(tmp_path, copy.deepcopy(tiny_model), tiny_tokenizer)


def test_uneven_experience_counts_are_refused(pair):
    composer, _ = pair
    with pytest.raises(ValueError, match=re.escape(
            "each of the 2 tasks needs the same number of experiences; got [2, 1]")):
        composer.encode(TASKS, [TRACES[0], TRACES[1][:1]])
    with pytest.raises(ValueError, match=re.escape(
            "each of the 2 tasks needs the same number of experiences; got [2]")):
        composer.encode(TASKS, TRACES[:1])


def _padded_reference_encode(composer, tasks, traces, compressor):
    """The encoding as one right-padded batch of every input (no grouping, no dedup, no cache):
    the definition the grouped encoder must reproduce."""
    from lopd.composer import experience_text

    texts = [experience_text(t, x) for t, xs in zip(tasks, traces) for x in xs]
    batch = composer.tokenizer(texts, return_tensors="pt", padding="longest", truncation=True,
                               max_length=composer.spec.max_experience_tokens,
                               padding_side="right")
    states = composer.base.get_decoder()(**batch).last_hidden_state
    z = compressor(states, batch["attention_mask"])
    z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-6) * composer.target_norm
    return z.reshape(len(tasks), -1, z.size(-1))


def test_grouped_and_deduplicated_encoding_is_the_padded_batch(pair):
    composer, _ = pair
    _perturb_lora(composer)
    tasks = TASKS + [TASKS[0]]                     # a task met twice: its inputs encoded once
    traces = TRACES + [TRACES[0]]
    traces[1] = [traces[1][0], "Task: Reroute S2.\n" + "1. reroute(S2) -> ok\n" * 12]
    with torch.no_grad():
        z = composer.encode(tasks, traces)
        reference = _padded_reference_encode(composer, tasks, traces, composer.compressor)
    assert torch.allclose(z, reference, rtol=0, atol=1e-5)
    assert torch.equal(z[0], z[2])
    # The gradient of a shared input is the sum of its uses.
    z = composer.encode(tasks, traces)
    (z[0].sum() + z[2].sum()).backward()
    twice = [p.grad.clone() for p in composer.trainable_parameters()]
    composer.zero_grad()
    (2 * composer.encode(tasks[:1], traces[:1])[0].sum()).backward()
    once = [p.grad for p in composer.trainable_parameters()]
    assert all((a - b).abs().max() <= 1e-5 * b.abs().max() for a, b in zip(twice, once))


def test_the_anchor_cache_serves_frozen_latents_and_stays_bounded(pair, monkeypatch):
    composer, _ = pair
    _perturb_lora(composer)
    plain = copy.deepcopy(composer)
    plain.freeze_anchor(cache_mb=0)
    composer.freeze_anchor(cache_mb=1.0)
    with torch.no_grad():                           # ψ learns; φ0 does not
        for p in composer.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    first = composer.encode(TASKS, TRACES, anchor=True)
    assert len(composer._anchor_cache) == 4
    calls = []
    decoder = composer.base.get_decoder()
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(
        AssertionError("re-encoded a cached input")))
    again = composer.encode(TASKS, TRACES, anchor=True)
    assert torch.equal(first, again) and not calls
    monkeypatch.undo()
    # A batch mixing cached and new inputs: the new ones as the uncached composer gives them.
    traces = [TRACES[0], ["Task: Hold S9.\n1. hold(S9) -> ok", TRACES[1][1]]]
    mixed = composer.encode(TASKS, traces, anchor=True)
    expected = plain.encode(TASKS, traces, anchor=True)
    assert torch.allclose(mixed, expected, rtol=0, atol=1e-5)
    assert torch.equal(mixed[0], first[0])
    # 1 MiB holds 1 MiB / (K · d · 4 bytes) inputs; the least recently used go first.
    entries = composer._anchor_cache_entries
    assert entries == int(2**20 / (SPEC.num_latents * composer.base.config.hidden_size * 4))
    many = [f"Task {i}." for i in range(entries + 3)]
    composer.encode(many, [[TRACES[0][0]]] * len(many), anchor=True)
    assert len(composer._anchor_cache) == entries
    assert plain._anchor_cache is None


def test_no_anchor_cache_under_lora_dropout(tiny_tokenizer, tiny_model):
    spec = ComposerConfig(num_latents=4, depth=2, num_heads=4, max_experience_tokens=64,
                          lora_dropout=0.1)
    composer = Composer(copy.deepcopy(tiny_model), tiny_tokenizer, spec)
    composer.freeze_anchor(cache_mb=64)
    assert composer._anchor_cache is None
