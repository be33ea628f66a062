"""How close each phase of a GRPO step and of an LOPD step comes to this CPU's matmul peak.

    python benchmarks/roofline.py --json docs/results/roofline/roofline.json
    python benchmarks/roofline.py --model toolworld-1m --threads 1      # smoke test, seconds
    python benchmarks/roofline.py --rollouts 4 --max-turns 2 --max-new-tokens 16 --new-tokens 16

(The last: SmolLM2 in about 7 minutes on 2 busy cores. With the preset's 8 turns of 64 tokens a
step's rollout alone takes many minutes here: most of it bf16-mixed decode steps.)

Three measurements, in one process:

1. **Peak.** Square matmuls (``--peak-sizes``, default 1024 and 2048) in float32 and bfloat16 at 1
   and 2 threads (and ``--threads``), each figure the best of ``--peak-repeats`` timings (each
   one warm-up matmul and two timed, :func:`precision.matmul_gflops`). The peak a phase is held
   against is the best figure over the sizes at the run's thread count: the bf16 one and the
   float32 one, both given as columns.
2. **Steps.** ``--steps`` whole training steps of GRPO, then of LOPD, on ``--model`` (default the
   SmolLM2-135M folder ``make smollm2`` prepares) through lopd's own trainer and algorithms, as
   ``benchmarks/step_cost.py`` runs one (:func:`step_cost.one_step`: the trainer's rollouts, then
   ``algorithm.step``), on the ``--config`` preset (default ``smollm2-135m``; ``tiny`` for the
   embedded 1M model), in ``run.precision: auto``'s choice (``--precision`` overrides). LOPD
   reads, as ``benchmarks/gpu_check.py`` builds them, an untrained composer made from the model
   itself and a bank of oracle episodes of the 64 training tasks (the embedded 1M model: its own
   cold-started composer and bank). Step 1 is warm-up; the step reported is the measured step
   of median duration (the last when ``--steps 2``); the JSON holds every step.
   Times are lopd's own step timing (``time/rollout``, ``before_step``, ``student_forward``,
   ``teacher`` with its parts ``composer`` Z_φ and ``anchor`` Z_φ0, ``backward``,
   ``optimizer``, ``after_update``), plus two this script takes: the loss (``algorithm.loss``,
   where the output head runs on the action positions: lopd times it in no phase) and, within
   the rollout, the model's forward calls split into prefill and decode
   (:class:`multiturn_cache.ForwardClock`); the rest of the rollout is sampling, the
   environment and the chat template. "rest of the step" is the step's time outside all phases.
3. **Generation.** lopd's :class:`~lopd.rollout.TransformersEngine` over the GRPO trainer's
   student (float32 weights under the run's autocast, as the steps of 2. generate with
   ``rollout.generation_weights=master``, which this script sets), on the
   first-turn prompts of ``--batch`` toolworld tasks, generating ``--new-tokens`` tokens per
   prompt at T = 1 with the stop tokens turned off (every row decodes all of them, so the batch
   stays full), after a 2-token warm-up. The engine has no hook between prefill and decode; its
   model's forward calls are timed (ForwardClock): a call with more than one new position is
   prefill, one with one is a decode step (the decode's tokens are one fewer per row than those
   generated: the first comes from the prefill's logits).

FLOPs are counted from what the models really ran, by hooks on each watched model's decoder
stack and output head (the student, and LOPD's one frozen base that serves the composer's
encoder and the teacher), each call tagged with the phase running it:

- a decoder call on a batch of B rows, W positions wide, where row i has n_i real new tokens and
  p_i real earlier ones (a KV cache, or the kept cache of an earlier turn): linear layers
  2·N·Σn_i, with N the decoder's non-embedding parameters (LoRA adapters and the composer's
  compressor left out: a few percent of the composer's work), and causal attention
  2·2·L·A·Σ(n_i·p_i + n_i(n_i+1)/2), with L layers and A = heads × head dim (QKᵀ and AV, 2 FLOPs
  each per query-key pair and width; a prefill of T tokens is 2·L·T²·A, half the square);
- the output head 2·d·V per position it is applied to: the action positions in scoring
  (:func:`lopd.teacher.action_logits`, in the loss's chunks), the last position of a prefill
  and every row of a decode step;
- backward: 2× the forward where the weights train (the student: activation and weight
  gradients), 1× where only activations carry a graph (LOPD's teacher pass, whose spliced
  latents lead back to the composer, and the composer's frozen encoder under its LoRA adapter),
  nothing for passes without one (rollouts, the anchor); plus, inside the backward, the
  recomputed forward of every layer under activation checkpointing
  (``train.gradient_checkpointing``) and of each loss chunk (checkpointed too).
  Elementwise work (norms, softmax, the KL, AdamW) and the embedder of the bank are not counted.

``tokens`` are the real (unpadded) positions a phase ran its layers on (for the loss, the head's
positions; for the backward, those of the forwards that carry a graph); ``padded`` are the
positions of the padded batches it really computed; the GFLOP, GFLOP/s and peak fractions count
real tokens only (the padded batches' own FLOPs are in the JSON, ``gflop_padded``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from functools import wraps
from pathlib import Path

import torch
from transformers import AutoConfig

from lopd import agent, models, policies, runtime, stages
from lopd.algorithms import get_algorithm
from lopd.config import load_config
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json
from lopd.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from multiturn_cache import ForwardClock
from precision import matmul_gflops
from step_cost import lopd_inputs, one_step

CPU = torch.device("cpu")
TRAIN_TASKS = 64
"""Training tasks of a real model's run: its bank holds one oracle episode of each."""
ROWS = (("rollout", "rollout"), ("rollout/prefill", "  prefill"), ("rollout/decode", "  decode"),
        ("rollout/rest", "  sampling, env, template"), ("before_step", "before_step"),
        ("student_forward", "student_forward"), ("teacher", "teacher"),
        ("composer", "  composer Z_phi"), ("anchor", "  anchor Z_phi0"),
        ("teacher/pass", "  teacher pass"), ("loss", "loss (head, KL)"), ("backward", "backward"),
        ("optimizer", "optimizer"), ("after_update", "after_update"),
        ("other", "rest of the step"), ("step", "whole step"))
