"""Peak memory of one LOPD and one GRPO step against vocabulary size and action tokens.

A width-reduced Qwen3-4B-shaped model (width 64, 2 layers) with vocabularies of 2k, 32k and 152k
rows scores batches of 8 and 32 rollouts, once with the scalable settings (micro-batches of 4
rollouts, vocabulary reductions in chunks of 256 tokens) and once with the whole step in one pass
and no chunking. Each configuration runs in its own process (``benchmarks/gpu_check.py``); the
figure is the peak memory of the step above its start (CPU: resident memory; GPU: allocation).
With the scalable settings the peak follows the micro-batch and stays flat as action tokens grow;
in one unchunked pass it grows with action tokens × vocabulary.

    python benchmarks/step_memory.py [--json runs/step_memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from lopd.tables import format_table  # noqa: E402

VOCABS = (2048, 32768, 151936)
ROLLOUTS = (8, 32)
MODES = {"micro-batch 4, chunks 256": ("4", "256"), "one pass, no chunks": ("0", "0")}


def measure(vocab: int, rollouts: int, micro: str, chunk: str, device: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_check.py")),
                        "--width", "64", "--layers", "2", "--vocab", str(vocab),
                        "--rollouts", str(rollouts), "--micro-batch", micro,
                        "--loss-chunk-tokens", chunk, "--latents", "8", "--steps", "1",
                        "--device", device, "--precision", "fp32", "--json", out.name],
                       check=True, capture_output=True)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, records = [], []
    for mode, (micro, chunk) in MODES.items():
        for vocab in VOCABS:
            for rollouts in ROLLOUTS:
                r = measure(vocab, rollouts, micro, chunk, args.device)
                records.append({"mode": mode, **r})
                rows.append([mode, vocab, rollouts, r["action_tokens"],
                             round(r["grpo"]["peak_memory_gb"], 3),
                             round(r["lopd"]["peak_memory_gb"], 3)])
                print(rows[-1], flush=True)
    print(format_table(["setting", "vocabulary", "rollouts", "action tokens",
                        "GRPO step peak GiB", "LOPD step peak GiB"], rows,
                       title="peak memory of one step above its start (width-64 Qwen3-4B shape)"))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
