"""lopd's GRPO step against TRL's ``GRPOTrainer``; lopd's rollout engine against ``model.generate``.

    .venv-bench/bin/python benchmarks/vs_trl.py --json runs/vs_trl.json
    .venv-bench/bin/python benchmarks/vs_trl.py --model runs/models/smollm2-135m \
        --json runs/vs_trl_smollm2.json

Runs in the benchmark profile (``.venv-bench``, built by ``make install-bench``; ``make bench-trl``
builds it and runs this): lopd's CPU set plus TRL (``constraints/bench-trl.txt``). TRL is not a
dependency of lopd. Both sides run in one process on ``run.num_threads`` torch threads (1 in the
``tiny`` preset, 2 in ``smollm2-135m``).

(a) One GRPO step of each, interleaved: TRL step 1, lopd step 1, TRL step 2, ... Step 1 of each is
warm-up and not counted. Both start from the same base with float32 weights: ``model.name_or_path``
of the config, the embedded toolworld-1m in the default ``tiny`` config; ``--model DIR`` takes a
model folder (``runs/models/smollm2-135m``, written by ``make smollm2``) with the ``smollm2-135m``
config unless ``--config`` names another. Both take their settings from the same lopd config
(``--config``, ``--set``; figures in brackets: ``tiny``, then ``smollm2-135m``):
``train.rollouts_per_step`` completions per step (32, 8) in groups of ``grpo.num_generations``
(4), ``rollout.max_completion_length`` tokens at most (96, 64), temperature / top-p / top-k of the
rollout section (1, 1, off), ``grpo.loss_type`` ('dapo' on both), ``grpo.epsilon`` /
``epsilon_high``, ``grpo.scale_rewards`` (by the sample std on both: ``grpo.std`` must be 'sample',
the only std TRL has), ``grpo.beta`` (0: no reference model on either side), one iteration
(``grpo.num_iterations`` must be 1: TRL spreads several over several optimiser steps, lopd makes
them inside one), AdamW at ``train.learning_rate`` with ``train.max_grad_norm`` and
``train.weight_decay`` (TRL: constant schedule, no warm-up), forward/backward passes over
``train.per_device_train_batch_size`` rollouts with gradients accumulated over the step (all
rollouts in one pass, 2; TRL: ``per_device_train_batch_size`` and ``gradient_accumulation_steps``
= rollouts per step / it, so that it generates the step's rollouts at once and updates once),
activation checkpointing when ``train.gradient_checkpointing`` is on (off, on; non-reentrant on
both; TRL's ``activation_checkpointing``, whose default in TRL is on, is set from the config).
TRL's resolved arguments are printed beside lopd's at start-up, and any difference stops the run.

Precision: both sides train in the precision lopd resolves ``run.precision`` to
(:func:`lopd.runtime.choose_precision`; 'auto' is bf16-mixed for SmolLM2 on a CPU with AMX-BF16 or
AVX-512 BF16, fp32 for the 1M-parameter models and on CPUs without them). bf16-mixed keeps float32
master weights and optimiser state and runs the forward passes under ``torch.autocast`` with
bfloat16: lopd around each rollout batch and each micro-batch. TRL gets ``bf16=True``, which on a
CPU is the same thing (read in the installed transformers 5.24 / accelerate 1.15): the Trainer
hands ``mixed_precision='bf16'`` to accelerate, whose ``Accelerator`` turns native AMP on for a CPU
device, and ``Accelerator.prepare_model`` wraps ``model.forward`` in
``torch.autocast(cpu, bfloat16)`` (outputs cast back to float32) without casting the weights;
GRPOTrainer's log-prob pass also enters ``accelerator.autocast()``, and ``model.generate`` reaches
the wrapped forward. (TRL's cast of the model to bfloat16 is on its continuous-batching generation
path only, which is off.) Checked at run time as well: a pre-hook on each model's decoder records,
for every forward pass with and without gradients, the autocast dtype in force, and after the
warm-up step the run stops unless both sides show float32 weights and the resolved precision's
autocast (bfloat16 for bf16-mixed, none for fp32) in generation and in training. lopd's rollouts
are therefore generated from its float32 weights under autocast (``rollout.generation_weights=
master``), as TRL's are: lopd's default on a CPU under bf16-mixed, a bfloat16 copy of the weights
refreshed after each update, has no counterpart in TRL (it decodes SmolLM2 1.9x (batch 8) to
3.7x (batch 32) faster: docs/results/rollout-engines-smollm2.md).

The prompts are single-turn and the same on both sides: step s takes the task groups lopd's
trainer draws for step s (:meth:`lopd.trainer.Trainer.step_tasks`), each task's first-turn
messages (system prompt with its tools, the user's request) rendered by the tokenizer's chat
template with the generation prompt. lopd gets them through its own trainer with ``rollout.max_turns=1`` (one
assistant turn, then the episode ends); TRL gets the rendered text (a "standard" prompt, which its
tokenizer call turns into the same ids: checked at start-up) in a dataset laid out in that order,
not shuffled. The reward is the same on both sides, toolworld's verifier after that one turn: lopd's
episode loop parses the turn, runs the tool call in the environment and verifies; TRL's reward
function decodes each completion's ids as lopd's loop does (TRL's own decoded ``completions`` drop
special tokens, toolworld's ``<tool_call>`` markers among them, so no tool call would parse) and
replays it in a fresh episode of the task the same way.

Each step is timed in CPU seconds (``time.process_time``, all threads of the process) and wall
seconds. lopd's step is :func:`lopd_step`: rollouts through the trainer's engine, then
``algorithm.step`` (no logging, evaluation or checkpoint, as ``benchmarks/step_cost.py`` runs it).
TRL's step is its own training loop's, timed by a callback from the end of one optimiser step to the
end of the next: the batch from its dataloader, generation, reward, advantages, the loss forward,
backward, clipping, optimiser and scheduler steps, and its per-step metric bookkeeping (logging,
saving and evaluation are off, ``report_to="none"``). lopd's step runs inside that callback, outside
TRL's timed span.

(b) lopd's :class:`~lopd.rollout.TransformersEngine` against ``model.generate`` called as TRL calls
it (left-padded batch, ``GenerationConfig`` with ``do_sample``, the same temperature / top-p /
top-k, the eos ids as stops), on the same prompts: repeat r generates for the 32 prompts of step
r + 1 as lopd's trainer draws them (with the defaults, those of a measured step of (a)),
``rollout.max_completion_length`` new tokens at most, each row ending at its first stop token.
Both run one copy of the model loaded as lopd loads an inference-only model (``run.dtype``; 'auto':
bfloat16 weights under bf16-mixed, float32 under fp32), without autocast: the same weights and
arithmetic on both sides, which is not (a)'s float32-with-autocast. Generated tokens (the stop token
included) per second; the two interleaved, after one warm-up call each.

Differences that remain between the two setups of (a):

* TRL's generation is ``model.generate``, which keeps a finished row in the batch (padding) until
  the longest row ends and prefills every prompt of a group; lopd's engine drops a row the moment
  it stops, prefills a prompt given several times (a group's) once, and prefills prompts of
  similar length together. Part (b) measures the engines on the same prompts.
* lopd's engine returns each sampled token's log-prob (kept with the rollout; GRPO with μ = 1 does
  not need it); TRL's non-vLLM path returns none.
* lopd's rollout is an episode of the agent loop: the assistant turn is parsed and the tool call
  executed during the rollout, and the tool's answer (template tokens and the observation, mask 0)
  is appended to the sequence (the table's sequence tokens); lopd's scoring reads each sequence up
  to its last completion token only, as TRL's does.
* Both apply the output head only where a completion (action) token is predicted, in tiles (TRL's
  fused log-prob head) or chunks (lopd's); TRL's head also computes each token's entropy (for its
  metric), lopd's only the log-probs. TRL's batch is the prompts left-padded to the longest prompt
  and the completions right-padded to the longest completion; lopd's is whole sequences
  right-padded to the longest.
* TRL shuffles the generated batch, gathers metrics across processes (one here) and keeps
  per-step metric lists (completion lengths, rewards, entropy, clip ratios); lopd returns its step
  figures as a dict. TRL's reward replays each completion in the environment after generation;
  lopd's environment steps happen inside the episode loop (the same work, done once).
* lopd's episode loop renders the chat template for each distinct opening (with and without the
  generation prompt: once per task, not per completion) and the text after each turn, and
  tokenises them; TRL tokenises each prompt text once. This is in lopd's generation column.
* TRL's trainer loop estimates FLOPs and counts input tokens per step and runs its callbacks; lopd
  zeroes the gradient rows of ``<|latent|>`` (a hook on the embedding; the student loss never trains
  that token) and skips an update whose loss or gradient norm is not finite.
* Under bf16-mixed, TRL's autocast is entered per forward call (accelerate's wrapper of
  ``model.forward``) while lopd's spans the whole rollout batch. torch keeps autocast's bfloat16
  copies of the weights only until the outermost autocast exits, so TRL's ``model.generate`` casts
  every weight again at each decoded token and lopd's engine once per rollout batch (lopd's engine
  had the same cost until it generated under ``no_grad`` in place of ``inference_mode``). This is
  TRL's behaviour as shipped and is left in its generation column.
* TRL's 'dapo' loss divides by the batch's completion tokens, lopd's by its action tokens (the
  same tokens here: one turn, its end-of-turn token included on both sides).
* The samples differ (different random streams), so completion lengths and rewards differ from
  step to step; their means are in the table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lopd import chat, models, runtime, stages
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch
from lopd.config import load_config
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json
from lopd.trainer import Trainer, step_seed


def clocks() -> tuple[float, float]:
    """(CPU seconds of the process, wall seconds) now."""
    return time.process_time(), time.perf_counter()


def since(start: tuple[float, float]) -> dict[str, float]:
    """CPU and wall seconds elapsed since ``start`` (a :func:`clocks` reading)."""
    cpu, wall = clocks()
    return {"cpu_s": cpu - start[0], "wall_s": wall - start[1]}


def lopd_step(trainer: Trainer, step: int) -> dict:
    """One GRPO step of lopd's trainer, as its loop runs it, without logging, evaluation or
    checkpoint: rollouts of the step's tasks, then ``algorithm.step``."""
    cfg = trainer.cfg
    seed = step_seed(cfg.run.seed, step)
    runtime.set_seed(seed)
    tasks = trainer.step_tasks(step)
    start = clocks()
    rollouts = trainer.rollouts(tasks, cfg.rollout.temperature, seed)
    generation = since(start)
    trainer.ctx.student.train()
    figures = trainer.algorithm.step(StepBatch(step, tasks, rollouts))
    stages.sync_engine(trainer.engine, trainer.ctx.student)
    return {**since(start), "generation_cpu_s": generation["cpu_s"],
            "generation_wall_s": generation["wall_s"],
            "completion_tokens": figures["action_tokens"] / len(rollouts),
            "sequence_tokens": statistics.mean(len(r.input_ids) for r in rollouts),
            "reward": statistics.mean(r.reward for r in rollouts),
            "groups_without_signal": figures["groups_without_signal"]}