PARTS = ("rollout", "before_step", "student_forward", "teacher", "loss", "backward", "optimizer",
         "after_update")
"""The step's phases that do not overlap; the rest of the step is the time outside them."""
COUNTED = ("rollout", "student_forward", "teacher", "loss", "backward")
"""The phases whose matmuls are counted."""
COLUMNS = ["phase", "tokens", "padded", "pad %", "GFLOP", "seconds", "tokens/s", "GFLOP/s",
           "% bf16 peak", "% fp32 peak"]


# ----------------------------------------------------------------------------------------------
# The machine's peak


def matmul_peaks(sizes: list[int], thread_counts: list[int], repeats: int) -> list[dict]:
    """Best GFLOP/s of ``repeats`` timings per dtype, thread count and matrix size."""
    found = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for size in sizes:
                best = max(matmul_gflops(dtype, size) for _ in range(repeats))
                found.append({"dtype": name, "threads": threads, "size": size, "gflops": best})
    return found


# ----------------------------------------------------------------------------------------------
# Counting FLOPs


class FlopMeter:
    """Every pass through the watched models' decoder stacks and output heads, with its matmul
    FLOPs (see the module docstring) and the phase that ran it (:meth:`within`)."""

    def __init__(self):
        self.phase: str | None = None
        self.calls: list[dict] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self._kind: dict[str, str] = {}

    def reset(self) -> None:
        self.calls, self.seconds = [], defaultdict(float)

    @contextmanager
    def within(self, phase: str):
        """Passes in this block belong to ``phase``; its seconds add up in :attr:`seconds`."""
        outer, self.phase = self.phase, phase
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started
            self.phase = outer

    def tag(self, obj, method: str, phase) -> None:
        """Run ``obj.method`` within ``phase`` (a name, or a function of the call's arguments
        giving one) from now on."""
        fn = getattr(obj, method)

        @wraps(fn)
        def tagged(*args, **kwargs):
            with self.within(phase(*args, **kwargs) if callable(phase) else phase):
                return fn(*args, **kwargs)

        setattr(obj, method, tagged)

    def watch(self, model, name: str) -> dict:
        """Hook ``model``'s decoder stack and output head; returns the shape figures counted."""
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        embedding = model.get_input_embeddings().weight
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        base = [p for n, p in decoder.named_parameters() if "lora_" not in n and p is not embedding]
        lora = [p for n, p in decoder.named_parameters() if "lora_" in n]
        layers = [m for m in decoder.modules() if hasattr(m, "gradient_checkpointing")
                  and m is not decoder]
        shape = {"layers": config.num_hidden_layers, "attention_width": heads * head_dim,
                 "nonembedding": sum(p.numel() for p in base), "hidden": head.in_features,
                 "vocab": head.out_features}

        def on_decoder(module, args, kwargs):
            x = kwargs.get("input_ids")
            x = kwargs.get("inputs_embeds") if x is None else x
            x = args[0] if x is None else x
            rows, width = x.shape[:2]
            mask = kwargs.get("attention_mask")
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                new, past = mask[:, -width:].sum(1).double(), mask[:, :-width].sum(1).double()
                span = mask.size(1)
            else:
                seen = cache.get_seq_length() if cache is not None else 0
                new, past = torch.full((rows,), float(width)), torch.full((rows,), float(seen))
                span = width + seen
            cached = kwargs.get("use_cache") or cache is not None
            kind = ("prefill" if width > 1 else "decode") if cached else "forward"
            self._kind[name] = kind
            attention = 4 * shape["layers"] * shape["attention_width"]
            flops = 2 * shape["nonembedding"] * float(new.sum()) \
                + attention * float((new * past + new * (new + 1) / 2).sum())
            padded = 2 * shape["nonembedding"] * rows * width \
                + attention * rows * (width * (span - width) + width * (width + 1) / 2)
            grad = torch.is_grad_enabled() and self.phase != "backward"
            graph = x.requires_grad or any(p.requires_grad for p in lora)
            factor = 0 if not grad else 2 if any(p.requires_grad for p in base) else int(graph)
            recompute = (sum(bool(m.gradient_checkpointing and m.training) for m in layers)
                         / shape["layers"] if factor else 0.0)
            self.calls.append({"phase": self.phase, "model": name, "part": "decoder",
                               "kind": kind, "tokens": int(new.sum()), "positions": rows * width,
                               "flops": flops, "flops_padded": padded, "backward": factor,
                               "recompute": recompute})

        def on_head(module, args, output):
            hidden = args[0]
            rows = hidden.numel() // hidden.size(-1)
            grad = torch.is_grad_enabled() and self.phase != "backward"
            factor = 0 if not grad else 2 if module.weight.requires_grad \
                else int(hidden.requires_grad)
            flops = 2.0 * rows * shape["hidden"] * shape["vocab"]
            self.calls.append({"phase": self.phase, "model": name, "part": "head",
                               "kind": self._kind.get(name, "forward"), "tokens": rows,
                               "positions": rows, "flops": flops, "flops_padded": flops,
                               "backward": factor, "recompute": 0.0})

        decoder.register_forward_pre_hook(on_decoder, with_kwargs=True)
        head.register_forward_hook(on_head)
        return shape

    def tally(self) -> dict[str, dict]:
        """Per phase (and per rollout part, ``rollout/prefill``...): tokens, padded positions,
        GFLOP of the real tokens and of the padded batches. The backward gets each graph-carrying
        forward times its factor, plus the recomputed layers; a phase whose layers ran counts
        their tokens, one where only the head ran (the loss) counts the head's positions."""
        out: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "padded": 0, "head_tokens": 0,
                                                    "gflop": 0.0, "gflop_padded": 0.0})

        def add(key: str, call: dict, times: float) -> None:
            entry = out[key]
            entry["gflop"] += times * call["flops"] / 1e9
            entry["gflop_padded"] += times * call["flops_padded"] / 1e9
            if call["part"] == "decoder":
                entry["tokens"] += call["tokens"]
                entry["padded"] += call["positions"]
            else:
                entry["head_tokens"] += call["tokens"]

        for call in self.calls:
            phase = call["phase"] or "untagged"
            add(phase, call, 1.0)
            if call["kind"] in ("prefill", "decode"):
                add(f"{phase}/{call['kind']}", call, 1.0)
            if call["backward"] or call["recompute"]:
                add("backward", call, call["backward"] + call["recompute"])
        for entry in out.values():
            if not entry["tokens"]:
                entry["tokens"] = entry["padded"] = entry["head_tokens"]
        return dict(out)


