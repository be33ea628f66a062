"""Rollout throughput of the engines side by side: vLLM, the transformers engine, ``model.generate``.

The job is the trainer's rollout phase: multi-turn toolworld episodes (up to ``--max-turns`` turns
of at most ``--max-new-tokens`` tokens, tool results appended between turns) at temperature 1,
with ``--batch-sizes`` episodes side by side (slots refill as episodes end), ``--episodes`` of
them per run. Each engine runs the same tasks in the same process, under ``torch.no_grad()`` as
the trainer's ``rollouts()``; the table shows generated tokens per second, episodes, and the wall
time of the whole episode loop (environment included), with the seconds the Hugging Face model
spent in prefill and decode forward passes (transformers and ``model.generate``; vLLM's own model
is not timed). Runs in the vLLM profile (``.venv-vllm``, built by ``make install-vllm``):

    .venv-vllm/bin/python benchmarks/rollout_engines.py --json runs/rollout_engines.json
    .venv-vllm/bin/python benchmarks/rollout_engines.py --config smollm2-135m \
        --batch-sizes 8 32 --json runs/rollout_engines_smollm2.json

``--config PRESET`` takes the model, ``rollout.max_turns``, ``rollout.max_completion_length``,
``run.num_threads`` and the environment's settings from a preset; explicit flags win.

Precisions (``--precisions``), in the ``precision`` column:

* ``fp32``: float32 weights, no autocast, for every engine (vLLM serves ``dtype=torch.float32``).
* ``bf16-mixed`` (transformers; ``model.generate`` with ``--hf-bf16 mixed``): float32 weights
  under ``torch.autocast('cpu', dtype=torch.bfloat16)`` entered once around the whole rollout
  phase, as the trainer's ``rollouts()`` runs under ``run.precision=bf16-mixed`` with
  ``rollout.generation_weights=master`` (the default on GPUs). Generation runs
  under ``no_grad`` (not ``inference_mode``), so autocast keeps its bfloat16 copies of the weights
  for the phase instead of casting every weight at every decoded token.
* ``bf16-weights`` (transformers with ``--transformers-bf16 weights``; ``model.generate``, the
  default ``--hf-bf16``): a bfloat16 copy of the model (``model.to(torch.bfloat16)``), no autocast
  (for the transformers engine, what the trainer generates from on a CPU by default:
  ``rollout.generation_weights=auto``).
  For ``model.generate`` this is the default because it is the faster realistic choice: no
  per-op casts or autocast dispatch, the same bfloat16 matmuls.
* ``bf16-served`` (vLLM): the engine serves ``dtype=torch.bfloat16`` (``VLLMEngine(dtype=...)``,
  what ``rollout.vllm_dtype=auto`` picks under bf16-mixed), called under the trainer's autocast
  context.

Threads: ``--threads`` (default: the config's ``run.num_threads``, else 1) is set before anything
runs. The in-process vLLM engine does not bind threads of its own (that is its multiprocess
executor's job) but disables ``torch.set_num_threads`` once started, so all three engines run on
these threads. One vLLM engine lives at a time: each precision builds its own and closes it
before the next.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections import Counter
from dataclasses import dataclass

import torch

from lopd import agent, models, policies, runtime
from lopd.config import load_config
from lopd.envs import get_env
from lopd.rollout import Generation, RolloutEngine, SamplingParams, TransformersEngine
from lopd.rollout.transformers_engine import default_stop_token_ids
from lopd.tables import format_table, write_json

PRECISIONS = {
    "fp32": "float32 weights, no autocast",
    "bf16-mixed": "float32 weights under torch.autocast('cpu', bfloat16), no_grad: the trainer's "
                  "bf16-mixed rollouts with rollout.generation_weights=master",
    "bf16-weights": "bfloat16 weights (model.to(torch.bfloat16)), no autocast: the trainer's "
                    "bf16-mixed rollouts on a CPU by default (rollout.generation_weights=auto)",
    "bf16-served": "vLLM serving dtype=torch.bfloat16, called under the trainer's autocast",
}
"""What each value of the ``precision`` column means."""


class HFGenerateEngine(RolloutEngine):
    """The same interface through Hugging Face ``model.generate`` (left-padded batch; finished rows
    stay in the batch until the longest ends): the baseline lopd's own engines replace."""

    def __init__(self, model, tokenizer, stop_token_ids):
        self.model, self.tokenizer = model, tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_length = model.config.max_position_embeddings

    def generate(self, prompts, params: SamplingParams, latents=None,
                 sessions=None) -> list[Generation]:
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        if params.seed is not None:
            torch.manual_seed(params.seed)
        sampling = ({"do_sample": False} if params.greedy else
                    {"do_sample": True, "temperature": params.temperature,
                     "top_k": params.top_k or None, "top_p": params.top_p})
        # As the transformers engine: inference_mode would stop autocast keeping its bf16 weights.
        no_grad = torch.no_grad if torch.is_autocast_enabled("cpu") else torch.inference_mode
        with no_grad():
            out = self.model.generate(**batch.to(self.model.device), **sampling,
                                      max_new_tokens=params.max_new_tokens,
                                      eos_token_id=sorted(self.stop_token_ids),
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      output_logits=True, return_dict_in_generate=True)
        temperature = 1.0 if params.greedy else params.temperature
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1)
        new = out.sequences[:, batch["input_ids"].shape[1]:]
        picked = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        generations = []
        for row, lp in zip(new.tolist(), picked.tolist()):
            stops = [i for i, t in enumerate(row) if t in self.stop_token_ids]
            end = stops[0] + 1 if stops else len(row)
            generations.append(Generation(row[:end], lp[:end], bool(stops)))
        return generations


