"""OPSD on the tiny base: the frozen base θ0 reads the oracle trajectory at the end of its system
message and the student never does (token ids), the loss equals the full-vocabulary forward KL
computed by hand from plain forward passes, θ0 never moves; SDFT and OPSD reach the CLI and the
config like every registered method. (Direction of a step, start-up refusals: test_sdft.py.)"""

import pytest
import torch

from conftest import junk_and_gold_batch, scored_length
from lopd import losses, models
from lopd.algorithms.opsd import PRIVILEGED_PREFIX
from lopd.config import ConfigError, load_config
from test_sdft import build, scored
from test_teacher_views import ids_of, index_of, rows


def full_logprobs(model, ids, mask):
    """(n, V) log-probs at the positions predicting the tokens at ``mask == 1``, by a plain
    forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)[torch.tensor(mask[1:], dtype=torch.bool)]


def test_the_frozen_base_reads_the_oracle_in_its_system_message_and_the_student_never_does(
        tmp_path):
    t = build(tmp_path / "run", "opsd")
    alg, tok = t.algorithm, t.ctx.tokenizer
    assert t.cfg.opsd.placement == "system"
    batch = junk_and_gold_batch(t, 2)
    state, scores = scored(alg, batch)
    demos = [t.env.oracle_trace(task, t.cfg.bank.max_observation_chars) for task in batch.tasks]
    assert state["teacher_context"] == [[d] for d in demos]
    header, close = ids_of(tok, "<|im_start|>user\n"), ids_of(tok, "<|im_end|>\n")
    for rollout, demo, (ids, mask) in zip(batch.rollouts, demos,
                                          rows(alg.teacher.batch(batch.rollouts, [[d] for d in demos]))):
        at = index_of(rollout.input_ids, header) - len(close)
        block = ids_of(tok, "\n\n" + PRIVILEGED_PREFIX) + ids_of(tok, demo)
        end = len(block) + scored_length(rollout.action_mask)
        assert ids == (rollout.input_ids[:at] + block + rollout.input_ids[at:])[:end]
        assert [x for x, m in zip(ids, mask) if m] == \
            [x for x, m in zip(rollout.input_ids, rollout.action_mask) if m]
        assert tok.decode(ids).split("<|im_end|>")[0].endswith(PRIVILEGED_PREFIX + demo)
    assert torch.equal(scores.student.targets, scores.teacher.targets)


def test_the_loss_is_the_full_vocabulary_forward_kl_by_hand_and_theta0_never_moves(tmp_path):
    t = build(tmp_path / "run", "opsd", **{"train.learning_rate": 1e-3,
                                           "train.per_device_train_batch_size": 3,
                                           "train.loss_chunk_tokens": 5})
    alg = t.algorithm
    t.ctx.student.load_state_dict(models.build_model(t.ctx.tokenizer, "qwen3-1m",
                                                     seed=1).state_dict())
    batch = junk_and_gold_batch(t, 2)
    context = alg.before_step(batch)["teacher_context"]
    teacher_model = alg.teacher.teacher
    kls = []
    for rollout, (ids, mask) in zip(batch.rollouts, rows(alg.teacher.batch(batch.rollouts, context))):
        teacher = full_logprobs(teacher_model, ids, mask)
        student = full_logprobs(t.ctx.student, rollout.input_ids, rollout.action_mask)
        kls.append((teacher.exp() * (teacher - student)).sum(-1).double())
    expected = torch.cat(kls).mean().item()
    assert expected > 0.5
    # The shared loss with token weights: rollout 1's tokens left out, a mean over the others.
    from lopd.algorithms.base import Totals, distillation_loss

    _, scores = scored(alg, batch)
    weights = (scores.student.rows != 1).float()
    kept = torch.cat([k for i, k in enumerate(kls) if i != 1])
    terms = distillation_loss(losses.forward_kl_full, scores, Totals.of(batch.rollouts), weights,
                              denominator=kept.numel())
    assert terms.metrics["kl"].item() == pytest.approx(kept.mean().item(), rel=1e-5)
    figures = alg.step(batch)
    assert figures["micro_batches"] == 2
    assert figures["kl"] == pytest.approx(expected, rel=1e-5)
    fresh, _ = models.load_model(t.cfg.model.name_or_path)
    for (name, a), (_, b) in zip(teacher_model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    assert not any(p.requires_grad for p in teacher_model.parameters())


def test_sdft_and_opsd_reach_the_cli_and_the_config(capsys):
    from lopd.cli import build_parser, main

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                 if a.dest == "algo")
    assert {"sdft", "opsd"} <= set(train.choices)
    assert main(["config", "--set", "sdft.ema_rate=0.05", "--set", "opsd.placement=user"]) == 0
    out = capsys.readouterr().out
    assert "sdft.ema_rate" in out and "0.05" in out and "opsd.placement" in out
    cfg = load_config("tiny", ["train.algorithm=opsd"])
    assert cfg.sdft.ema_rate == 0.01 and cfg.sdft.top_m == 20 and cfg.sdft.placement == "user"
    assert cfg.opsd.placement == "system"
    with pytest.raises(ConfigError, match="opsd.placement"):
        load_config("tiny", ["opsd.placement=middle"])
    with pytest.raises(ConfigError, match="sdft.ema_rate"):
        load_config("tiny", ["sdft.ema_rate=0"])