def prompt_text(env, tokenizer, task) -> str:
    """A task's first-turn prompt as text: its messages and tools through the chat template, with
    the generation prompt (what lopd's episode loop feeds the engine at turn one)."""
    episode = env.reset(task)
    text = chat.render(tokenizer, episode.messages(), task.tools, add_generation_prompt=True,
                         tokenize=False)
    if tokenizer(text)["input_ids"] != chat.render(tokenizer, episode.messages(), task.tools,
                                                     add_generation_prompt=True):
        raise RuntimeError(f"task {task.task_id}: the prompt text does not tokenise to the ids "
                           "lopd's episode loop uses, so TRL would see other prompts")
    return text


def single_turn_reward(env, task, text: str) -> float:
    """Toolworld's verdict after the assistant writes ``text`` as its only turn: parsed and stepped
    in a fresh episode, then verified, as lopd's episode loop does."""
    episode = env.reset(task)
    episode.step(chat.parse_action(text, episode.tools))
    return float(episode.verify().reward)


def timed(fn, log: list[dict]):
    """``fn``, appending the CPU and wall seconds of each call to ``log``."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        start = clocks()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append(since(start))

    return call


class ForwardPrecision:
    """What a model's forward passes run in, seen from inside: a pre-hook on its decoder records,
    for each pass, whether gradients are on (training) or off (generation) and the autocast dtype
    in force on ``device_type`` ('none' without autocast)."""

    def __init__(self, model, device_type: str):
        self.model, self.device_type, self.seen = model, device_type, set()
        model.get_decoder().register_forward_pre_hook(self.record)

    def record(self, module, args) -> None:
        dtype = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.") \
            if torch.is_autocast_enabled(self.device_type) else "none"
        self.seen.add(("training" if torch.is_grad_enabled() else "generation", dtype))

    def observed(self) -> dict[str, str]:
        """Weight dtypes, then per phase the autocast dtypes its forward passes ran under."""
        weights = sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters()})
        phases = {phase: sorted(d for p, d in self.seen if p == phase)
                  for phase in ("generation", "training")}
        return {"weights": "/".join(weights),
                **{f"{phase} autocast": "/".join(d) or "(no pass)" for phase, d in phases.items()}}


def expected_precision(precision: str) -> dict[str, str]:
    """What :meth:`ForwardPrecision.observed` must show for a resolved lopd precision."""
    autocast = "bfloat16" if precision == "bf16-mixed" else "none"
    return {"weights": "float32", "generation autocast": autocast, "training autocast": autocast}


def matched_settings(cfg, trainer: Trainer, args) -> list[tuple[str, object, object]]:
    """(setting, lopd's value, TRL's) for every setting both sides take from the config, TRL's as its
    ``GRPOConfig`` resolved them."""
    rollouts = cfg.train.rollouts_per_step
    micro = trainer.algorithm.micro_batch_size or rollouts
    return [
        ("completions per step", rollouts, args.generation_batch_size),
        ("completions per prompt", trainer.algorithm.group_size, args.num_generations),
        ("max completion tokens", cfg.rollout.max_completion_length, args.max_completion_length),
        ("temperature", cfg.rollout.temperature, args.temperature),
        ("top_p", cfg.rollout.top_p, args.top_p),
        ("top_k", cfg.rollout.top_k, args.top_k),
        ("loss", cfg.grpo.loss_type, args.loss_type),
        ("epsilon", cfg.grpo.epsilon, args.epsilon),
        ("epsilon_high", cfg.grpo.epsilon_high, args.epsilon_high),
        ("scale_rewards", cfg.grpo.scale_rewards, args.scale_rewards),
        ("beta", cfg.grpo.beta, args.beta),
        ("iterations", cfg.grpo.num_iterations, args.num_iterations),
        ("learning rate", cfg.train.learning_rate, args.learning_rate),
        ("weight decay", cfg.train.weight_decay, args.weight_decay),
        ("max grad norm", cfg.train.max_grad_norm, args.max_grad_norm),
        ("rollouts per forward/backward", micro, args.per_device_train_batch_size),
        ("forward/backward passes per step", rollouts // micro, args.gradient_accumulation_steps),
        ("activation checkpointing", cfg.train.gradient_checkpointing,
         args.activation_checkpointing),
        ("precision", trainer.precision, "bf16-mixed" if args.bf16 else "fp32"),
    ]


def trl_trainer(cfg, trainer: Trainer, steps: int, out: Path, log: dict[str, list], callback):
    """TRL's GRPOTrainer on a fresh copy of lopd's base, with lopd's settings (see the module
    docstring), over a dataset holding the first-turn prompts of lopd's steps 1..``steps`` in order.
    Its reward function appends each step's completion tokens and rewards to ``log["reward"]``;
    each ``model.generate`` call's seconds go to ``log["generate"]``. Returns the trainer and the
    model it trains."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    env, tokenizer = trainer.env, trainer.ctx.tokenizer
    group = trainer.algorithm.group_size
    rows = [{"prompt": prompt_text(env, tokenizer, task), "task_id": task.task_id}
            for step in range(1, steps + 1) for task in trainer.step_tasks(step)[::group]]
    tasks = trainer.ctx.train_tasks
    prompt_tokens = {row["task_id"]: len(tokenizer(row["prompt"])["input_ids"]) for row in rows}
    stops = {tokenizer.convert_tokens_to_ids(chat.turn_end_token(tokenizer)),
             tokenizer.eos_token_id}

    def text_of(ids: list[int]) -> str:
        """A completion's text as lopd's episode loop decodes a turn: special tokens kept (TRL's
        own ``completions`` drop them, and with them toolworld's ``<tool_call>`` markers), the
        closing stop token left out."""
        ids = ids[:-1] if ids and ids[-1] in stops else ids
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def toolworld_reward(prompts, completions, completion_ids, task_id, **_) -> list[float]:
        rewards = [single_turn_reward(env, tasks[t], text_of(ids))
                   for t, ids in zip(task_id, completion_ids)]
        # TRL generates each prompt's completions side by side: rows i*G .. i*G+G-1 are a group.
        groups = [rewards[i:i + group] for i in range(0, len(rewards), group)]
        log["reward"].append({
            "completion_tokens": statistics.mean(map(len, completion_ids)),
            "sequence_tokens": statistics.mean(prompt_tokens[t] + len(c)
                                               for t, c in zip(task_id, completion_ids)),
            "reward": statistics.mean(rewards),
            "groups_without_signal": statistics.mean(float(len(set(g)) == 1) for g in groups)})
        return rewards

    rollouts = cfg.train.rollouts_per_step
    micro = trainer.algorithm.micro_batch_size or rollouts
    if rollouts % micro:
        raise ValueError(f"train.rollouts_per_step ({rollouts}) must be a multiple of "
                         f"train.per_device_train_batch_size ({micro}): TRL accumulates whole "
                         "micro-batches")
    # bf16 on a CPU: accelerate's autocast around model.forward over float32 weights, lopd's
    # bf16-mixed (module docstring); checked on the forward passes after the warm-up step.
    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, seed=cfg.run.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rollouts // micro,
        num_generations=group, max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        loss_type=cfg.grpo.loss_type, scale_rewards=cfg.grpo.scale_rewards, beta=cfg.grpo.beta,
        num_iterations=cfg.grpo.num_iterations, epsilon=cfg.grpo.epsilon,
        epsilon_high=cfg.grpo.epsilon_high,
        learning_rate=cfg.train.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
        optim="adamw_torch", use_cpu=trainer.device.type == "cpu",
        bf16=trainer.precision == "bf16-mixed", fp16=False,
        activation_checkpointing=cfg.train.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False}, shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    model, _ = models.load_model(cfg.model.name_or_path, device=trainer.device,
                                 dtype=torch.float32)
    model.generate = timed(model.generate, log["generate"])
    trl = GRPOTrainer(model=model, reward_funcs=toolworld_reward, args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                      callbacks=[callback])
    trl.remove_callback(PrinterCallback)  # its end-of-training summary line
    return trl, model