class ForwardTimer:
    """Seconds a Hugging Face model spends in its forward passes, split into prefill (more than one
    new position per row) and decode (one), by hooks on the top-level module."""

    def __init__(self, model):
        self.prefill = self.decode = 0.0
        self._start, self._width = 0.0, 0
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True)

    def _before(self, module, args, kwargs):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        self._width = inputs.shape[1]
        self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        seconds = time.perf_counter() - self._start
        if self._width > 1:
            self.prefill += seconds
        else:
            self.decode += seconds

    def reset(self) -> None:
        self.prefill = self.decode = 0.0


@dataclass
class Variant:
    """One row kind of the table: an engine at a precision."""

    engine: str
    precision: str
    rollout: RolloutEngine
    timer: ForwardTimer | None
    autocast: bool

    def context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast \
            else contextlib.nullcontext()


def run(variant: Variant, env, tasks, tokenizer, batch_size: int, seed: int, max_turns: int,
        max_new_tokens: int) -> dict:
    """The rollout phase of ``tasks`` as the trainer runs it: one ``run_episodes`` under no_grad
    and the precision's autocast, entered once around the whole phase."""
    policy = policies.ModelPolicy(variant.rollout, tokenizer,
                                  SamplingParams(temperature=1.0, seed=seed))
    if variant.timer is not None:
        variant.timer.reset()
    start = time.perf_counter()
    with torch.no_grad(), variant.context():
        rollouts = agent.run_episodes(env, tasks, policy, tokenizer, max_turns=max_turns,
                                      max_new_tokens=max_new_tokens, batch_size=batch_size)
    seconds = time.perf_counter() - start
    tokens = sum(sum(r.action_mask) for r in rollouts)
    timer = variant.timer
    return {"engine": variant.engine, "precision": variant.precision, "batch_size": batch_size,
            "episodes": len(rollouts), "turns": sum(r.num_turns for r in rollouts),
            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "episodes_per_s": len(rollouts) / seconds,
            "finish_reasons": dict(Counter(r.finish_reason for r in rollouts)),
            "prefill_s": timer.prefill if timer else None,
            "decode_s": timer.decode if timer else None}


