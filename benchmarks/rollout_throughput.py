"""Throughput of the rollout engine against Hugging Face ``model.generate`` on the same batch.

Builds the tiny default model (and optionally the small one), then samples ``--max-new-tokens``
tokens at temperature 1 for ``--batch-size`` prompts of about ``--prompt-tokens`` tokens, with both
engines, one after the other in the same process and thread setting. Prints generated tokens per
second (generated tokens / wall time) and the ratio; ``--json PATH`` writes the same figures.

    python benchmarks/rollout_throughput.py --presets qwen3-1m qwen3-4m --json runs/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from lopd import models, runtime, stages
from lopd.config import RolloutConfig
from lopd.corpus import synthetic_transcripts
from lopd.rollout import RolloutEngine, SamplingParams
from lopd.tables import format_table, write_json


def make_prompts(tokenizer, batch_size: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``batch_size`` prompts of ``prompt_tokens`` ± 10% tokens (so the batch needs padding)."""
    generator = torch.Generator().manual_seed(seed)
    text = "".join(synthetic_transcripts(n=200, seed=seed + 1))
    stream = tokenizer(text, add_special_tokens=False)["input_ids"]
    spread = max(1, prompt_tokens // 10)
    prompts = []
    for row in range(batch_size):
        length = prompt_tokens + int(torch.randint(-spread, spread + 1, (1,), generator=generator))
        start = (row * 997) % (len(stream) - length)
        prompts.append(stream[start:start + length])
    return prompts


def time_engine(engine: RolloutEngine, prompts, params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    generations = engine.generate(prompts, params)  # returns host lists: the device is done
    return sum(len(g.token_ids) for g in generations), time.perf_counter() - start


def time_hf_generate(model, tokenizer, prompts, params: SamplingParams,
                     stop_ids: list[int]) -> tuple[int, float]:
    """The same job through ``model.generate`` (left-padded batch, plain sampling, no top-k)."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    batch = batch.to(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=True, temperature=params.temperature, top_k=0,
                             top_p=1.0, max_new_tokens=params.max_new_tokens, eos_token_id=stop_ids,
                             pad_token_id=tokenizer.pad_token_id)
        out = out.cpu()
    elapsed = time.perf_counter() - start
    generated = 0
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        # Count up to and including the first stop token; the rest is padding.
        stops = [i for i, t in enumerate(row) if t in stop_ids]
        generated += stops[0] + 1 if stops else len(row)
    return generated, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["qwen3-1m"],
                        choices=sorted(models.ARCH_PRESETS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per engine; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH")
    args = parser.parse_args()

    runtime.set_threads(args.threads)
    device = runtime.resolve_device(args.device)
    corpus = synthetic_transcripts(n=300, seed=args.seed)
    tokenizer = models.train_tokenizer(corpus, vocab_size=2048)
    prompts = make_prompts(tokenizer, args.batch_size, args.prompt_tokens, args.seed)
    rows, results = [], []
    for preset in args.presets:
        model = models.build_model(tokenizer, preset, seed=args.seed).eval().to(device)
        engine = stages.make_engine(RolloutConfig(), model, tokenizer)
        stop_ids = sorted(engine.stop_token_ids)
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                seed=args.seed)
        # One short warm-up each so neither engine pays one-off allocation costs in the timing.
        engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, seed=0))
        time_hf_generate(model, tokenizer, prompts[:4], SamplingParams(max_new_tokens=4), stop_ids)
        figures = {}
        runs = {"lopd": partial(time_engine, engine, prompts, params),
                "hf_generate": partial(time_hf_generate, model, tokenizer, prompts, params, stop_ids)}
        for name, run in runs.items():
            timings = [run() for _ in range(args.repeats)]
            tokens, seconds = max(timings, key=lambda t: t[0] / t[1])
            figures[name] = {"generated_tokens": tokens, "seconds": seconds,
                             "tokens_per_s": tokens / seconds}
        ratio = figures["lopd"]["tokens_per_s"] / figures["hf_generate"]["tokens_per_s"]
        parameters = models.count_parameters(model)
        results.append({"preset": preset, "parameters": parameters, **figures, "speedup": ratio})
        for name in ("lopd", "hf_generate"):
            f = figures[name]
            rows.append([preset, name, f["generated_tokens"], round(f["seconds"], 2),
                         round(f["tokens_per_s"]), round(ratio, 2) if name == "lopd" else ""])

    print(format_table(["preset", "engine", "gen tokens", "wall s", "tokens/s", "speedup"], rows,
                       title=f"batch {args.batch_size} x ~{args.prompt_tokens} prompt tokens, "
                             f"{args.max_new_tokens} new tokens, T={args.temperature}, "
                             f"{args.threads} thread(s), {device}"))
    write_json(args.json_path, {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
