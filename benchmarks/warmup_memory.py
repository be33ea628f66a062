"""Peak memory and step time of the warm-up (`lopd base --set base.init_from=…`) on a real model,
under each memory setting, one `lopd base` process per setting.

    python benchmarks/warmup_memory.py --json docs/results/warmup/memory.json

Each setting trains ``--steps`` steps of ``--batch`` oracle transcripts (~1,000 tokens each on
toolworld with SmolLM2's tool template) from ``--model`` (default: the folder `make smollm2`
prepares) in its own process, with one one-turn validation task so that the run ends as a real one
does; the process's peak resident memory (``wait4``'s ``ru_maxrss``) and the mean step time are
reported. Settings, in float32: the whole batch in one pass (the warm-up before micro-batches),
activation checkpointing, and checkpointing with micro-batches of 2 (the ``smollm2-135m``
preset's); then the last under bf16-mixed (what ``run.precision: auto`` gives the preset on a CPU
with bfloat16 units: run by default there, with ``--bf16`` elsewhere, where it is slow).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lopd import runtime
from lopd.tables import format_table, write_json

FP32 = "run.precision=fp32"
SETTINGS = {
    "one pass, float32 (before)": ["train.per_device_train_batch_size=0",
                                   "train.gradient_checkpointing=false", FP32],
    "checkpointing, float32": ["train.per_device_train_batch_size=0",
                               "train.gradient_checkpointing=true", FP32],
    "checkpointing, micro-batches of 2, float32": ["train.per_device_train_batch_size=2",
                                                   "train.gradient_checkpointing=true", FP32],
}
BF16 = {"checkpointing, micro-batches of 2, bf16-mixed": [
    "train.per_device_train_batch_size=2", "train.gradient_checkpointing=true",
    "run.precision=bf16-mixed"]}


def run(model: str, sets: list[str], steps: int, batch: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "lopd", "base", "--config", "smollm2-135m", "--out", out]
        for item in [f"base.init_from={model}", f"base.batch_size={batch}",
                     f"base.max_steps={steps}", "base.pretrain_tasks=400",
                     "base.reference_fraction=0", "base.learning_rate=5e-5",
                     "base.warmup_steps=1", f"base.eval_every={steps}", "base.eval_tasks=1",
                     "rollout.max_turns=1", f"run.num_threads={threads}", *sets]:
            args += ["--set", item]
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(child.pid, 0)   # this child's own peak, not a running max
            child.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            text = err.read().strip()
        if child.returncode:
            return {"error": text.splitlines()[-1] if text else "killed",
                    "returncode": child.returncode, "peak_rss_gib": usage.ru_maxrss / 2**20}
        history = json.loads((Path(out) / "base_training.json").read_text())["history"]
        seconds = [b["seconds"] - a["seconds"] for a, b in zip(history, history[1:])]
        return {"peak_rss_gib": usage.ru_maxrss / 2**20,
                "step_seconds": sum(seconds) / len(seconds) if seconds else history[0]["seconds"],
                "losses": [h["loss"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/models/smollm2-135m")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="also bf16-mixed with micro-batches (default: where the CPU has "
                        "bfloat16 units)")
    parser.add_argument("--only", nargs="+", help="run only these settings (names as printed)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = dict(SETTINGS)
    if args.bf16 or (args.bf16 is None and runtime.cpu_bf16_units()[0] is not None):
        settings.update(BF16)
    if args.only:
        settings = {k: v for k, v in settings.items() if k in args.only}
    results, rows = {}, []
    for name, sets in settings.items():
        got = results[name] = run(args.model, sets, args.steps, args.batch, args.threads)
        rows.append([name, f"{got['peak_rss_gib']:.2f}",
                     f"{got['step_seconds']:.1f}" if "step_seconds" in got else got["error"]])
        print(f"{name}: {rows[-1][1]} GiB", flush=True)
    print(format_table(["setting", "peak RSS GiB", "step s"], rows,
                       title=f"warm-up of {args.model}, {args.batch} transcripts per step, "
                       f"{args.steps} steps, {args.threads} threads"))
    write_json(args.json, {"model": args.model, "batch": args.batch, "steps": args.steps,
                           "threads": args.threads, "settings": results})


if __name__ == "__main__":
    main()
