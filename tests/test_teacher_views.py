"""The teacher views the baselines share, checked on token ids and plain forward passes: privileged
text lands exactly where its placement says (after the first user header, or at the end of the
system message) and nowhere in the student's sequence, the action tokens stay aligned one to one,
the view scores what a plain forward of that sequence gives; the EMA copy moves by the hand-computed
average and survives a save/load."""

import copy

import pytest
import torch

from lopd import agent, models, policies
from lopd.envs import get_env
from lopd.teacher import EMATeacher, TextContext, rollout_logprobs, scoring_batch, text_view
from test_step_checks import plain_action_logprobs

PREFIX = "A correct solution of this task, as a demonstration:\n"


@pytest.fixture(scope="module")
def setting():
    model, tokenizer = models.load_model("toolworld-1m")
    env = get_env("toolworld", seed=0, sizes={"train": 6, "eval": 2, "pretrain": 0})
    tasks = env.tasks("train")[:3]
    junk = agent.run_episodes(env, tasks, policies.RandomPolicy(seed=0), tokenizer, 3, 48, 3)
    gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 8, 96, 3)
    rollouts = [*junk, *gold]
    texts = [[env.oracle_trace(t)] for t in tasks] * 2
    return model.eval(), tokenizer, rollouts, texts


def ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def index_of(seq, sub):
    """First index of ``sub`` in ``seq`` by a plain scan (not the code under test)."""
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub)


def rows(batch):
    return [(batch.input_ids[r][batch.attention_mask[r].bool()].tolist(),
             batch.action_mask[r][batch.attention_mask[r].bool()].tolist())
            for r in range(batch.input_ids.size(0))]


@pytest.mark.parametrize("placement", ["user", "system"])
def test_the_teacher_sequence_is_the_students_with_exactly_the_privileged_tokens_inserted(
        setting, placement):
    model, tokenizer, rollouts, texts = setting
    view = text_view(model, tokenizer, placement, PREFIX)
    header = ids_of(tokenizer, "<|im_start|>user\n")
    close = ids_of(tokenizer, "<|im_end|>\n")
    for rollout, text, (ids, mask) in zip(rollouts, texts, rows(view.batch(rollouts, texts))):
        student = rollout.input_ids
        user = index_of(student, header)
        if placement == "user":
            block = ids_of(tokenizer, PREFIX) + ids_of(tokenizer, text[0]) + ids_of(tokenizer, "\n\n")
            at = user + len(header)
        else:
            block = ids_of(tokenizer, "\n\n" + PREFIX) + ids_of(tokenizer, text[0])
            at = user - len(close)
            assert student[at:user] == close
        expected = student[:at] + block + student[at:]
        expected_mask = rollout.action_mask[:at] + [0] * len(block) + rollout.action_mask[at:]
        # The scored row ends at its last action token (what follows scores nothing).
        end = max(i for i, m in enumerate(expected_mask) if m) + 1
        assert ids == expected[:end] and mask == expected_mask[:end]
        # One to one: the teacher's action tokens are the student's, in order.
        assert [t for t, m in zip(ids, mask) if m] == \
            [t for t, m in zip(student, rollout.action_mask) if m]
        rendered = tokenizer.decode(ids)
        system = rollout.messages[0]["content"]
        if placement == "user":
            assert f"<|im_start|>user\n{PREFIX}{text[0]}\n\n{rollout.instruction}" in rendered
        else:
            # After the system text and the tool list, before the system message closes.
            tools_end = rendered.index("<|im_end|>")
            assert rendered.index(system) < tools_end
            assert rendered[:tools_end].endswith(f"\n\n{PREFIX}{text[0]}")
    # The student's own sequences hold none of it.
    student_rows = rows(scoring_batch([r.input_ids for r in rollouts],
                                      [r.action_mask for r in rollouts], tokenizer.pad_token_id))
    ends = [max(i for i, m in enumerate(r.action_mask) if m) + 1 for r in rollouts]
    assert [ids for ids, _ in student_rows] == [r.input_ids[:e] for r, e in zip(rollouts, ends)]
    body = ids_of(tokenizer, texts[0][0])
    assert all(not any(ids[i:i + len(body)] == body for i in range(len(ids)))
               for ids, _ in student_rows)