# ----------------------------------------------------------------------------------------------
# The runs


def first_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    """The first-turn prompts (generation prompt included) of ``count`` toolworld tasks."""
    env = stages.get_env(replace(cfg, env=replace(cfg.env, train_size=count)))
    tasks = env.tasks("train")[:count]
    gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 1, 96, len(tasks))
    return [r.input_ids[:r.action_mask.index(1)] for r in gold]


def generation(trainer: Trainer, engine: TransformersEngine, meter: FlopMeter,
               clock: ForwardClock, prompts, new_tokens: int) -> dict:
    """Prefill and decode of ``prompts`` by ``engine`` over the trainer's student."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    with torch.no_grad(), runtime.autocast(trainer.precision, trainer.device):
        engine.generate(prompts[:2], replace(params, max_new_tokens=2))
        meter.reset()
        clock.seconds.clear()
        with meter.within("generate"):
            out = engine.generate(prompts, params)
    assert all(len(g.token_ids) == new_tokens for g in out)
    counted = meter.tally()
    total = meter.seconds["generate"]
    phases = {"prefill": {**counted["generate/prefill"], "seconds": clock.seconds["prefill"]},
              "decode": {**counted["generate/decode"], "seconds": clock.seconds["decode"]},
              "rest": {"seconds": total - clock.seconds["prefill"] - clock.seconds["decode"]},
              "total": {**counted["generate"], "seconds": total}}
    return {"batch": len(prompts), "new_tokens": new_tokens,
            "prompt_tokens": [len(p) for p in prompts], "phases": phases}


def step_phases(record: dict, meter: FlopMeter, clock: ForwardClock) -> dict[str, dict]:
    """One step's phases (:data:`ROWS`): seconds (lopd's timing, the loss and the rollout's
    parts) and counts."""
    counted = meter.tally()
    # The teacher phase holds the composer's and the anchor's passes and its own.
    counted["teacher/pass"] = counted.pop("teacher", {})
    parts = [counted[p] for p in ("teacher/pass", "composer", "anchor") if counted.get(p)]
    if parts:
        counted["teacher"] = {k: sum(p[k] for p in parts) for k in parts[0]}
    counted["step"] = {k: sum(counted.get(p, {}).get(k, 0.0) for p in COUNTED)
                       for k in ("gflop", "gflop_padded")}
    seconds = {p: record.get(f"time/{p}", 0.0) for p in (*PARTS, "composer", "anchor")}
    seconds.update({"loss": meter.seconds["loss"], "rollout/prefill": clock.seconds["prefill"],
                    "rollout/decode": clock.seconds["decode"], "step": record["time/step"]})
    seconds["rollout/rest"] = seconds["rollout"] - seconds["rollout/prefill"] \
        - seconds["rollout/decode"]
    seconds["teacher/pass"] = seconds["teacher"] - seconds["composer"] - seconds["anchor"]
    seconds["other"] = seconds["step"] - sum(seconds[p] for p in PARTS)
    phases = {key: {**counted.get(key, {}), "seconds": seconds[key]} for key, _ in ROWS}
    if "untagged" in counted:  # a pass outside every tagged phase: kept, never dropped
        phases["untagged"] = counted["untagged"]
    return phases


def run_method(method: str, cfg_name: str, sets: list[str], work: Path, steps: int,
               meter: FlopMeter, prompts=None, new_tokens: int = 0) -> dict:
    """``steps`` steps of ``method`` (and, given ``prompts``, the generation measurement first)."""
    cfg = load_config(cfg_name, [*sets, f"train.algorithm={method}"])
    trainer = Trainer(cfg, work / f"run-{method}", get_algorithm(method), progress=False)
    student = trainer.ctx.student
    shape = {"student": meter.watch(student, "student")}
    algorithm = trainer.algorithm
    composer = getattr(algorithm, "composer", None)
    if composer is not None:
        shape["base"] = meter.watch(composer.base, "base")
        meter.tag(composer, "encode", lambda *a, anchor=False, **k: "anchor" if anchor
                  else "composer")
    meter.tag(trainer, "rollouts", "rollout")
    # Passes inside algorithm.step but outside the tagged parts run in its backward calls.
    meter.tag(algorithm, "step", "backward")
    for part in ("before_step", "score", "loss", "after_update"):
        meter.tag(algorithm, part, "student_forward" if part == "score" else part)
    if algorithm.teacher is not None:
        meter.tag(algorithm.teacher, "score", "teacher")
    # Built before the clock replaces the student's forward: the engine reads the forward's
    # signature for the name of its cache argument.
    engine = TransformersEngine(student, trainer.ctx.tokenizer, stop_token_ids=())
    clock = ForwardClock(student)
    out = {"shapes": shape}
    if prompts is not None:
        out["generation"] = generation(trainer, engine, meter, clock, prompts, new_tokens)
        print(f"generation: {out['generation']['phases']['total']['seconds']:.1f} s", flush=True)
    out["steps"] = []
    for step in range(1, steps + 1):
        meter.reset()
        clock.seconds.clear()
        record = one_step(trainer, step)
        out["steps"].append(step_phases(record, meter, clock))
        print(f"{method} step {step}: {record['time/step']:.1f} s", flush=True)
    measured = out["steps"][1:]
    median = sorted(measured, key=lambda s: s["step"]["seconds"])[(len(measured) - 1) // 2]
    out["reported_step"] = out["steps"].index(median) + 1
    out["step_seconds"] = {"median": statistics.median(s["step"]["seconds"] for s in measured),
                           "all": [s["step"]["seconds"] for s in out["steps"]]}
    return out


# ----------------------------------------------------------------------------------------------
# Tables


def row(label: str, entry: dict, peak: dict) -> list:
    seconds = entry.get("seconds", 0.0)
    if "gflop" not in entry:
        return [label, "", "", "", "", round(seconds, 3), "", "", "", ""]
    rate = entry["gflop"] / seconds if seconds > 0 else 0.0
    padding = round(100 * (1 - entry["tokens"] / entry["padded"]), 1) if entry.get("padded") \
        else ""
    return [label, entry.get("tokens", ""), entry.get("padded", ""), padding,
            round(entry["gflop"], 2), round(seconds, 3),
            round(entry["tokens"] / seconds) if seconds > 0 and entry.get("tokens") else "",
            round(rate, 1), round(100 * rate / peak["bf16"], 1),
            round(100 * rate / peak["fp32"], 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/models/smollm2-135m",
                        help="a prepared model folder or an embedded model (toolworld-1m)")
    parser.add_argument("--config", help="the preset (default: smollm2-135m; tiny for the "
                        "embedded 1M model)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8, help="train.rollouts_per_step "
                        "(a multiple of GRPO's group, 4)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="rollout.max_completion_length (default: the preset's)")
    parser.add_argument("--max-turns", type=int, help="rollout.max_turns (default: the preset's)")
    parser.add_argument("--steps", type=int, default=2, help="steps per method; the first is "
                        "warm-up")
    parser.add_argument("--batch", type=int, default=8, help="prompts generated together")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt")
    parser.add_argument("--peak-sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2: one warm-up step and at least one measured")
    if args.rollouts % 4:
        parser.error("--rollouts must be a multiple of 4 (GRPO's group size)")

    path = models.resolve_model_path(args.model)
    embedded = (args.model, "toolworld") == stages.EMBEDDED_FOR
    config = args.config or ("tiny" if embedded else "smollm2-135m")
    hidden = models.hidden_size_of(path)
    precision, why = runtime.choose_precision(args.precision, CPU, hidden)
    unit, found = runtime.cpu_bf16_units()
    print(f"CPU bfloat16 matrix unit: {unit or 'none'} ({found}); precision {precision} ({why})",
          flush=True)

    peaks = matmul_peaks(args.peak_sizes, sorted({1, 2, args.threads}), args.peak_repeats)
    peak = {d: max(p["gflops"] for p in peaks if p["dtype"] == d and p["threads"] == args.threads)
            for d in ("bf16", "fp32")}
    print(format_table(["dtype", "threads", "size", "GFLOP/s (best)"],
                       [[p["dtype"], p["threads"], p["size"], round(p["gflops"], 1)]
                        for p in peaks], title="square matmul peak"))

    # The FLOP hooks watch the student itself: its rollouts are generated from it (float32 weights
    # under autocast), not from the bfloat16 copy that rollout.generation_weights=auto makes.
    sets = [f"model.name_or_path={args.model}", "run.device=cpu", f"run.precision={precision}",
            "rollout.generation_weights=master",
            f"run.num_threads={args.threads}", f"train.rollouts_per_step={args.rollouts}",
            f"train.max_steps={args.steps}"]
    if args.max_new_tokens:
        sets.append(f"rollout.max_completion_length={args.max_new_tokens}")
    if args.max_turns:
        sets.append(f"rollout.max_turns={args.max_turns}")
    if not embedded:
        heads = AutoConfig.from_pretrained(path).num_attention_heads
        sets += [f"env.train_size={TRAIN_TASKS}", "env.eval_size=4", "env.pretrain_size=0",
                 "train.eval_tasks=4", f"composer.num_heads={heads}"]
    meter = FlopMeter()
    with tempfile.TemporaryDirectory(prefix="roofline-") as tmp:
        work = Path(tmp)
        cfg = load_config(config, sets)
        composer, bank = lopd_inputs(cfg, work)
        sets += [f"lopd.composer={composer}", f"lopd.bank={bank}"]
        prompts = first_prompts(cfg, models.load_tokenizer(path), args.batch)
        results = {"grpo": run_method("grpo", config, sets, work, args.steps, meter, prompts,
                                      args.new_tokens)}
        # The GRPO trainer, which the tagged methods hold in reference cycles, goes before
        # LOPD's is built.
        gc.collect()
        results["lopd"] = run_method("lopd", config, sets, work, args.steps, meter)
    shape = results["grpo"]["shapes"]["student"]
    gen = results["grpo"].pop("generation")

    where = f"{args.threads} thread(s), {precision}"
    print(f"\n{args.model}: {shape['nonembedding'] / 1e6:.1f}M non-embedding parameters, "
          f"{shape['layers']} layers, attention width {shape['attention_width']}, head "
          f"{shape['hidden']} x {shape['vocab']}; peak at {args.threads} thread(s): bf16 "
          f"{peak['bf16']:.1f}, fp32 {peak['fp32']:.1f} GFLOP/s")
    labels = {"prefill": "prefill", "decode": "decode", "rest": "sampling, rest", "total": "total"}
    print(format_table(COLUMNS, [row(labels[k], v, peak) for k, v in gen["phases"].items()],
                       title=f"\ngeneration: {gen['batch']} toolworld prompts "
                       f"({sum(gen['prompt_tokens'])} tokens) + {gen['new_tokens']} tokens each, "
                       f"TransformersEngine, {where}"))
    for method, result in results.items():
        chosen = result["steps"][result["reported_step"] - 1]
        # Phases that neither ran a counted pass nor took a millisecond (GRPO's teacher) are left
        # out of the table, not of the JSON.
        rows = [row(label, chosen[key], peak) for key, label in ROWS
                if chosen[key].get("gflop") or chosen[key]["seconds"] >= 5e-4]
        print(format_table(COLUMNS, rows, title=f"\n{method.upper()}: step "
                           f"{result['reported_step']} of {args.steps} (median of the measured "
                           f"steps), {args.rollouts} rollouts, {where}"))
    write_json(args.json, {"model": args.model, "config": config, "precision": precision,
                           "precision_reason": why, "cpu_bf16_unit": unit,
                           "threads": args.threads, "settings": vars(args),
                           "matmul_peaks": peaks, "peak_gflops": peak,
                           "peak_gflops_of_run": peak["bf16" if precision == "bf16-mixed"
                                                      else "fp32"],
                           "generation": gen, **results})


if __name__ == "__main__":
    main()
