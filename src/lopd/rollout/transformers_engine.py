"""Batched generation with plain transformers: one prefill, then a hand-written KV-cache decode.

Why not ``model.generate``: it keeps finished rows in the batch until the longest row ends, and its
scores are the *processed* logits. Here a row leaves the batch the moment it produces a stop token
(its cache rows, mask and position are dropped), so in an agent batch an episode that answered in a
few tokens costs nothing while the others continue, and the recorded log-probs are exactly the
ones :class:`~lopd.rollout.engine.Generation` documents.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import DynamicCache

from lopd.latent import splice_embeddings
from lopd.models import IM_END, LATENT_TOKEN
from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams, check_prompts


def default_stop_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's eos, the model's configured eos ids, and ``<|im_end|>`` if in the vocabulary."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos is not None:
        ids.update(config_eos)
    im_end = tokenizer.get_vocab().get(IM_END)
    if im_end is not None:
        ids.add(im_end)
    if not ids:
        raise ValueError("the tokenizer has no eos token and no <|im_end|>: pass stop_token_ids")
    return frozenset(ids)


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` (batch × vocab, float32).

    Returns the tokens and their log-probs under ``softmax(logits / temperature)`` (temperature 1
    when greedy), taken before top-k / top-p truncation.
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        kept = scaled
        if params.top_k > 0:
            k = min(params.top_k, kept.shape[-1])
            kth_best = torch.topk(kept, k, dim=-1).values[:, -1:]
            kept = kept.masked_fill(kept < kth_best, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(kept, dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the best one stays.
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop_sorted = mass_before >= params.top_p
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            kept = kept.masked_fill(drop, float("-inf"))
        probs = torch.softmax(kept, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(1)).squeeze(1)


class TransformersEngine(RolloutEngine):
    """Rollout engine for any transformers causal LM, on CPU or GPU.

    Prompts of different lengths are left-padded into one batch; position ids count real tokens
    only, so a padded row computes exactly what it would alone.
    """

    def __init__(self, model, tokenizer, stop_token_ids: Iterable[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = (frozenset(stop_token_ids) if stop_token_ids is not None
                               else default_stop_token_ids(model, tokenizer))
        pad = tokenizer.pad_token_id
        pad = pad if pad is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token to pad prompts with")
        self.pad_token_id: int = pad
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        # transformers renamed `past_key_values` to `cache` (5.2x); models and versions that predate
        # the rename would silently drop the new name and recompute without a cache.
        forward_parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_parameters else "past_key_values"

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 latents: torch.Tensor | None = None) -> list[Generation]:
        if not prompts:
            return []
        check_prompts(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return self._generate(prompts, params, latents)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  latents: torch.Tensor | None) -> list[Generation]:
        device = self.model.device
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # Positions count real tokens only (0 at each row's first token); pads get 0 and are masked.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = attention_mask.sum(-1)
        stop_ids = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long, device=device)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)

        cache = DynamicCache(config=self.model.config)
        cache_arg = {self._cache_kwarg: cache}
        if latents is None:
            prompt_inputs = {"input_ids": input_ids}
        else:
            latent_id = self.tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
            prompt_inputs = {"inputs_embeds": splice_embeddings(
                self.model.get_input_embeddings(), input_ids, latents.to(device), latent_id)}
        out = self.model(**prompt_inputs, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, logits_to_keep=1, **cache_arg)
        logits = out.logits[:, -1, :].float()

        token_ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = [False] * batch
        rows = list(range(batch))  # original prompt index of every live row
        for step in range(params.max_new_tokens):
            tokens, token_logprobs = sample_next(logits, params, generator)
            stopped = torch.isin(tokens, stop_ids)
            # One device-to-host copy per step (float64 holds token ids and float32 values exactly).
            host = torch.stack([tokens.double(), token_logprobs.double(), stopped.double()])
            host = host.tolist()
            live = []
            for i, (row, token, logprob, stop) in enumerate(zip(rows, *host)):
                token_ids[row].append(int(token))
                logprobs[row].append(logprob)
                finished[row] = bool(stop)
                if not stop:
                    live.append(i)
            if step == params.max_new_tokens - 1 or not live:
                break
            if len(live) < len(rows):
                keep = torch.tensor(live, dtype=torch.long, device=device)
                cache.batch_select_indices(keep)
                attention_mask, next_position = attention_mask[keep], next_position[keep]
                tokens = tokens[keep]
                rows = [rows[i] for i in live]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=attention_mask,
                             position_ids=next_position.unsqueeze(1), use_cache=True, **cache_arg)
            logits = out.logits[:, -1, :].float()
            next_position = next_position + 1
        return [Generation(token_ids=t, logprobs=lp, finished=f)
                for t, lp, f in zip(token_ids, logprobs, finished)]