def build_variants(precision: str, engines: list[str], args, model, tokenizer, bf16_model,
                   timers) -> list[Variant]:
    """The ``engines`` of one precision, in that order; a bf16 precision gives the
    transformers engine and ``model.generate`` one row per mode of ``--transformers-bf16`` and
    ``--hf-bf16``."""
    stop_ids = default_stop_token_ids(model, tokenizer)
    variants = []
    for name in engines:
        if name == "vllm":
            from lopd.rollout.vllm_engine import VLLMEngine

            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            started = time.perf_counter()
            engine = VLLMEngine(model, tokenizer, stop_ids, dtype=dtype,
                                max_num_seqs=max(args.batch_sizes))
            print(f"vLLM engine ({dtype}) started in {time.perf_counter() - started:.1f} s",
                  flush=True)
            variants.append(Variant("vllm", "fp32" if precision == "fp32" else "bf16-served",
                                    engine, None, precision != "fp32"))
            continue
        modes = (["fp32"] if precision == "fp32" else
                 args.transformers_bf16 if name == "transformers" else args.hf_bf16)
        for mode in modes:
            target = bf16_model if mode == "weights" else model
            label = {"fp32": "fp32", "mixed": "bf16-mixed", "weights": "bf16-weights"}[mode]
            engine = (TransformersEngine(target, tokenizer, stop_ids) if name == "transformers"
                      else HFGenerateEngine(target, tokenizer, stop_ids))
            variants.append(Variant(name, label, engine, timers[id(target)], mode == "mixed"))
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a preset or YAML file: model, max_turns, "
                        "max_completion_length, num_threads and env settings from it")
    parser.add_argument("--model", help="default: the config's model, else toolworld-1m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--episodes", type=int, default=0,
                        help="episodes (toolworld train tasks) per run (default: 2 x the batch size)")
    parser.add_argument("--engines", nargs="+", default=["vllm", "transformers", "hf_generate"],
                        choices=["vllm", "transformers", "hf_generate"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--transformers-bf16", nargs="+", default=["mixed", "weights"],
                        choices=["mixed", "weights"],
                        help="the transformers engine's bf16 rows: mixed (the trainer's) and/or "
                             "bf16 weights")
    parser.add_argument("--hf-bf16", nargs="+", default=["weights"], choices=["mixed", "weights"],
                        help="model.generate's bf16 rows (default: bf16 weights)")
    parser.add_argument("--max-turns", type=int, help="default: the config's, else 8")
    parser.add_argument("--max-new-tokens", type=int,
                        help="tokens per turn (default: the config's max_completion_length, else 96)")
    parser.add_argument("--threads", type=int,
                        help="torch threads of every engine (vLLM disables torch.set_num_threads "
                             "once started; default: the config's num_threads, else 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH")
    args = parser.parse_args()

    cfg = load_config(args.config) if args.config else None
    args.model = args.model or (cfg.model.name_or_path if cfg else "toolworld-1m")
    args.max_turns = args.max_turns or (cfg.rollout.max_turns if cfg else 8)
    args.max_new_tokens = args.max_new_tokens or (cfg.rollout.max_completion_length if cfg else 96)
    args.threads = args.threads or (cfg.run.num_threads if cfg else 1)
    env_kwargs = cfg.env.kwargs() if cfg else {"seed": args.seed}

    runtime.set_threads(args.threads)
    model, tokenizer = models.load_model(args.model)
    model.eval()
    bf16_model = None
    if "bf16" in args.precisions and "weights" in args.transformers_bf16 + args.hf_bf16:
        bf16_model = copy.deepcopy(model).to(torch.bfloat16).eval()
    timers = {id(m): ForwardTimer(m) for m in (model, bf16_model) if m is not None}
    most = max(args.episodes or 2 * b for b in args.batch_sizes)
    env = get_env("toolworld", **{**env_kwargs,
                                  "sizes": {"train": most, "eval": 0, "pretrain": 0}})
    all_tasks = env.tasks("train")

    results = []
    # The torch engines of every precision first, vLLM last: once started in this process vLLM
    # binds the OpenMP threads, and torch work after it ran ~2.5x slower here.
    torch_engines = [e for e in args.engines if e != "vllm"]
    passes = [(p, torch_engines) for p in args.precisions if torch_engines]
    passes += [(p, ["vllm"]) for p in args.precisions if "vllm" in args.engines]
    for precision, engines in passes:
        variants = build_variants(precision, engines, args, model, tokenizer, bf16_model, timers)
        print(f"{precision}: torch threads {torch.get_num_threads()}", flush=True)
        for variant in variants:  # warm-up: one-off allocation and start-up costs
            run(variant, env, all_tasks[:4], tokenizer, 4, args.seed, 2, args.max_new_tokens)
        for batch_size in args.batch_sizes:
            tasks = all_tasks[:args.episodes or 2 * batch_size]
            for variant in variants:
                r = run(variant, env, tasks, tokenizer, batch_size, args.seed, args.max_turns,
                        args.max_new_tokens)
                results.append(r)
                # Written after every row, so a long run cut short keeps what it measured.
                write_json(args.json_path, {"settings": vars(args), "precisions": PRECISIONS,
                                            "results": results})
                print(f"batch {batch_size} {variant.engine} {variant.precision}: "
                      f"{r['generated_tokens']} tokens, {r['episodes']} episodes in "
                      f"{r['seconds']:.1f} s", flush=True)
        for variant in variants:
            if variant.engine == "vllm":
                variant.rollout.close()

    # Each row against the transformers engine at its batch and precision; vLLM's bf16 against
    # the trainer's bf16-mixed one.
    base = {(r["batch_size"], r["precision"]): r["tokens_per_s"] for r in results
            if r["engine"] == "transformers"}
    seconds = lambda s: "" if s is None else round(s, 2)  # noqa: E731
    rows = []
    for r in sorted(results, key=lambda r: (r["batch_size"], r["precision"] != "fp32")):
        same = "bf16-mixed" if r["precision"] == "bf16-served" else r["precision"]
        ref = base.get((r["batch_size"], same))
        rows.append([r["batch_size"], r["precision"], r["engine"], r["episodes"], r["turns"],
                     r["generated_tokens"], seconds(r["seconds"]), round(r["tokens_per_s"]),
                     round(r["episodes_per_s"], 2), seconds(r["prefill_s"]),
                     seconds(r["decode_s"]), round(r["tokens_per_s"] / ref, 2) if ref else ""])
    print(format_table(["batch", "precision", "engine", "episodes", "turns", "gen tokens",
                        "wall s", "tokens/s", "episodes/s", "prefill s", "decode s",
                        "vs transformers"], rows,
                       title=f"toolworld multi-turn rollouts, {args.model}, T=1, "
                             f"<= {args.max_turns} turns x {args.max_new_tokens} tokens, CPU, "
                             f"{torch.get_num_threads()} threads"))
    print("precision: " + "; ".join(f"{k} = {v}" for k, v in PRECISIONS.items()
                                     if any(r["precision"] == k for r in results)))
    print("wall s: the whole episode loop (environment included); prefill s / decode s: the "
          "model's forward passes only (not vLLM's); vs transformers: tokens/s against the "
          "transformers engine at the same batch and precision (bf16-served: bf16-mixed)")


if __name__ == "__main__":
    main()
