"""Multi-turn rollouts with each episode's KV cache kept across turns, against re-prefilling the
whole conversation every turn: the same engine, model, tasks and seeds, side by side.

    python benchmarks/multiturn_cache.py --json runs/multiturn_cache.json

The job is the trainer's rollout on the config (default: the tiny preset's toolworld, its
embedded base, ``rollout.max_turns`` 8, ``rollout.batch_size`` 128 episodes side by side with
slots refilled as episodes end, ``rollout.max_completion_length`` tokens per turn, temperature 1).
The two paths run alternately (``--rounds`` times each, the same seeds every round), so a machine
that slows down does so for both. For each: median seconds of the whole episode loop
(environment and chat template included), episodes and generated tokens per second, tokens
prefilled, and the model's time in prefill and in decode steps. Both paths must produce the same
episodes: the script counts the rollouts that are token-identical and gives the largest log-prob
difference. The throughput ratio (kept cache / re-prefill) is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from lopd import agent, policies, runtime, stages
from lopd.config import load_config
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json


class ForwardClock:
    """Seconds the model spends in prefill calls (more than one new position) and decode steps."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self._forward = model.forward

        def timed(*args, **kwargs):
            inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            started = time.perf_counter()
            out = self._forward(*args, **kwargs)
            kind = "prefill" if inputs is not None and inputs.size(1) > 1 else "decode"
            self.seconds[kind] += time.perf_counter() - started
            return out

        model.forward = timed


def run(engine, clock, env, tasks, tokenizer, rollout, seed: int) -> tuple[list, dict]:
    clock.seconds.clear()
    before = engine.prefilled_tokens
    policy = policies.ModelPolicy(engine, tokenizer, SamplingParams(
        temperature=rollout.temperature, max_new_tokens=rollout.max_completion_length, seed=seed))
    started = time.perf_counter()
    rollouts = agent.run_episodes(env, tasks, policy, tokenizer, max_turns=rollout.max_turns,
                                  max_new_tokens=rollout.max_completion_length,
                                  batch_size=rollout.batch_size)
    seconds = time.perf_counter() - started
    return rollouts, {"seconds": seconds, "prefilled_tokens": engine.prefilled_tokens - before,
                      "prefill_s": clock.seconds["prefill"], "decode_s": clock.seconds["decode"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--episodes", type=int, default=256, help="training tasks, one episode "
                        "each (default 256: two batches of 128)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH")
    args = parser.parse_args()
    if args.rounds < 1 or args.episodes < 1:
        parser.error("--rounds and --episodes must be >= 1")

    cfg = load_config(args.config, args.overrides)
    runtime.set_threads(cfg.run.num_threads)
    model, tokenizer = stages.load_model(cfg)
    model.eval()
    env = stages.get_env(cfg)
    tasks = env.tasks("train")[:args.episodes]
    clock = ForwardClock(model)
    engines = {"kept KV cache": TransformersEngine(model, tokenizer, reuse_cache=True),
               "re-prefill": TransformersEngine(model, tokenizer, reuse_cache=False)}
    for engine in engines.values():  # warm-up
        run(engine, clock, env, tasks[:4], tokenizer, cfg.rollout, args.seed)
    records: dict[str, list[dict]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            rollouts, record = run(engine, clock, env, tasks, tokenizer, cfg.rollout, args.seed)
            record["generated_tokens"] = sum(sum(r.action_mask) for r in rollouts)
            record["turns"] = sum(r.num_turns for r in rollouts)
            records[name].append(record)
            outputs[name] = rollouts
            print(f"round {round_ + 1} {name}: {record['seconds']:.2f} s", flush=True)

    cached, prefilled = outputs["kept KV cache"], outputs["re-prefill"]
    identical = sum(a.input_ids == b.input_ids for a, b in zip(cached, prefilled))
    gap = max((abs(x - y) for a, b in zip(cached, prefilled) if a.input_ids == b.input_ids
               for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    summary, rows = {}, []
    for name, runs in records.items():
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        seconds = median["seconds"]
        summary[name] = {**median, "min_s": min(r["seconds"] for r in runs),
                         "max_s": max(r["seconds"] for r in runs),
                         "episodes_per_s": len(tasks) / seconds,
                         "tokens_per_s": median["generated_tokens"] / seconds}
        s = summary[name]
        rows.append([name, s["min_s"], seconds, s["max_s"], s["episodes_per_s"], s["tokens_per_s"],
                     int(median["prefilled_tokens"]), median["prefill_s"], median["decode_s"]])
    turns = records["kept KV cache"][0]["turns"]
    print(format_table(
        ["path", "min s", "median s", "max s", "episodes/s", "generated tokens/s",
         "tokens prefilled", "prefill s", "decode s"], rows,
        title=f"{len(tasks)} toolworld episodes ({turns / len(tasks):.2f} turns each), batch "
              f"{cfg.rollout.batch_size}, max_turns {cfg.rollout.max_turns}, "
              f"{cfg.rollout.max_completion_length} tokens per turn, temperature "
              f"{cfg.rollout.temperature}, {torch.get_num_threads()} thread(s); "
              f"{args.rounds} rounds each, interleaved"))
    print(f"\nidentical rollouts: {identical} of {len(tasks)}; largest log-prob difference: "
          f"{gap:.2e}")
    ratio = summary["kept KV cache"]["tokens_per_s"] / summary["re-prefill"]["tokens_per_s"]
    print(f"throughput, kept KV cache / re-prefill (medians): {ratio:.2f}")
    write_json(args.json_path, {"config": args.config, "overrides": args.overrides,
                                "episodes": len(tasks), "rounds": args.rounds,
                                "paths": summary, "identical_rollouts": identical,
                                "largest_logprob_difference": gap, "ratio": ratio,
                                "per_round": records})


if __name__ == "__main__":
    main()
