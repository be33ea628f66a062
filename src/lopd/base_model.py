"""The vanilla base model: tokenizer, tiny Qwen3 and supervised fine-tuning on oracle transcripts.

Every experiment starts from this model, so it must be *partly* competent: good enough to succeed on
some held-out tasks (its successes seed the experience bank), poor enough that training methods
have room to improve it. ``build_base`` does the whole job from a seed:

1. oracle transcripts of the *pre-training pool* (a split disjoint from train and eval) are produced
   by the same agent loop that runs the model later, so the token ids and action masks the model
   is trained on are exactly those it will see when it acts;
2. a byte-level BPE tokenizer is trained on those transcripts, a Qwen3 model built from the preset;
3. the model is fine-tuned on the action tokens only (prompts and tool results are context, never
   targets), with AdamW, linear warm-up and cosine decay;
4. every ``eval_every`` steps it acts greedily on a validation set drawn from the *training* split
   (never the eval split); training stops once validation success reaches ``stop_at_success``,
   which is how the base is kept partly competent without ever looking at the eval split.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lopd import chat, models, runtime, stages
from lopd.agent import Rollout, rollout_episodes
from lopd.config import Config
from lopd.envs import get_env
from lopd.envs.toolworld import coded_request, request_parts
from lopd.latent import ReferenceFormat, insert_reference, shift_after
from lopd.policies import OraclePolicy
from lopd.teacher import ScoringBatch, action_logits


def oracle_rollouts(env, tasks, tokenizer, cfg: Config, progress: bool = True) -> list[Rollout]:
    """Oracle transcripts through the real agent loop (token ids + action masks included)."""
    return rollout_episodes(env, tasks, OraclePolicy(), tokenizer, cfg.rollout, batch_size=256,
                            progress=progress)


def tokenizer_corpus(env, tasks, max_texts: int = 5000) -> list[str]:
    """Rendered oracle conversations for tokenizer training (a tokenizer-free path: no ids yet)."""
    texts = []
    for conversation, task in zip(env.transcripts(tasks[:max_texts]), tasks[:max_texts]):
        texts.append(chat.render_chat(conversation, tools=task.tools))
    return texts


def length_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped into batches of similar length (little padding), in a shuffled order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def action_token_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over action tokens (labels != -100); also their count.

    Scored with :func:`lopd.teacher.action_logits`, which applies the output head at action
    positions only: the same loss as full logits at a fraction of the head's cost (on the tiny
    model ~1.6x faster per step on CPU).
    """
    total, count = action_token_nll(model, batch)
    return total / count, count


