"""What a process keeps of the vLLM engines it has built and let go, side by side.

    .venv-vllm/bin/python benchmarks/engine_lifetime.py --engines 4 --json runs/engine_lifetime.json

A process that trains run after run (``lopd compare``, ``lopd sweep``) builds one vLLM engine per
run. This script builds ``--engines`` in a row over the same model, generating one batch from each,
in two child processes: one lets each engine go by dropping its last reference, the other calls
``VLLMEngine.close()`` (the engine core's shutdown). Each prints, after every engine, the process's
resident memory, the garbage collector's frozen-object count (vLLM's engine core freezes the heap
when it starts; only its shutdown unfreezes it) and the seconds the batch took. Model: the embedded
``toolworld-1m`` by default, or ``--model DIR`` (e.g. ``runs/models/smollm2-135m``).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model_name: str, engines: int, close: bool) -> list[dict]:
    from lopd import models
    from lopd.rollout import SamplingParams
    from lopd.rollout.vllm_engine import VLLMEngine

    model, tokenizer = models.load_model(model_name)
    model.eval()
    prompts = [tokenizer(f"Task {i}: look up order {i} and cancel it.")["input_ids"]
               for i in range(16)]
    rows = []
    for n in range(1, engines + 1):
        engine = VLLMEngine(model, tokenizer)
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, seed=n))
        seconds = time.perf_counter() - started
        if close:
            engine.close()
        del engine
        gc.collect()
        rows.append({"engines_built": n, "rss_mib": round(rss_mib(), 1),
                     "gc_frozen_objects": gc.get_freeze_count(),
                     "generate_seconds": round(seconds, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--model", default="toolworld-1m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=["drop", "close"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.engines, args.child == "close")))
        return 0
    results = {}
    for mode in ("drop", "close"):
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--engines",
                               str(args.engines), "--model", args.model],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"model {args.model}; after each engine: resident MiB / GC frozen objects / "
          "generate s")
    print(f"{'engines':>8} | {'dropped (no shutdown)':>32} | {'close()':>32}")
    for a, b in zip(results["drop"], results["close"]):
        print(f"{a['engines_built']:>8} | {a['rss_mib']:>10,.0f} {a['gc_frozen_objects']:>12,} "
              f"{a['generate_seconds']:>7.2f} | {b['rss_mib']:>10,.0f} "
              f"{b['gc_frozen_objects']:>12,} {b['generate_seconds']:>7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
