"""One training step checked against what it must do: what an LOPD step moves and what it leaves
alone, Δ against a hand computation from plain forward passes, the student and composer losses on
separate graphs, the teacher's scoring path with known embeddings spliced in, and the direction of a
GRPO update. Every reference here is computed without the code under test (plain ``model(...)``
calls, hand-made sequences), so a wrong step fails instead of agreeing with itself."""

import dataclasses
from collections import defaultdict

import pytest
import torch

from conftest import junk_and_gold_batch, lopd_config, make_lopd_inputs
from lopd import losses, models, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch, Totals, micro_batches
from lopd.composer import Composer
from lopd.experience import ExperienceBank, retrieve_traces
from lopd.latent import ReferenceFormat
from lopd.teacher import LatentContext, teacher_pass
from test_lopd import build


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_lopd_inputs(tmp_path_factory.mktemp("step-checks-inputs"))


# ----------------------------------------------------------------------------------------------
# Plain references: one sequence at a time, the model's own forward, no lopd scoring code


def plain_action_rows(model, ids, mask, inputs_embeds=None):
    """(n, V) log-softmax rows predicting the tokens at ``mask == 1`` of one sequence under
    ``model``'s forward."""
    ids = torch.tensor([ids])
    if inputs_embeds is None:
        logits = model(input_ids=ids).logits
    else:
        logits = model(inputs_embeds=inputs_embeds).logits
    return logits[0, :-1].float().log_softmax(-1)[torch.tensor(mask[1:], dtype=torch.bool)]


def plain_action_logprobs(model, ids, mask, inputs_embeds=None):
    """(n,) log-probs of the tokens at ``mask == 1`` of one sequence under ``model``'s forward."""
    rows = plain_action_rows(model, ids, mask, inputs_embeds)
    targets = torch.tensor(ids[1:])[torch.tensor(mask[1:], dtype=torch.bool)]
    return rows.gather(-1, targets[:, None]).squeeze(-1)


def with_block(rollout, block, fmt):
    """``rollout``'s ids and action mask with ``block`` right after the first user header."""
    ids, header = rollout.input_ids, list(fmt.header)
    at = next(i for i in range(len(ids)) if ids[i:i + len(header)] == header) + len(header)
    return ([*ids[:at], *block, *ids[at:]],
            [*rollout.action_mask[:at], *[0] * len(block), *rollout.action_mask[at:]])


def plain_teacher_inputs(base, fmt, rollout, z):
    """The teacher's ids, action mask and input embeddings for one rollout, by hand: ``z`` (n, d)
    written over the n sentinel rows of the token embeddings."""
    ids, mask = with_block(rollout, fmt.latent_block(z.size(0)), fmt)
    embeds = base.get_input_embeddings()(torch.tensor([ids])).clone()
    sentinels = torch.tensor(ids) == fmt.latent_id
    assert int(sentinels.sum()) == z.size(0)
    embeds[0, sentinels] = z.to(embeds.dtype)
    return ids, mask, embeds


def plain_teacher_logprobs(base, fmt, rollout, z):
    """The teacher's action log-probs for one rollout, by hand (the base's forward over
    :func:`plain_teacher_inputs`)."""
    ids, mask, embeds = plain_teacher_inputs(base, fmt, rollout, z)
    return plain_action_logprobs(base, ids, mask, inputs_embeds=embeds)