def interleaved_steps(cfg, trainer: Trainer, steps: int, out: Path) -> tuple[dict, dict]:
    """Steps 1..``steps`` of TRL and of lopd, alternating (TRL first): per-step records of each, and
    each side's precision and settings as set and as observed (the run stops after the warm-up step
    if they differ)."""
    from transformers import TrainerCallback

    records: dict[str, list[dict]] = {"trl": [], "lopd": []}
    trl_log: dict[str, list] = {"reward": [], "generate": []}
    setup: dict = {}

    class Alternate(TrainerCallback):
        """Times each TRL step from the end of the previous one (the start of training for the
        first) to the end of its own optimiser step, then runs lopd's step of the same number."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.calls = clocks(), 0

        def on_step_end(self, args, state, control, **kwargs):
            generate = trl_log["generate"][self.calls:]
            record = {**since(self.start), **trl_log["reward"][-1],
                      "generation_cpu_s": sum(g["cpu_s"] for g in generate),
                      "generation_wall_s": sum(g["wall_s"] for g in generate)}
            records["trl"].append(record)
            ours = lopd_step(trainer, state.global_step)
            records["lopd"].append(ours)
            print(f"step {state.global_step}: TRL {record['cpu_s']:.2f} CPU s "
                  f"{record['wall_s']:.2f} wall s, lopd {ours['cpu_s']:.2f} CPU s "
                  f"{ours['wall_s']:.2f} wall s", flush=True)
            if state.global_step == 1:
                setup.update(check_precision(cfg, trainer, trl, probes))
            self.start, self.calls = clocks(), len(trl_log["generate"])

    trl, model = trl_trainer(cfg, trainer, steps, out, trl_log, Alternate())
    settings = matched_settings(cfg, trainer, trl.args)
    print(format_table(["setting", "lopd", "TRL"], [[k, str(a), str(b)] for k, a, b in settings],
                       title="settings of both sides (TRL's as its GRPOConfig resolved them)"),
          flush=True)
    differing = [k for k, a, b in settings if a != b]
    if differing:
        raise RuntimeError(f"lopd and TRL would run with different settings: {differing}")
    setup["settings"] = {k: a for k, a, _ in settings}
    device_type = trainer.device.type
    probes = {"lopd": ForwardPrecision(trainer.ctx.student, device_type),
              "trl": ForwardPrecision(model, device_type)}
    trl.train()
    return records, setup


def check_precision(cfg, trainer: Trainer, trl, probes: dict[str, ForwardPrecision]) -> dict:
    """After the warm-up step: each side's precision as set (lopd's ``run.precision`` resolved;
    TRL's accelerate state) and as observed in its forward passes (:class:`ForwardPrecision`);
    printed, and an error unless both show the resolved precision and the configured activation
    checkpointing."""
    precision, why = runtime.choose_precision(cfg.run.precision, trainer.device,
                                              runtime.hidden_size(trainer.ctx.student))
    accelerator = trl.accelerator
    wrapped = hasattr(trl.model, "_original_forward")  # accelerate's autocast wrapper of forward
    how = {"lopd": f"run.precision={cfg.run.precision} -> {precision} ({why})",
           "trl": f"bf16={trl.args.bf16} -> accelerate mixed_precision="
                  f"{accelerator.mixed_precision!r}, native_amp={accelerator.native_amp}, "
                  f"model.forward {'wrapped in' if wrapped else 'without'} autocast"}
    observed = {side: {**probe.observed(),
                       "activation checkpointing": str(probe.model.is_activation_checkpointing)}
                for side, probe in probes.items()}
    expected = {**expected_precision(trainer.precision),
                "activation checkpointing": str(cfg.train.gradient_checkpointing)}
    names = {"lopd": "lopd", "trl": "TRL"}
    keys = list(expected)
    print(format_table(["side", *keys], [[names[side], *(observed[side][k] for k in keys)]
                                         for side in probes],
                       title=f"precision as run: forward passes of the warm-up step, seen by a hook "
                       f"on each decoder ({trainer.precision} expects {expected})"))
    for side in probes:
        print(f"{names[side]} precision set by: {how[side]}", flush=True)
    wrong = {names[side]: {k: v for k, v in seen.items() if v != expected[k]}
             for side, seen in observed.items()}
    wrong = {side: w for side, w in wrong.items() if w}
    if wrong:
        raise RuntimeError(f"precision or checkpointing not as resolved ({expected}): {wrong}")
    return {"precision": trainer.precision, "precision_set_by": how, "observed": observed}


def generate_tokens(model, tokenizer, prompts: list[list[int]], params: SamplingParams,
                    stop_ids: list[int]) -> int:
    """Generated tokens of ``model.generate`` as TRL's GRPOTrainer calls it: a left-padded batch,
    sampling settings in a ``GenerationConfig``; each row counted up to its first stop token."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=True,
                              temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, pad_token_id=pad,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids,
                              disable_compile=True)
    torch.manual_seed(params.seed)
    with torch.no_grad():
        new = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=config)[:, width:]
    stops = torch.isin(new, torch.tensor(stop_ids, device=new.device))
    lengths = torch.where(stops.any(1), stops.int().argmax(1) + 1, new.shape[1])
    return int(lengths.sum())