@pytest.mark.parametrize("placement", ["user", "system"])
def test_the_text_view_scores_a_plain_forward_of_the_teachers_sequence(setting, placement):
    model, tokenizer, rollouts, texts = setting
    view = text_view(model, tokenizer, placement, PREFIX)
    with torch.no_grad():
        scored, _ = view.score(rollouts, texts)
        plain = torch.cat([plain_action_logprobs(model, ids, mask)
                           for ids, mask in rows(view.batch(rollouts, texts))])
        without = torch.cat([plain_action_logprobs(model, r.input_ids, r.action_mask)
                             for r in rollouts])
    assert scored.targets.numel() == sum(sum(r.action_mask) for r in rollouts)
    assert (scored.token_logprobs() - plain).abs().max() < 1e-5
    assert (scored.token_logprobs() - without).abs().max() > 1e-3   # the text changes the scores


def test_a_composer_is_read_as_its_base_with_the_adapter_off(setting, tmp_path):
    from conftest import LOPD_SPEC
    from lopd.composer import Composer
    from lopd.latent import ReferenceFormat
    from test_step_checks import set_lora_b

    model, tokenizer, rollouts, texts = setting
    composer = Composer(copy.deepcopy(model), tokenizer, LOPD_SPEC)
    set_lora_b(composer)
    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    with torch.no_grad():
        through, _ = TextContext(composer, fmt).score(rollouts, texts)
        plain, _ = TextContext(model, fmt, tokenizer).score(rollouts, texts)
    assert (through.token_logprobs() - plain.token_logprobs()).abs().max() < 1e-6


def perturbed(model, seed, scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def test_the_ema_update_equals_the_hand_computation(setting):
    model, _, _, _ = setting
    student = copy.deepcopy(model).train()
    frozen_name = "model.norm.weight"
    dict(student.named_parameters())[frozen_name].requires_grad_(False)
    ema = EMATeacher(student, 0.25)
    teacher = dict(ema.model.named_parameters())
    assert all(not p.requires_grad for p in teacher.values())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(teacher.values(), student.parameters()))
    expected = {n: p.detach().double().clone() for n, p in teacher.items()}
    for seed in (1, 2):
        perturbed(student, seed)
        for name, p in student.named_parameters():
            if p.requires_grad:
                expected[name] = 0.75 * expected[name] + 0.25 * p.detach().double()
        ema.update()
        for name, p in teacher.items():
            assert torch.allclose(p.double(), expected[name], rtol=0, atol=1e-6), name
    # A parameter the student does not train is never averaged (it never changes in training).
    assert torch.equal(teacher[frozen_name], dict(model.named_parameters())[frozen_name])
    with pytest.raises(ValueError, match="EMA rate"):
        EMATeacher(student, 0.0)


def test_the_ema_weights_survive_save_and_load(setting, tmp_path):
    model, _, _, _ = setting
    student = copy.deepcopy(model)
    ema = EMATeacher(student, 0.5)
    perturbed(student, 3)
    ema.update()
    ema.save(tmp_path / "ema")
    other = EMATeacher(model, 0.5)
    other.load(tmp_path / "ema")
    for (name, a), (_, b) in zip(ema.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(next(other.model.parameters()), next(model.parameters()))
    with pytest.raises(FileNotFoundError, match="no EMA teacher"):
        other.load(tmp_path / "missing")


def test_rollout_logprobs_are_each_rollouts_plain_forward(setting):
    model, tokenizer, rollouts, _ = setting
    got = rollout_logprobs(model, rollouts, tokenizer.pad_token_id)
    assert len(got) == len(rollouts)
    for rollout, values in zip(rollouts, got):
        plain = plain_action_logprobs(model, rollout.input_ids, rollout.action_mask)
        assert values.shape == plain.shape == (sum(rollout.action_mask),)
        # A padded batch and a single row run different float32 GEMM shapes, whose rounding
        # depends on the CPU's kernels: on one 2-core AMD EPYC one log-prob of about -20
        # differed by 1.1e-5. Float32's usual tolerance, relative as well as absolute.
        torch.testing.assert_close(values, plain, atol=1e-5, rtol=1.3e-6)