def set_lora_b(composer, seed=0, scale=0.1):
    """Random non-zero LoRA-B matrices for the composer's adapter ψ (they start at 0, which would
    make an adapter left on invisible)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in composer.encoder.named_parameters():
            if "lora_B.default" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


# ----------------------------------------------------------------------------------------------
# What one LOPD step moves


def test_one_lopd_step_moves_lora_b_and_compressor_and_leaves_theta0(inputs, tmp_path):
    t = build(inputs, tmp_path / "run", **{"train.learning_rate": 1e-3,
                                           "lopd.composer_learning_rate": 1e-3})
    composer = t.algorithm.composer
    named = dict(composer.named_parameters())
    lora_b = {n: p.detach().clone() for n, p in named.items() if "lora_B.default" in n}
    chi = {n: p.detach().clone() for n, p in named.items() if n.startswith("compressor.")}
    anchor = {n: p.detach().clone() for n, p in named.items() if ".anchor." in n
              or n.startswith("anchor_compressor.")}
    base = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n
            and n.startswith("encoder.")}
    layers, targets = composer.base.config.num_hidden_layers, len(composer.spec.lora_targets)
    assert len(lora_b) == layers * targets and chi and anchor and base
    batch = junk_and_gold_batch(t, 2)
    t.algorithm.step(batch)
    named = dict(composer.named_parameters())
    # ψ's B matrices all receive a gradient on the first step (A does not: its gradient is B^T·…,
    # and B starts at 0), and so does every tensor of χ.
    assert [n for n, v in lora_b.items() if torch.equal(v, named[n])] == []
    assert [n for n, v in chi.items() if torch.equal(v, named[n])] == []
    for group in (anchor, base):
        for n, v in group.items():
            assert torch.equal(v, named[n]), n
    # With ψ moved, the teacher view (adapter off) is still exactly θ0: a fresh load's logits.
    fresh, _ = models.load_model("toolworld-1m")
    ids = torch.tensor([batch.rollouts[1].input_ids])
    with torch.no_grad():
        with composer.teacher() as teacher:
            theirs = teacher(input_ids=ids).logits
        adapted = composer.base(input_ids=ids).logits
        ours = fresh.eval()(input_ids=ids).logits
    assert torch.equal(theirs, ours)
    assert (adapted - ours).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------
# Δ by hand


def margin_weights(name, rollouts):
    """w per rollout, as DESIGN §3 defines the three settings (the advantage with a population
    std plus 1e-4, as ``lopd.margin_weight`` documents it)."""
    r = torch.tensor([x.reward for x in rollouts], dtype=torch.float64)
    if name == "signed_reward":
        return 2 * r - 1
    if name == "success":
        return torch.tensor([1.0 if x.success else -1.0 for x in rollouts], dtype=torch.float64)
    return (r - r.mean()) / (r.std(unbiased=False) + 1e-4)


def lopd_batch_with_a_silent_rollout(inputs, tmp_path, **sets):
    """A LOPD trainer whose student is random-init (the teacher is far ahead: Δ of several nats, so
    every term counts) and a step of two junk/gold pairs plus a fifth rollout without action
    tokens, which every mean over rollouts leaves out."""
    t = build(inputs, tmp_path / "run", **{"lopd.add_successes": False, **sets})
    t.ctx.student.load_state_dict(models.build_model(t.ctx.tokenizer, "qwen3-1m",
                                                     seed=1).state_dict())
    batch = junk_and_gold_batch(t, 2)
    first = batch.rollouts[0]
    silent = dataclasses.replace(first, action_mask=[0] * len(first.input_ids))
    return t, StepBatch(1, [*batch.tasks, batch.tasks[0]], [*batch.rollouts, silent])


def per_rollout_by_hand(t, rollouts):
    """Per rollout with action tokens, from plain forward passes: (index, token mean of the gap
    log π_T(a) − log π_S(a), action tokens n, token mean of KL(p̃_S ‖ p̃_T) over the teacher's
    top-M + tail)."""
    alg = t.algorithm
    traces = retrieve_traces(alg.bank, rollouts, alg.n_ret)
    found = []
    with torch.no_grad():
        for i, (rollout, refs) in enumerate(zip(rollouts, traces)):
            if not any(rollout.action_mask):
                continue
            z = alg.composer.encode([rollout.instruction], [refs])[0]
            with alg.composer.teacher() as base:
                ids, mask, embeds = plain_teacher_inputs(base, alg.fmt, rollout, z)
                teacher_rows = plain_action_rows(base, ids, mask, inputs_embeds=embeds)
            student_rows = plain_action_rows(t.ctx.student, rollout.input_ids, rollout.action_mask)
            targets = torch.tensor(rollout.input_ids[1:])[
                torch.tensor(rollout.action_mask[1:], dtype=torch.bool)][:, None]
            gap = (teacher_rows.gather(-1, targets) - student_rows.gather(-1, targets)).double()
            kl = losses.reverse_kl_top_m(student_rows, teacher_rows, alg.spec.top_m).double()
            found.append((i, gap.mean(), len(targets), kl.mean()))
    return found


@pytest.mark.parametrize("weight", ["signed_reward", "success", "advantage"])
def test_delta_equals_a_hand_computation_from_plain_forward_passes(inputs, tmp_path, weight):
    t, batch = lopd_batch_with_a_silent_rollout(inputs, tmp_path,
                                                **{"lopd.margin_weight": weight})
    rollouts = batch.rollouts
    hand = per_rollout_by_hand(t, rollouts)
    w = margin_weights(weight, rollouts)
    expected = sum(w[i] * gap for i, gap, _, _ in hand) / len(hand)
    unweighted = sum(gap for _, gap, _, _ in hand) / len(hand)
    assert len(hand) == 4 and abs(expected) > 0.1 and abs(expected - unweighted) > 0.1
    figures = t.algorithm.step(batch)
    assert figures["delta"] == pytest.approx(float(expected), rel=1e-5)


def test_the_dual_update_weights_delta_by_tokens_and_kl_phi_averages_rollout_means(inputs,
                                                                                     tmp_path):
    """The release's reductions: β moves by Δ̄ = Σ w_i·Δ_i·n_i / Σ n_i (not by the rollout mean Δ
    of the loss), and KL_φ is the mean over rollouts of each rollout's token mean (while the
    student's KL stays one token mean)."""
    t, batch = lopd_batch_with_a_silent_rollout(inputs, tmp_path, **{"lopd.dual_init": 0.7})
    rollouts = batch.rollouts
    hand = per_rollout_by_hand(t, rollouts)
    w = margin_weights("signed_reward", rollouts)
    tokens = sum(n for _, _, n, _ in hand)
    delta_tokens = sum(w[i] * gap * n for i, gap, n, _ in hand) / tokens
    delta_rollouts = sum(w[i] * gap for i, gap, _, _ in hand) / len(hand)
    kl_phi = sum(kl for *_, kl in hand) / len(hand)
    kl_student = sum(kl * n for _, _, n, kl in hand) / tokens
    assert abs(delta_tokens - delta_rollouts) > 0.05 and abs(kl_phi - kl_student) > 1e-3
    spec = t.algorithm.spec
    figures = t.algorithm.step(batch)
    assert figures["beta"] == 0.7
    assert figures["beta_next"] == pytest.approx(
        max(0.0, 0.7 + spec.dual_lr * (spec.margin - float(delta_tokens))), rel=1e-5)
    assert figures["kl_composer"] == pytest.approx(float(kl_phi), rel=1e-4)
    assert figures["kl"] == pytest.approx(float(kl_student), rel=1e-4)
    assert figures["delta"] == pytest.approx(float(delta_rollouts), rel=1e-5)
    assert figures["delta_tokens"] == pytest.approx(float(delta_tokens), rel=1e-5)