def engine_vs_generate(cfg, prompt_sets: list[list[list[int]]],
                       repeats: int) -> tuple[dict[str, list], str]:
    """Repeats of lopd's engine and of ``model.generate`` on the same prompts (``prompt_sets[r]``
    in repeat r), interleaved, after one warm-up call each on ``prompt_sets[0]``: per-repeat
    generated tokens and seconds of each, and the dtype of the model's weights (``run.dtype``)."""
    model, tokenizer = stages.load_model(cfg)
    engine = TransformersEngine(model, tokenizer)
    stop_ids = sorted(engine.stop_token_ids)
    records: dict[str, list] = {"transformers_engine": [], "model_generate": []}
    for repeat in range(repeats + 1):
        prompts = prompt_sets[repeat]
        params = SamplingParams.from_config(cfg.rollout, cfg.rollout.temperature, seed=repeat)
        start = clocks()
        tokens = sum(len(g.token_ids) for g in engine.generate(prompts, params))
        ours = {**since(start), "tokens": tokens}
        start = clocks()
        tokens = generate_tokens(model, tokenizer, prompts, params, stop_ids)
        theirs = {**since(start), "tokens": tokens}
        if repeat:
            records["transformers_engine"].append(ours)
            records["model_generate"].append(theirs)
            print(f"repeat {repeat}: engine {ours['tokens'] / ours['wall_s']:.0f} tokens/s, "
                  f"model.generate {theirs['tokens'] / theirs['wall_s']:.0f} tokens/s", flush=True)
    return records, str(next(model.parameters()).dtype).removeprefix("torch.")


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=11, help="steps of each trainer (the first "
                        "is warm-up; 6 or more for a measurement, 2 for a smoke test)")
    parser.add_argument("--repeats", type=int, default=10, help="measured generation calls of "
                        "each engine in (b) (5 or more for a measurement)")
    parser.add_argument("--model", help="a model folder (model.name_or_path), e.g. "
                        "runs/models/smollm2-135m; the config is then smollm2-135m unless "
                        "--config names another")
    parser.add_argument("--config", help="lopd config (default: tiny; smollm2-135m with --model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: one warm-up step and at least one measured")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.steps < 6 or args.repeats < 5:
        print("fewer than 5 measured steps or repeats: a smoke test, not a measurement")

    config = args.config or ("smollm2-135m" if args.model else "tiny")
    model_path = [f"model.name_or_path={args.model}"] if args.model else []
    sets = [*args.overrides, *model_path, "train.algorithm=grpo", "rollout.max_turns=1",
            "rollout.generation_weights=master", f"train.max_steps={args.steps}"]
    cfg = load_config(config, sets)
    if cfg.grpo.num_iterations != 1:
        parser.error("grpo.num_iterations must be 1: TRL spreads several iterations over several "
                     "optimiser steps, lopd makes them within one step")
    if cfg.grpo.std != "sample":
        parser.error("grpo.std must be 'sample': TRL divides group rewards by the sample std")
    runtime.set_threads(cfg.run.num_threads)
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp) / "lopd", get_algorithm("grpo"), progress=False)
        print(f"config {config}, model {cfg.model.name_or_path}; precision {trainer.precision} "
              f"on both sides (checked after the warm-up step)", flush=True)
        steps, setup = interleaved_steps(cfg, trainer, args.steps, Path(tmp) / "trl")
        precision = trainer.precision
        tokenizer = trainer.ctx.tokenizer
        prompt_sets = [[chat.render(tokenizer, trainer.env.reset(t).messages(), t.tools,
                                      add_generation_prompt=True) for t in trainer.step_tasks(s)]
                       for s in range(1, args.repeats + 2)]
        device = str(trainer.device)
    generation, weights = engine_vs_generate(cfg, prompt_sets, args.repeats)
    threads = torch.get_num_threads()

    measured = {side: records[1:] for side, records in steps.items()}
    summary = {side: {"cpu_s": spread([r["cpu_s"] for r in rs]),
                      "wall_s": spread([r["wall_s"] for r in rs]),
                      "generation_cpu_s": statistics.median(r["generation_cpu_s"] for r in rs),
                      "rest_cpu_s": statistics.median(r["cpu_s"] - r["generation_cpu_s"]
                                                      for r in rs),
                      **{k: statistics.mean(r[k] for r in rs)
                         for k in ("completion_tokens", "sequence_tokens", "reward",
                                   "groups_without_signal")}}
               for side, rs in measured.items()}
    names = {"trl": f"TRL {trl.__version__} GRPOTrainer", "lopd": "lopd GRPO"}
    micro = setup["settings"]["rollouts per forward/backward"]
    micro_batches = setup["settings"]["forward/backward passes per step"]
    rows = [[names[side], *(s["cpu_s"][k] for k in ("min", "median", "max")),
             *(s["wall_s"][k] for k in ("min", "median", "max")), s["generation_cpu_s"],
             s["rest_cpu_s"], round(s["completion_tokens"], 1), round(s["sequence_tokens"], 1),
             round(s["reward"], 3), round(s["groups_without_signal"], 2)]
            for side, s in summary.items()]
    print(format_table(["trainer", "CPU s min", "median", "max", "wall s min", "median", "max",
                        "generation CPU s", "rest CPU s", "completion tok", "sequence tok",
                        "reward", "flat groups"], rows,
                       title=f"(a) one GRPO step of {Path(cfg.model.name_or_path).name} on "
                       f"{device}, {precision} on both (float32 weights"
                       f"{', bfloat16 autocast' if precision == 'bf16-mixed' else ''}): "
                       f"{cfg.train.rollouts_per_step} single-turn completions "
                       f"({cfg.grpo.num_generations} per prompt), <= "
                       f"{cfg.rollout.max_completion_length} tokens, T={cfg.rollout.temperature}, "
                       f"loss {cfg.grpo.loss_type}, {micro_batches} forward/backward pass(es) of "
                       f"{micro} rollouts, activation checkpointing "
                       f"{'on' if cfg.train.gradient_checkpointing else 'off'}, steps "
                       f"2-{args.steps} interleaved, {threads} thread(s); generation / rest: "
                       f"medians; tokens, reward: means per completion; flat groups: share of "
                       f"groups with one reward"))

    rates = {name: [r["tokens"] / r["wall_s"] for r in rs] for name, rs in generation.items()}
    cpu_rates = {name: [r["tokens"] / r["cpu_s"] for r in rs] for name, rs in generation.items()}
    engines = {name: {"tokens_per_wall_s": spread(rates[name]),
                      "tokens_per_cpu_s": spread(cpu_rates[name]),
                      "tokens": statistics.mean(r["tokens"] for r in rs)}
               for name, rs in generation.items()}
    labels = {"transformers_engine": "lopd TransformersEngine", "model_generate": "model.generate"}
    print()
    print(format_table(["engine", "tokens/s min", "median", "max", "tokens/CPU s median",
                        "gen tokens per call"],
                       [[labels[n], round(e["tokens_per_wall_s"]["min"]),
                         round(e["tokens_per_wall_s"]["median"]),
                         round(e["tokens_per_wall_s"]["max"]),
                         round(e["tokens_per_cpu_s"]["median"]), round(e["tokens"], 1)]
                        for n, e in engines.items()],
                       title=f"(b) {len(prompt_sets[0])} prompts per call, {weights} weights "
                       f"without autocast on both, <= "
                       f"{cfg.rollout.max_completion_length} new tokens, natural stops, "
                       f"T={cfg.rollout.temperature}, {args.repeats} calls each interleaved "
                       f"after one warm-up"))

    step_ratio = summary["lopd"]["cpu_s"]["median"] / summary["trl"]["cpu_s"]["median"]
    wall_ratio = summary["lopd"]["wall_s"]["median"] / summary["trl"]["wall_s"]["median"]
    engine_ratio = (engines["transformers_engine"]["tokens_per_wall_s"]["median"]
                    / engines["model_generate"]["tokens_per_wall_s"]["median"])
    print(f"\nper step (medians): lopd {summary['lopd']['cpu_s']['median']:.2f} CPU s "
          f"{summary['lopd']['wall_s']['median']:.2f} wall s, TRL "
          f"{summary['trl']['cpu_s']['median']:.2f} CPU s "
          f"{summary['trl']['wall_s']['median']:.2f} wall s")
    print(f"lopd/TRL step time (medians): {step_ratio:.2f} CPU, {wall_ratio:.2f} wall")
    print(f"lopd engine / model.generate tokens/s (medians): {engine_ratio:.2f}")
    write_json(args.json_path, {
        "device": device, "threads": threads, "steps": args.steps, "repeats": args.repeats,
        "config": config, "model": cfg.model.name_or_path, "precision": setup["precision"],
        "precision_set_by": setup["precision_set_by"],
        "precision_observed": setup["observed"], "generation_weights": weights,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "settings": setup["settings"],
        "steps_summary": summary, "lopd_over_trl_cpu": step_ratio,
        "lopd_over_trl_wall": wall_ratio, "engines": engines,
        "engine_over_generate": engine_ratio, "per_step": steps, "per_generation": generation})


if __name__ == "__main__":
    main()
