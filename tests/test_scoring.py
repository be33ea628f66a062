"""Scoring at action tokens: the one wrapped module equals the model's own forward, and the chunked
vocabulary reductions equal the all-at-once ones (values and gradients)."""

import types

import pytest
import torch

from lopd import losses
from lopd.teacher import ActionLogits, action_logits, finalize_logits, per_token, scoring_batch


@pytest.fixture
def scored(tiny_model, tiny_tokenizer):
    torch.manual_seed(0)
    seqs = [list(range(5, 25)), list(range(30, 42))]
    masks = [[0] * 6 + [1] * 14, [0] * 4 + [1] * 4 + [0] * 2 + [1] * 2]
    batch = scoring_batch(seqs, masks, tiny_tokenizer.pad_token_id)
    return batch, action_logits(tiny_model, batch)


def test_scoring_equals_the_models_own_forward(tiny_model, scored):
    batch, out = scored
    with torch.no_grad():
        full = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = full[:, :-1][batch.action_mask[:, 1:]]
    assert out.targets.numel() == int(batch.action_mask[:, 1:].sum())
    assert torch.allclose(out.logits, expected, atol=1e-5)
    lp = torch.log_softmax(expected, -1).gather(-1, out.targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out.token_logprobs(), lp, atol=1e-5)


def test_logit_scalings_of_other_architectures_are_applied():
    logits = torch.tensor([[-40.0, 0.5, 40.0]])
    capped = finalize_logits(types.SimpleNamespace(config=types.SimpleNamespace(
        final_logit_softcapping=30.0)), logits)
    assert torch.allclose(capped, torch.tanh(logits / 30.0) * 30.0)
    scaled = finalize_logits(types.SimpleNamespace(config=types.SimpleNamespace(logit_scale=0.5)),
                             logits)
    assert torch.equal(scaled, logits * 0.5)
    divided = finalize_logits(types.SimpleNamespace(config=types.SimpleNamespace(
        logits_scaling=4.0)), logits)
    assert torch.equal(divided, logits / 4.0)
    plain = finalize_logits(types.SimpleNamespace(config=types.SimpleNamespace()), logits)
    assert torch.equal(plain, logits)


@pytest.mark.parametrize("chunk", [1, 5, 0])
def test_chunked_divergences_equal_the_whole_computation(tiny_model, tiny_tokenizer, chunk):
    """Student and 'teacher' are two models (the second perturbed); every reduction and every
    gradient through the chunked path equals the full-vocabulary one."""
    torch.manual_seed(0)
    teacher_model = type(tiny_model)(tiny_model.config)
    teacher_model.load_state_dict(tiny_model.state_dict())
    with torch.no_grad():
        for p in teacher_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seqs = [list(range(5, 25)), list(range(30, 42))]
    masks = [[0] * 6 + [1] * 14, [0] * 4 + [1] * 8]
    batch = scoring_batch(seqs, masks, tiny_tokenizer.pad_token_id)

    def grads_of(compute):
        for m in (tiny_model, teacher_model):
            m.zero_grad(set_to_none=True)
        value = compute()
        value.backward()
        return value.detach(), [p.grad.clone() for m in (tiny_model, teacher_model)
                                for p in m.parameters() if p.grad is not None]

    def chunked():
        s, t = action_logits(tiny_model, batch), action_logits(teacher_model, batch)
        kl_s, kl_t, gap, full, jsd = per_token(
            lambda ls, lt, y: (losses.reverse_kl_top_m(ls, lt.detach(), 4),
                               losses.forward_kl_top_m(ls.detach(), lt, 4),
                               lt.gather(-1, y[:, None])[:, 0] - ls.gather(-1, y[:, None])[:, 0],
                               losses.forward_kl_full(ls, lt.detach()),
                               losses.jsd_top_k(ls, lt.detach(), 0.5, 4)),
            s, t, chunk_tokens=chunk)
        return (kl_s.sum() + 0.3 * kl_t.mean() + 0.1 * gap.sum() + 0.2 * full.sum()
                + 0.5 * jsd.sum())

    def whole():
        s, t = action_logits(tiny_model, batch), action_logits(teacher_model, batch)
        ls, lt = torch.log_softmax(s.logits, -1), torch.log_softmax(t.logits, -1)
        y = s.targets[:, None]
        gap = lt.gather(-1, y)[:, 0] - ls.gather(-1, y)[:, 0]
        return (losses.reverse_kl_top_m(ls, lt.detach(), 4).sum()
                + 0.3 * losses.forward_kl_top_m(ls.detach(), lt, 4).mean() + 0.1 * gap.sum()
                + 0.2 * losses.forward_kl_full(ls, lt.detach()).sum()
                + 0.5 * losses.jsd_top_k(ls, lt.detach(), 0.5, 4).sum())

    (a, ga), (b, gb) = grads_of(chunked), grads_of(whole)
    assert torch.allclose(a, b, atol=1e-5)
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)   # summation order only


def test_an_empty_batch_of_action_tokens_gives_empty_values(tiny_model, tiny_tokenizer):
    batch = scoring_batch([[5, 6, 7]], [[0, 0, 0]], tiny_tokenizer.pad_token_id)
    out = action_logits(tiny_model, batch)
    assert isinstance(out, ActionLogits) and out.token_logprobs().shape == (0,)