def test_a_skipped_student_update_skips_the_composer_update_and_the_dual_update(inputs,
                                                                                tmp_path):
    """An infinite student gradient (finite loss) skips the student's update; the composer's
    gradient is finite, yet φ, its optimiser and β stay as they were (the release gates both on
    the student's update), and the next good step moves all three."""
    t = build(inputs, tmp_path / "run", **{"lopd.dual_init": 0.7, "lopd.add_successes": False,
                                           "lopd.composer_learning_rate": 1e-3})
    alg = t.algorithm
    batch = junk_and_gold_batch(t, 2)
    student_param = next(p for p in t.ctx.student.parameters() if p.requires_grad)
    hook = student_param.register_hook(lambda g: g * float("inf"))
    phi = {n: p.detach().clone() for n, p in alg.composer.named_parameters() if p.requires_grad}
    figures = alg.step(batch)
    assert figures["student/skipped_updates"] == 1 and figures["composer/skipped_updates"] == 1
    assert torch.isfinite(torch.tensor(figures["composer/grad_norm"]))
    assert figures["beta_next"] == 0.7 and alg.beta == 0.7
    assert all(torch.equal(v, dict(alg.composer.named_parameters())[n]) for n, v in phi.items())
    assert not alg.composer_updater.optimizer.state
    hook.remove()
    figures = alg.step(batch)
    assert figures["student/skipped_updates"] == 1 and figures["composer/skipped_updates"] == 1
    assert figures["beta_next"] != 0.7
    assert any(not torch.equal(v, dict(alg.composer.named_parameters())[n]) for n, v in phi.items())


# ----------------------------------------------------------------------------------------------
# The two losses have separate graphs


def test_student_loss_reaches_no_composer_weight_and_composer_loss_no_student_weight(inputs,
                                                                                     tmp_path):
    # β > 0: the margin term β·(m − Δ) is in the composer's loss, and Δ holds student log-probs.
    t = build(inputs, tmp_path / "run", **{"lopd.dual_init": 0.7})
    alg = t.algorithm
    batch = junk_and_gold_batch(t, 2)
    state = alg.before_step(batch)
    state["_times"] = defaultdict(float)
    (micro,) = micro_batches(batch.rollouts, 0)
    terms = alg.loss(micro, alg.score(micro, state), state, Totals.of(batch.rollouts))
    theta = [p for p in t.ctx.student.parameters() if p.requires_grad]
    phi = alg.composer.trainable_parameters()
    student, composer = terms.losses["student"], terms.losses["composer"]

    def grads(loss, params):
        return torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)

    def reached(gs):
        return sum(1 for g in gs if g is not None and bool(g.abs().sum() > 0))

    assert reached(grads(student, phi)) == 0
    assert reached(grads(composer, theta)) == 0
    # Each loss does reach its own side (else the two checks above prove nothing).
    assert reached(grads(student, theta)) > len(theta) // 2
    assert reached(grads(composer, phi)) > len(phi) // 2