def action_token_nll(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over action tokens (labels != -100), and their count."""
    scored = action_logits(model, ScoringBatch(batch["input_ids"], batch["attention_mask"],
                                               batch["labels"] != -100))
    return -scored.token_logprobs().sum(), scored.targets.numel()


ACTIVATION_BYTES = 90
"""Bytes kept per token, decoder layer and unit of hidden width by a float32 forward for its
backward (measured on SmolLM2-135M with SDPA attention: 15.5 GB for 8 x 1,005 tokens, 30 layers,
hidden 576, less weights and AdamW state); with activation checkpointing a layer keeps only its
input (4 bytes per unit) and one layer at a time is recomputed."""


def expected_peak_bytes(model, micro_tokens: int, checkpointing: bool, precision: str) -> int:
    """A rough peak of one warm-up step: float32 weights, gradients and AdamW moments (16 bytes
    per parameter), the activations of a micro-batch of ``micro_tokens`` tokens (halved under
    bf16-mixed), and 1 GiB for the process itself."""
    cfg = model.config
    per_layer = micro_tokens * cfg.hidden_size
    scale = 0.5 if precision == "bf16-mixed" else 1.0
    if checkpointing:
        activations = per_layer * (4 * cfg.num_hidden_layers + ACTIVATION_BYTES * scale)
    else:
        activations = per_layer * cfg.num_hidden_layers * ACTIVATION_BYTES * scale
    return int(16 * models.count_parameters(model) + activations + 2**30)


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


LOWER_MEMORY = ("lower train.per_device_train_batch_size (transcripts per forward/backward; the "
                "update stays the same), set train.gradient_checkpointing=true, or "
                "run.precision=bf16-mixed on a CPU or GPU with bfloat16 units")


def sft_update(model, sequences: list[tuple[list[int], list[int]]], pad_id: int,
               micro_batch_size: int, precision: str, device) -> tuple[float, int]:
    """Gradients of the mean action-token cross-entropy over ``sequences`` (token ids, action
    mask), accumulated in ``model``'s ``.grad`` over micro-batches of ``micro_batch_size``
    sequences (0 = all at once). Each micro-batch's summed loss is divided by the action tokens of
    the whole batch, so the gradients equal one pass over it. Returns (mean loss, action tokens)."""
    total = sum(sum(mask[1:]) for _, mask in sequences)
    if total == 0:
        raise ValueError("a warm-up batch holds no action tokens")
    size = micro_batch_size or len(sequences)
    loss = 0.0
    for i in range(0, len(sequences), size):
        batch = {k: v.to(device) for k, v in collate_arrays(sequences[i:i + size],
                                                              pad_id).items()}
        with runtime.autocast(precision, device):
            nll, _ = action_token_nll(model, batch)
        (nll / total).backward()
        loss += nll.item()
    return loss / total, total


def lr_at(step: int, cfg) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at ``max_steps``."""
    peak = cfg.learning_rate
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def greedy_success(model, tokenizer, env, tasks, cfg: Config, device) -> dict:
    """Greedy episodes of ``model`` on ``tasks``: the held-out evaluation's summary."""
    model.eval()
    summary, _ = stages.evaluate(cfg, env, tasks, stages.model_policy(cfg, model, tokenizer, 0.0),
                                   tokenizer, progress=False)
    model.train()
    return summary


@dataclass
class SFTData:
    """Oracle transcripts as token ids and action masks, flat with offsets (compact on disk)."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> list[int]:
        return np.diff(self.offsets).tolist()

    def sequence(self, i: int) -> tuple[list[int], list[int]]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b].tolist(), self.mask[a:b].tolist()

    @classmethod
    def from_sequences(cls, sequences: list[tuple[list[int], list[int]]]) -> SFTData:
        """From (token ids, action mask) pairs."""
        offsets = np.cumsum([0] + [len(ids) for ids, _ in sequences])
        ids = np.fromiter((t for seq, _ in sequences for t in seq), dtype=np.int32,
                          count=int(offsets[-1]))
        mask = np.fromiter((m for _, seq_mask in sequences for m in seq_mask), dtype=np.uint8,
                           count=int(offsets[-1]))
        return cls(ids=ids, mask=mask, offsets=offsets)

    @classmethod
    def from_rollouts(cls, rollouts: list[Rollout]) -> SFTData:
        return cls.from_sequences([(r.input_ids, r.action_mask) for r in rollouts])

    def save(self, path: Path, meta: dict) -> None:
        np.savez_compressed(path, ids=self.ids, mask=self.mask, offsets=self.offsets,
                            meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: Path, meta: dict) -> SFTData | None:
        """The saved data if it was made with the same ``meta``, else None."""
        if not path.exists():
            return None
        with np.load(path) as f:
            saved = json.loads(str(f["meta"]))
            if "pool_digest" not in saved:  # prepared before lopd recorded the pool's digest
                meta = {k: v for k, v in meta.items() if k != "pool_digest"}
            if saved != meta:
                return None
            return cls(ids=f["ids"], mask=f["mask"], offsets=f["offsets"])


def with_references(rollouts: list[Rollout], tasks, tokenizer, fraction: float, n_ref: int,
                    max_observation_chars: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(ids, action mask) of every transcript; ``fraction`` of them carry a reference block.

    The block is the one the self-teacher reads (:mod:`lopd.latent`): the framing text around the
    compact traces of ``n_ref`` other solved tasks of the same template, at the start of the first
    user message. A base that has seen such blocks reads a reference as context instead of being
    thrown off by it, the way instruction-tuned LLMs read in-context examples; its action targets
    are unchanged (the block is never a target).
    """
    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    rng = random.Random(seed)

    def trace_for(j: int, code: str | None) -> str:
        # A peer's trace in the form of the request it is a reference for: a coded request (see
        # toolworld's coded requests) sees its peers under its own code, a plain one sees them plain.
        trace = rollouts[j].compact_trace(max_observation_chars)
        plain = tasks[j].meta.get("plain_instruction")
        if code is None and plain is None:
            return trace
        request = coded_request(plain or tasks[j].instruction, code) if code else plain
        return "\n".join([f"Task: {request}", *trace.split("\n")[1:]])

    def template_key(task) -> str:
        return f"{task.domain}/{task.meta.get('template', '')}"

    def values_key(task) -> str:
        # The template and the values a coded request leaves out (toolworld): a coded request's
        # peers share both, so that the reference shows what its code stands for.
        plain = task.meta.get("plain_instruction", task.instruction)
        return f"{template_key(task)}/" + "/".join(request_parts(plain)[1])

    coded_pool = any("plain_instruction" in t.meta for t in tasks)
    groups: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        groups.setdefault(template_key(task), []).append(i)
        if coded_pool:
            groups.setdefault(values_key(task), []).append(i)
    sequences = []
    for i, (rollout, task) in enumerate(zip(rollouts, tasks)):
        ids, mask = list(rollout.input_ids), list(rollout.action_mask)
        key = values_key(task) if "plain_instruction" in task.meta else template_key(task)
        peers = [j for j in groups[key] if j != i]
        if peers and rng.random() < fraction:
            chosen = rng.sample(peers, min(n_ref, len(peers)))
            block = fmt.text_block(tokenizer, [trace_for(j, task.meta.get("code"))
                                               for j in chosen])
            ids, at = insert_reference(ids, block, fmt)
            mask = shift_after(mask, at, len(block), 0)
        sequences.append((ids, mask))
    return sequences


def prepare(cfg: Config, out: Path, env, progress: bool = True):
    """Tokenizer and SFT data, reused from ``out`` when they were made with the same settings.

    Preparing is pure CPU work (rendering and tokenizing tens of thousands of conversations), so a
    GPU run can start from a folder prepared elsewhere.
    """
    meta = {"env": cfg.env.name, "env_seed": cfg.env.seed, "pretrain_tasks": cfg.base.pretrain_tasks,
            "vocab_size": cfg.model.vocab_size, "max_turns": cfg.rollout.max_turns,
            "max_completion_length": cfg.rollout.max_completion_length,
            "reference_fraction": cfg.base.reference_fraction, "reference_n": cfg.bank.n_ret,
            "max_observation_chars": cfg.bank.max_observation_chars, "seed": cfg.run.seed,
            "init_from": cfg.base.init_from}
    pool = env.tasks("pretrain")[: cfg.base.pretrain_tasks]
    # The tasks themselves, so that data prepared by an older version of an environment is rebuilt.
    meta["pool_digest"] = hashlib.sha256(json.dumps(
        [[t.instruction, t.oracle] for t in pool]).encode()).hexdigest()[:16]
    data_path = out / "sft_data.npz"
    if (out / "tokenizer.json").exists():
        tokenizer = models.load_tokenizer(out, trust_remote_code=cfg.model.trust_remote_code)
        data = SFTData.load(data_path, meta)
        if data is not None:
            return tokenizer, data
    if cfg.base.init_from:
        tokenizer = models.load_tokenizer(models.resolve_model_path(cfg.base.init_from),
                                          trust_remote_code=cfg.model.trust_remote_code)
    else:
        tokenizer = models.train_tokenizer(tokenizer_corpus(env, pool),
                                           vocab_size=cfg.model.vocab_size)
    tokenizer.save_pretrained(out)
    rollouts = oracle_rollouts(env.for_transcripts(), pool, tokenizer, cfg, progress=progress)
    data = SFTData.from_sequences(with_references(
        rollouts, pool, tokenizer, cfg.base.reference_fraction, cfg.bank.n_ret,
        cfg.bank.max_observation_chars, cfg.run.seed))
    data.save(data_path, meta)
    return tokenizer, data


def collate_arrays(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 off the action tokens)."""
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for row, (seq_ids, seq_mask) in enumerate(seqs):
        n = len(seq_ids)
        seq = torch.tensor(seq_ids)
        ids[row, :n] = seq
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(seq_mask, dtype=torch.bool), seq, -100)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


CHECKPOINT = "base_checkpoint.pt"


def _save_checkpoint(path: Path, cfg: Config, model, optimizer, rng: random.Random, batches,
                     history, evals, step: int, seconds: float) -> None:
    """Everything needed to continue training after ``step``, written atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save({"config": asdict(cfg), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "rng": rng.getstate(), "batches": batches,
                "history": history, "evals": evals, "step": step, "seconds": seconds}, tmp)
    tmp.replace(path)


def _comparable(config: dict, saved: dict) -> dict:
    """``config`` without the keys a resumed run may change (wall-clock limit, CPU threads) and
    without keys the ``saved`` config does not have (settings added to lopd since it was
    written)."""
    config = json.loads(json.dumps(config))
    for section, key in (("base", "time_limit_minutes"), ("base", "save_every_minutes"),
                         ("run", "num_threads"), ("train", "per_device_train_batch_size"),
                         ("train", "gradient_checkpointing")):
        config.get(section, {}).pop(key, None)
    return {section: {k: v for k, v in values.items() if k in saved.get(section, {})}
            for section, values in config.items() if section in saved}


def build_base(cfg: Config, out_dir: str | Path, progress: bool = True, resume: bool = False) -> dict:
    """Build, train and save the base model; returns the training summary (also saved as JSON).

    Training state is checkpointed at every validation and when the time limit stops it, so a long
    run on a slow machine can be continued later with ``resume=True`` (same config; the time limit
    and thread count may differ), ending exactly where an uninterrupted run would.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = None
    if resume:
        if not (out / CHECKPOINT).exists():
            raise FileNotFoundError(f"{out} has no {CHECKPOINT} to resume from")
        state = torch.load(out / CHECKPOINT, weights_only=False)
        saved = state["config"]
        if _comparable(saved, saved) != _comparable(asdict(cfg), saved):
            raise ValueError(f"{out / CHECKPOINT} was made with a different config; resume with "
                             "the same settings (only base.time_limit_minutes, "
                             "base.save_every_minutes, run.num_threads, "
                             "train.per_device_train_batch_size and train.gradient_checkpointing "
                             "may change)")
    device = runtime.setup(cfg.run)
    bcfg = cfg.base
    start = time.perf_counter()

    env = get_env(cfg.env.name, **cfg.env.kwargs())
    if bcfg.pretrain_tasks > len(env.tasks("pretrain")):
        raise ValueError(f"base.pretrain_tasks={bcfg.pretrain_tasks} exceeds the pre-training pool "
                         f"of {len(env.tasks('pretrain'))} tasks (env.pretrain_size)")
    validation = random.Random(cfg.run.seed).sample(env.tasks("train"), bcfg.eval_tasks)
    tokenizer, data = prepare(cfg, out, env, progress=progress)
    prepare_seconds = time.perf_counter() - start
    if bcfg.init_from:
        model, _ = models.load_model(bcfg.init_from,
                                     trust_remote_code=cfg.model.trust_remote_code)
    else:
        model = models.build_model(tokenizer, preset=cfg.model.architecture, seed=cfg.run.seed,
                                   max_position_embeddings=cfg.model.max_position_embeddings)
    # Trained weights stay float32; bf16-mixed precision runs the forward under autocast.
    model.to(device=device, dtype=torch.float32).train()
    precision, why = runtime.choose_precision(cfg.run.precision, device, runtime.hidden_size(model))
    micro = cfg.train.per_device_train_batch_size
    if cfg.train.gradient_checkpointing:
        models.enable_activation_checkpointing(model)
    lengths = data.lengths()
    longest = max(lengths)
    per_pass = min(micro, bcfg.batch_size) if micro else bcfg.batch_size
    micro_tokens = longest * per_pass
    peak, free = (expected_peak_bytes(model, micro_tokens, cfg.train.gradient_checkpointing,
                                      precision), available_bytes())
    if free is not None and peak > free:
        raise MemoryError(f"a warm-up step would need about {peak / 2**30:.1f} GiB ({micro_tokens} "
                          f"tokens per forward/backward) but {free / 2**30:.1f} GiB is free: "
                          f"{LOWER_MEMORY}")
    if progress:
        attention = getattr(model.config, "_attn_implementation", None) or "default"
        print(f"precision: {precision} ({why}); attention: {attention}; micro-batches of "
              f"{per_pass} of "
              f"{bcfg.batch_size} transcripts (train.per_device_train_batch_size); activation "
              f"checkpointing {'on' if cfg.train.gradient_checkpointing else 'off'} "
              f"(train.gradient_checkpointing); expected peak ~{peak / 2**30:.1f} GiB")
    too_long = sum(n > cfg.model.max_position_embeddings for n in lengths)
    if too_long:
        raise ValueError(f"{too_long} oracle transcripts exceed model.max_position_embeddings="
                         f"{cfg.model.max_position_embeddings}; raise it")

    optimizer = torch.optim.AdamW(model.parameters(), lr=bcfg.learning_rate,
                                  weight_decay=bcfg.weight_decay, betas=(0.9, 0.95))
    rng = random.Random(cfg.run.seed)
    batches: list[list[int]] = []
    history: list[dict] = []
    evals: list[dict] = []
    first, offset = 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        batches, history, evals = state["batches"], state["history"], state["evals"]
        first, offset = state["step"], state["seconds"]
        start -= offset
    stopped = "max_steps"

    saved_at, saved_step = time.perf_counter(), first if state is not None else None

    def checkpoint(done: int) -> None:
        nonlocal saved_at, saved_step
        _save_checkpoint(out / CHECKPOINT, cfg, model, optimizer, rng, batches, history, evals,
                         done, time.perf_counter() - start)
        saved_at, saved_step = time.perf_counter(), done

    bar = tqdm(total=bcfg.max_steps, initial=first, desc="base SFT", disable=not progress)
    for step in range(first, bcfg.max_steps):
        if not batches:
            batches = length_batches(lengths, bcfg.batch_size, rng)
        sequences = [data.sequence(i) for i in batches.pop()]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, bcfg)
        optimizer.zero_grad(set_to_none=True)
        try:
            loss, n_tokens = sft_update(model, sequences, tokenizer.pad_token_id, micro,
                                        precision, device)
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as exc:
            if not isinstance(exc, MemoryError | torch.OutOfMemoryError) \
                    and "memory" not in str(exc):
                raise
            kept = (f"resume from {out / CHECKPOINT} (step {saved_step}) with --resume"
                    if saved_step is not None else "no checkpoint was written yet")
            raise MemoryError(f"out of memory at warm-up step {step + 1} "
                              f"({sum(len(ids) for ids, _ in sequences)} tokens): {LOWER_MEMORY}; "
                              f"{kept}") from exc
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), bcfg.max_grad_norm)
        optimizer.step()
        history.append({"step": step + 1, "loss": loss, "grad_norm": float(grad_norm),
                        "lr": optimizer.param_groups[0]["lr"], "action_tokens": n_tokens,
                        "seconds": round(time.perf_counter() - start, 2)})
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        last = step + 1 == bcfg.max_steps
        if (step + 1) % bcfg.eval_every == 0 or last:
            # The gradients are spent: their memory goes to the evaluation's key/value caches.
            optimizer.zero_grad(set_to_none=True)
            summary = greedy_success(model, tokenizer, env, validation, cfg, device)
            evals.append({"step": step + 1, "success_rate": summary["success_rate"],
                          "mean_reward": summary["mean_reward"],
                          "seconds": round(time.perf_counter() - start, 2)})
            bar.write(f"step {step + 1}: validation success {summary['success_rate']:.3f}, "
                      f"reward {summary['mean_reward']:.3f}")
            checkpoint(step + 1)
            if summary["success_rate"] >= bcfg.stop_at_success:
                stopped = "stop_at_success"
                break
        if bcfg.time_limit_minutes and (time.perf_counter() - start - offset
                                        > 60 * bcfg.time_limit_minutes):
            checkpoint(step + 1)
            stopped = "time_limit"
            break
        if (bcfg.save_every_minutes and not last
                and time.perf_counter() - saved_at > 60 * bcfg.save_every_minutes):
            checkpoint(step + 1)
    bar.close()

    model.to(dtype=torch.float32)
    models.save_model(model.cpu(), tokenizer, out)
    result = {
        "path": str(out),
        "parameters": models.count_parameters(model),
        "vocab_size": len(tokenizer),
        "architecture": (f"{model.config.model_type} (from {bcfg.init_from})" if bcfg.init_from
                         else cfg.model.architecture),
        "hidden_size": model.config.hidden_size,
        "layers": model.config.num_hidden_layers,
        "init_from": bcfg.init_from or None,
        "pretrain_transcripts": len(data),
        "tokens_per_transcript": round(len(data.ids) / len(data), 1),
        "action_tokens_per_transcript": round(int(data.mask.sum()) / len(data), 1),
        "steps": len(history),
        "stopped": stopped,
        "final_loss": history[-1]["loss"],
        "validation_success": evals[-1]["success_rate"] if evals else None,
        "prepare_seconds": round(prepare_seconds, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "device": str(device),
        "seed": cfg.run.seed,
    }
    (out / "base_training.json").write_text(json.dumps(
        {"result": result, "config": asdict(cfg), "evals": evals, "history": history}, indent=1))
    plot_training(history, evals, out / "base_training.png")
    return result


def plot_training(history: list[dict], evals: list[dict], path: Path) -> None:
    """Loss (left axis) and validation success (right axis) against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="action-token loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([e["step"] for e in evals], [e["success_rate"] for e in evals], "o-", color="C1",
                 label="validation success (train split)")
        ax2.set_ylabel("success rate")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("base model: supervised fine-tuning on oracle transcripts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
