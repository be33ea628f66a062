"""Where a decode step of lopd's transformers engine spends its time on a real model.

    python benchmarks/decode_profile.py --model runs/models/smollm2-135m --batch 32 \
        --json docs/results/rollout-engines/decode-profile.json

The engine as the trainer builds it under bf16-mixed on a CPU (``rollout.generation_weights=auto``:
a bfloat16 copy of the float32 model, autocast off) generates ``--new-tokens`` tokens for the
first-turn prompts of ``--batch`` toolworld training tasks of the config (system prompt, tools,
request: the prompts of a rollout's first turn), stop tokens off so that every row decodes every
step. After a warm-up call, one call runs under ``torch.profiler``; each model forward is labelled
prefill (more than one new position) or decode, and every operator's own CPU time is charged to
the forward it ran in. Printed per decode step: the step's time, its operators by share, the
largest operator/shape pairs, and two memory-traffic figures that bound a decode step from below:
the bytes of weights it reads (every matmul reads its whole weight for a batch this small) and
the bytes of keys and values its attention reads (every row its own cache: batch × layers × 2 ×
kv heads × context × head dim). Then the attention of one layer alone, as the step runs it
(``scaled_dot_product_attention`` on the folded GQA query, with the padding mask) and without the
mask, timed on tensors of the step's shapes; how many leading tokens each prompt shares with
another prompt of the batch (keys and values every row reads again). Last, the dtypes of the key/value cache that the
float32 model leaves under bf16 autocast (the trainer's path with
``rollout.generation_weights=master``), read after one forward of a prompt.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from lopd import chat, models, runtime, stages
from lopd.config import load_config
from lopd.latent import _common_prefix
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json


def first_turn_prompts(cfg, tokenizer, count: int) -> list[list[int]]:
    env = stages.get_env(cfg)
    tasks, _ = stages.held_out_tasks(cfg, env)
    return [chat.render(tokenizer, env.reset(t).messages(), t.tools, add_generation_prompt=True)
            for t in tasks[:count]]


def labelled(model):
    """Label each forward call of ``model`` for the profiler: PREFILL or DECODE."""
    forward = model.forward

    def call(*args, **kwargs):
        inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        with record_function("DECODE" if inputs.size(1) == 1 else "PREFILL"):
            return forward(*args, **kwargs)

    model.forward = call


def charge(events) -> tuple[dict, dict, Counter, Counter]:
    """Self CPU time (µs) of every operator charged to the PREFILL/DECODE range it ran in."""
    by_op, by_shape = defaultdict(Counter), defaultdict(Counter)
    total, calls = Counter(), Counter()
    for event in events:
        if event.name in ("DECODE", "PREFILL"):
            total[event.name] += event.cpu_time_total
            calls[event.name] += 1
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in ("DECODE", "PREFILL"):
            parent = parent.cpu_parent
        if parent is not None:
            by_op[parent.name][event.name] += event.self_cpu_time_total
            by_shape[parent.name][event.name, str(event.input_shapes)] += event.self_cpu_time_total
    return by_op, by_shape, total, calls


def timed(fn, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def attention_alone(model, batch: int, context: int, dtype) -> dict:
    """One layer's decode attention on the step's shapes: with the padding mask (as the engine's
    step runs it) and without."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    keys = torch.randn(batch, kv_heads, context, dim, dtype=dtype)
    values = torch.randn(batch, kv_heads, context, dim, dtype=dtype)
    query = torch.randn(batch, kv_heads, heads // kv_heads, dim, dtype=dtype)
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
    mask[: batch // 2, :, :, : context // 8] = False  # left padding of half the rows
    with torch.inference_mode():
        masked = timed(lambda: F.scaled_dot_product_attention(query, keys, values, attn_mask=mask))
        plain = timed(lambda: F.scaled_dot_product_attention(query, keys, values))
    kv_bytes = 2 * keys.numel() * keys.element_size()
    return {"context": context, "kv_mib_per_layer": kv_bytes / 2**20,
            "masked_ms": masked * 1e3, "unmasked_ms": plain * 1e3,
            "masked_gb_per_s": kv_bytes / masked / 1e9, "unmasked_gb_per_s": kv_bytes / plain / 1e9}


def shared_prefixes(prompts: list[list[int]]) -> list[int]:
    """Per prompt, the longest prefix it shares with another prompt of the batch (tokens)."""
    return [max(len(_common_prefix([p, q])) for j, q in enumerate(prompts) if j != i)
            for i, p in enumerate(prompts)]


def autocast_cache_dtypes(model, prompt: list[int]) -> dict:
    """Dtypes of the first layer's cached keys and values after a forward of the float32
    ``model`` on ``prompt`` under bf16 autocast."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    layer = cache.layers[0]
    return {"keys": str(layer.keys.dtype), "values": str(layer.values.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/models/smollm2-135m")
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    runtime.set_threads(args.threads)
    cfg = load_config(args.config, [f"model.name_or_path={args.model}"])
    model, tokenizer = models.load_model(args.model)
    engine = stages.make_engine(cfg.rollout, model, tokenizer, "bf16-mixed")
    if not isinstance(engine, TransformersEngine):
        parser.error("run it where rollout.engine resolves to the transformers engine")
    labelled(engine.model)
    prompts = first_turn_prompts(cfg, tokenizer, args.batch)
    engine.stop_token_ids = frozenset()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=3, seed=0))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                seed=1))
    by_op, by_shape, total, calls = charge(prof.events())
    steps = calls["DECODE"]
    step_ms = total["DECODE"] / 1e3 / steps
    charged = sum(by_op["DECODE"].values())
    ops = [{"operator": name, "ms_per_step": us / 1e3 / steps, "share": us / charged}
           for name, us in by_op["DECODE"].most_common(10)]
    shapes = [{"operator": name, "shapes": shape, "ms_per_step": us / 1e3 / steps}
              for (name, shape), us in by_shape["DECODE"].most_common(8)]
    context = max(map(len, prompts)) + args.new_tokens // 2
    config = engine.model.config
    heads = config.num_attention_heads
    dim = config.hidden_size // heads
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters()
                       if p.dim() == 2 and p is not engine.model.get_input_embeddings().weight)
    if getattr(config, "tie_word_embeddings", False):
        weight_bytes += engine.model.get_input_embeddings().weight.numel() * engine.weights_dtype.itemsize
    kv_bytes = (args.batch * config.num_hidden_layers * 2 * config.num_key_value_heads * context
                * dim * engine.weights_dtype.itemsize)
    attention = attention_alone(engine.model, args.batch, context, engine.weights_dtype)
    autocast_cache = autocast_cache_dtypes(model, prompts[0][:64])
    shared = shared_prefixes(prompts)
    print(f"{args.batch} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.threads} thread(s), weights {engine.weights_dtype}; decode step "
          f"{step_ms:.1f} ms (mean of {steps}, under the profiler)")
    print(format_table(["operator", "ms per step", "share"],
                       [[o["operator"], f"{o['ms_per_step']:.2f}", f"{o['share']:.1%}"] for o in ops],
                       title="decode step, operators' own CPU time"))
    print(format_table(["ms per step", "operator", "input shapes"],
                       [[f"{s['ms_per_step']:.2f}", s["operator"], s["shapes"][:90]]
                        for s in shapes], title="largest operator/shape pairs"))
    print(f"bytes read per decode step: weights {weight_bytes / 2**20:.0f} MiB (used by the "
          f"matmuls), keys and values {kv_bytes / 2**20:.0f} MiB (context ~{context})")
    print(f"one layer's attention alone: KV {attention['kv_mib_per_layer']:.1f} MiB, with the "
          f"padding mask {attention['masked_ms']:.2f} ms ({attention['masked_gb_per_s']:.1f} GB/s), "
          f"without {attention['unmasked_ms']:.2f} ms ({attention['unmasked_gb_per_s']:.1f} GB/s)")
    print(f"each prompt shares {min(shared)}-{max(shared)} of its leading tokens with another "
          f"prompt of the batch (median {sorted(shared)[len(shared) // 2]})")
    print(f"the float32 model under bf16 autocast caches keys in {autocast_cache['keys']} and "
          f"values in {autocast_cache['values']}")
    if args.json_path:
        write_json(args.json_path, {"settings": vars(args), "prompt_tokens": [len(p) for p in prompts],
                                    "decode_step_ms": step_ms, "decode_steps": steps,
                                    "prefill_ms": total["PREFILL"] / 1e3, "operators": ops,
                                    "shapes": shapes, "weight_mib": weight_bytes / 2**20,
                                    "kv_mib": kv_bytes / 2**20, "attention_one_layer": attention,
                                    "autocast_cache_dtypes": autocast_cache,
                                    "shared_prefix_tokens": shared})


if __name__ == "__main__":
    main()