# ----------------------------------------------------------------------------------------------
# The teacher's scoring path with known embeddings over the sentinels


def test_known_embeddings_through_the_teacher_view_reproduce_the_plain_input_ids_run(
        inputs, monkeypatch):
    base, tokenizer = models.load_model("toolworld-1m")
    reference, _ = models.load_model("toolworld-1m")
    composer = Composer.load(inputs / "composer", base.eval(), tokenizer)
    set_lora_b(composer)          # an adapter left on in either pass would show
    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    n = 2 * composer.spec.num_latents
    known = tokenizer.encode("cancel order hold shipment refund customer doctor patient",
                             add_special_tokens=False)[:n]
    assert len(known) == n and fmt.latent_id not in known
    with ExperienceBank.open(inputs / "bank") as bank:
        rollouts = bank.stored_rollouts()[:3]
        traces = retrieve_traces(bank, rollouts, 2)
    assert len({len(r.input_ids) for r in rollouts}) > 1          # padding is exercised
    latents = reference.get_input_embeddings()(torch.tensor([known] * len(rollouts))).detach()
    monkeypatch.setattr(composer, "encode", lambda tasks, experiences, anchor=False: latents)
    with torch.no_grad():
        spliced, _ = LatentContext(composer, fmt).score(rollouts, traces)
        spliced_lp = spliced.token_logprobs()
        as_text = teacher_pass(composer, rollouts, fmt, blocks=[
            [*fmt.prefix, *known, *fmt.suffix]] * len(rollouts)).token_logprobs()
        plain = torch.cat([plain_action_logprobs(reference, *with_block(
            r, [*fmt.prefix, *known, *fmt.suffix], fmt)) for r in rollouts])
    assert spliced_lp.numel() == sum(sum(r.action_mask) for r in rollouts)
    assert (spliced_lp - plain).abs().max() < 1e-5
    assert (as_text - plain).abs().max() < 1e-5
    # Other embeddings over the sentinels change the scores: the splice is what is being measured.
    monkeypatch.setattr(composer, "encode", lambda tasks, experiences, anchor=False: latents * 3)
    with torch.no_grad():
        other, _ = LatentContext(composer, fmt).score(rollouts, traces)
    assert (other.token_logprobs() - plain).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# GRPO moves probability from the punished completion to the rewarded one


def sequence_logprobs(model, rollouts):
    with torch.no_grad():
        return [float(plain_action_logprobs(model, r.input_ids, r.action_mask).sum())
                for r in rollouts]


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("rewarded", ["gold", "junk"])
def test_grpo_step_raises_the_rewarded_and_lowers_the_punished_completion(inputs, tmp_path, step,
                                                                         rewarded):
    """One group per step, a junk and a gold rollout of one task. (With two groups in a step the
    other group's junk rollout, whose unlikely tokens have far larger gradients than a near-certain
    gold one's, can drag a gold rollout's shared tokens down: the direction of every single
    sequence is a property of one group.) Swapping the rewards swaps the directions: the step
    follows the rewards, not which completion is the oracle's."""
    cfg = lopd_config(inputs, **{"train.algorithm": "grpo", "train.learning_rate": 1e-4,
                                 "grpo.num_generations": 2, "grpo.num_iterations": 1,
                                 "grpo.beta": 0.0})
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    batch = junk_and_gold_batch(t, 1, step=step)
    junk, gold = batch.rollouts
    assert (junk.success, gold.success) == (False, True) and junk.reward < gold.reward
    assert sum(junk.action_mask) > 0 and sum(gold.action_mask) > 0
    if rewarded == "junk":
        junk, gold = (dataclasses.replace(junk, reward=gold.reward, success=True),
                      dataclasses.replace(gold, reward=junk.reward, success=False))
    rollouts = [junk, gold]
    before = sequence_logprobs(t.ctx.student, rollouts)
    figures = t.algorithm.step(StepBatch(step, batch.tasks, rollouts))
    after = sequence_logprobs(t.ctx.student, rollouts)
    assert figures["student/skipped_updates"] == 0
    up, down = (1, 0) if rewarded == "gold" else (0, 1)
    change = [a - b for a, b in zip(after, before)]
    assert change[up] > 1e-3 and change[down] < -1e-3, change
