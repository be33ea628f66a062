"""Rollout throughput of the engines side by side: vLLM, the transformers engine, ``model.generate``.

The job is the trainer's: multi-turn toolworld episodes of the embedded ``toolworld-1m`` (up to
``rollout.max_turns`` turns of at most 96 tokens, tool results appended between turns), at
temperature 1, with ``--batch-sizes`` episodes side by side (slots refill as episodes end). Each
engine runs the same tasks in the same process; the table shows generated tokens per second and
episodes per second (wall time of the whole episode loop, environment included). Runs in the vLLM
profile (``.venv-vllm``, built by ``make install-vllm``):

    .venv-vllm/bin/python benchmarks/rollout_engines.py --json runs/rollout_engines.json

vLLM's CPU backend binds its OpenMP threads to the machine's cores when it starts (and then refuses
``torch.set_num_threads``), so all three engines run on the same threads.
"""

from __future__ import annotations

import argparse
import time

import torch

from lopd import agent, models, policies, runtime
from lopd.envs import get_env
from lopd.rollout import Generation, RolloutEngine, SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json


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
        with torch.inference_mode():
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


def run(engine, env, tasks, tokenizer, batch_size: int, seed: int, max_turns: int):
    policy = policies.ModelPolicy(engine, tokenizer, SamplingParams(temperature=1.0, seed=seed))
    start = time.perf_counter()
    rollouts = agent.run_episodes(env, tasks, policy, tokenizer, max_turns=max_turns,
                                  max_new_tokens=96, batch_size=batch_size)
    seconds = time.perf_counter() - start
    return sum(sum(r.action_mask) for r in rollouts), len(rollouts), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="toolworld-1m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--episodes", type=int, default=0,
                        help="episodes per run (default: 2 x the batch size)")
    parser.add_argument("--engines", nargs="+", default=["vllm", "transformers", "hf_generate"],
                        choices=["vllm", "transformers", "hf_generate"])
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads before vLLM starts (vLLM then binds its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH")
    args = parser.parse_args()

    runtime.set_threads(args.threads)
    model, tokenizer = models.load_model(args.model)
    model.eval()
    most = max(args.episodes or 2 * b for b in args.batch_sizes)
    env = get_env("toolworld", seed=args.seed, sizes={"train": most, "eval": 0, "pretrain": 0})
    all_tasks = env.tasks("train")
    engines: dict[str, RolloutEngine] = {}
    transformers_engine = TransformersEngine(model, tokenizer)
    for name in args.engines:
        if name == "vllm":
            from lopd.rollout.vllm_engine import VLLMEngine

            started = time.perf_counter()
            engines[name] = VLLMEngine(model, tokenizer, max_num_seqs=max(args.batch_sizes))
            print(f"vLLM engine started in {time.perf_counter() - started:.1f} s", flush=True)
        elif name == "transformers":
            engines[name] = transformers_engine
        else:
            engines[name] = HFGenerateEngine(model, tokenizer, transformers_engine.stop_token_ids)
    for engine in engines.values():  # warm-up: one-off allocation and start-up costs
        run(engine, env, all_tasks[:4], tokenizer, 4, args.seed, 2)

    rows, results = [], []
    for batch_size in args.batch_sizes:
        tasks = all_tasks[:args.episodes or 2 * batch_size]
        base = None
        for name, engine in engines.items():
            tokens, episodes, seconds = run(engine, env, tasks, tokenizer, batch_size, args.seed,
                                            args.max_turns)
            rate = tokens / seconds
            base = rate if name == "transformers" else base
            results.append({"engine": name, "batch_size": batch_size, "episodes": episodes,
                            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": rate,
                            "episodes_per_s": episodes / seconds})
            print(f"batch {batch_size} {name}: {tokens} tokens in {seconds:.1f} s", flush=True)
        for r in results[-len(engines):]:
            rows.append([r["batch_size"], r["engine"], r["episodes"], r["generated_tokens"],
                         round(r["seconds"], 1), round(r["tokens_per_s"]),
                         round(r["episodes_per_s"], 2),
                         round(r["tokens_per_s"] / base, 2) if base else ""])
    print(format_table(["batch", "engine", "episodes", "gen tokens", "wall s", "tokens/s",
                        "episodes/s", "vs transformers"], rows,
                       title=f"toolworld multi-turn rollouts, {args.model}, T=1, "
                             f"<= {args.max_turns} turns x 96 tokens, CPU"))
    write_json(args.json_path, {"settings": vars(args), "results": results})
    if "vllm" in engines:
        engines["vllm"].close()


if __name__ == "__main__":
    main()
