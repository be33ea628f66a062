"""Batched generation with plain transformers: one prefill, then a hand-written KV-cache decode.

Why not ``model.generate``: it keeps finished rows in the batch until the longest row ends, and its
scores are the *processed* logits. Here a row leaves the batch the moment it produces a stop token
(its cache rows, mask and position are dropped), so in an agent batch an episode that answered in a
few tokens costs nothing while the others continue, and the recorded log-probs are exactly the
ones :class:`~lopd.rollout.engine.Generation` documents.

Across the turns of an episode the engine keeps the episode's KV cache (``sessions``): the next
turn's prompt is the previous one plus the generated turn, the tool's answer and the generation
prompt, so only those new tokens are prefilled, not the whole conversation again.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lopd.chat import IM_END, LATENT_TOKEN
from lopd.latent import splice_embeddings
from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams, check_prompts
from lopd.runtime import length_groups


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


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` by inverting its cumulative distribution at a uniform draw
    (in float64): the distribution of ``torch.multinomial``, at a small part of its cost on CPU.
    A token of probability 0 is never drawn."""
    cumulative = probs.double().cumsum(-1)
    uniform = torch.rand((probs.size(0), 1), generator=generator, dtype=torch.float64,
                         device=probs.device) * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, uniform, right=True).squeeze(1)
    tokens = tokens.clamp_max(probs.size(-1) - 1)
    # Rounding can put the draw at the very top: then the last token of non-zero probability.
    last = (probs > 0).cumsum(-1).argmax(-1)
    return torch.where(probs.gather(-1, tokens.unsqueeze(1)).squeeze(1) > 0, tokens, last)


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
        tokens = _draw(probs, generator)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(1)).squeeze(1)


@dataclass
class _KeptCache:
    """One session's KV cache after a call: the keys and values of ``tokens``, per layer."""

    tokens: list[int]
    """The sequence the cache covers: the prompt and every generated token but the last (whose
    keys and values were never computed)."""
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, (heads, len(tokens), head_dim) keys and values, padding removed."""
    latents: torch.Tensor | None
    """The latents spliced into the prompt when the cache was made (None: none)."""


class _BufferedLayer(DynamicLayer):
    """A decode cache layer whose keys and values live in buffers with room for the whole call:
    a step writes its position instead of copying the cache (as DynamicLayer's concatenation
    does at every token). The capacity is the prompt width plus the call's ``max_new_tokens``,
    which the decode loop never exceeds."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        """``keys`` / ``values``: (batch, heads, capacity, head_dim) buffers whose first
        ``length`` positions hold the cache."""
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values
        self.length = length
        self.device, self.is_initialized = keys.device, True
        self._views()

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        stop = self.length + key_states.size(-2)
        self.key_buffer[:, :, self.length:stop] = key_states
        self.value_buffer[:, :, self.length:stop] = value_states
        self.length = stop
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer = self.key_buffer[indices]
        self.value_buffer = self.value_buffer[indices]
        self._views()


def weight_copy(model, dtype: torch.dtype):
    """A copy of ``model`` for generation whose parameters are ``dtype`` and frozen; buffers and
    the module structure are copied as they are (tied parameters stay tied). The parameters are
    cast one by one, so no second full-precision copy is ever made."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError("a weight copy of a model with adapters is not supported: the adapters' "
                         "on/off state would not follow the model")
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            for p in model.parameters()}
    return copy.deepcopy(model, memo).eval()


class TransformersEngine(RolloutEngine):
    """Rollout engine for any transformers causal LM, on CPU or GPU.

    Prompts of different lengths are left-padded into one batch; position ids count real tokens
    only, so a padded row computes exactly what it would alone.

    With ``reuse_cache`` (the default) a call given ``sessions`` keeps each session's KV cache
    until the next call; there a prompt of the same session that extends the kept sequence
    prefills only its new tokens, and a new session's prompt borrows the prefix it shares with
    a kept one (the system prompt and tools of episodes of one template). Sessions absent from a
    call are dropped after it, :meth:`release` drops them all, and nothing is reused when the
    model's weights changed in between (the parameters' in-place versions, the adapters' on/off
    state) or the latents differ. Models whose cache is not a plain per-layer key/value cache
    (sliding-window or recurrent layers) always re-prefill.

    With ``weights_dtype`` (e.g. ``torch.bfloat16`` for a float32 model trained under bf16
    autocast) the engine generates from its own copy of the model in that dtype, with autocast
    off: a decoded token then runs the bf16 kernels directly, and the key/value cache is all
    bfloat16 (under autocast the rotary embedding leaves the keys in float32). SmolLM2 on a CPU
    with AMX-BF16 decodes 1.9x (batch 8) to 3.7x (batch 32) faster so
    (docs/results/rollout-engines-smollm2.md).
    The copy is refreshed from ``model`` before any call after ``model``'s parameters changed (their
    in-place versions, as an optimiser step or a checkpoint load bumps them), and by
    :meth:`sync_weights`; it costs one parameter's worth of ``weights_dtype`` per parameter.
    """

    MIN_SHARED = 16
    """Fewest shared prompt tokens a new episode borrows from another episode's kept cache."""

    def __init__(self, model, tokenizer, stop_token_ids: Iterable[int] | None = None,
                 reuse_cache: bool = True, weights_dtype: torch.dtype | None = None):
        self.source = model
        """The model whose current weights are generated from."""
        self.model = model
        """What generates: ``model`` itself, or its copy in ``weights_dtype``."""
        self._synced: tuple | None = None
        if weights_dtype is not None and weights_dtype != next(model.parameters()).dtype:
            self.model = weight_copy(model, weights_dtype)
            self._synced = self._source_versions()
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
        self.latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN) \
            if LATENT_TOKEN in tokenizer.get_vocab() else None
        plain = all(type(layer) is DynamicLayer
                    for layer in DynamicCache(config=model.config).layers)
        self.reuse_cache = reuse_cache and plain
        self._kept: dict[Hashable, _KeptCache] = {}
        self._kept_state: tuple | None = None
        self.prefilled_tokens = 0
        """Prompt tokens prefilled so far (padding not counted): what kept caches save."""

    def release(self) -> None:
        self._kept, self._kept_state = {}, None

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of the weights generation runs with."""
        return next(self.model.parameters()).dtype

    def _source_versions(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.source.parameters())

    def sync_weights(self, model) -> None:
        """Refresh the weight copy from ``model`` (the model the engine was built over); nothing
        to do without a copy. :meth:`generate` also refreshes it by itself when the model's
        parameters changed since the last refresh."""
        if model is not self.source:
            raise ValueError("sync_weights: the engine generates from another model")
        if self.model is not self.source:
            self._refresh_copy()

    def _refresh_copy(self) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), self.source.parameters(),
                                    strict=True):
                mine.copy_(theirs)
            for mine, theirs in zip(self.model.buffers(), self.source.buffers(), strict=True):
                mine.copy_(theirs)
        self._synced = self._source_versions()

    def _weights_state(self) -> tuple:
        """What must be unchanged for a kept cache to be valid: every parameter's in-place version
        and every adapter layer's on/off state and active adapters."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        versions = tuple((p.data_ptr(), p._version) for p in self.model.parameters())
        adapters = tuple((bool(m.disable_adapters), tuple(m.active_adapters))
                         for m in self.model.modules() if isinstance(m, BaseTunerLayer))
        return versions, adapters

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 latents: torch.Tensor | None = None,
                 sessions: Sequence[Hashable] | None = None) -> list[Generation]:
        if not prompts:
            return []
        check_prompts(prompts)
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        if latents is not None and self.latent_id is None:
            raise ValueError(f"latents given, but the tokenizer has no {LATENT_TOKEN} token")
        device = next(self.model.parameters()).device.type
        copied = self.model is not self.source
        if copied and self._source_versions() != self._synced:
            self._refresh_copy()
        was_training = self.model.training
        self.model.eval()
        # Under bf16 autocast, no_grad rather than inference_mode: autocast keeps its bfloat16
        # copies of the float32 weights only outside inference mode, and without them every
        # decoded token casts every weight again (a decode step of SmolLM2 ~6x slower). A weight
        # copy generates in its own dtype, autocast off.
        autocast = torch.is_autocast_enabled(device) and not copied
        no_grad = torch.no_grad if autocast else torch.inference_mode
        plain = torch.autocast(device, enabled=False) if copied else contextlib.nullcontext()
        try:
            with no_grad(), plain:
                return self._generate(prompts, params, latents, sessions)
        finally:
            self.model.train(was_training)

    def _reusable(self, prompts, latents, sessions) -> list[_KeptCache | None]:
        """Per prompt, the kept cache it extends (None: prefill the whole prompt). The kept caches
        are handed over: this call keeps its own.

        A prompt whose session has nothing kept (a new episode) borrows the longest prefix it
        shares with any kept sequence, when that is at least ``MIN_SHARED`` tokens: episodes of
        one task template open with the same system prompt and tool list. Keys and values of the
        same tokens at the same positions are the same whoever computed them (causal attention);
        not with latents, whose values differ from row to row: a prompt with latents borrows
        nothing, and only caches made without latents lend (a ``<|latent|>`` position in one holds
        the spliced latent, not the token's own embedding)."""
        kept, self._kept = self._kept, {}
        if not self.reuse_cache or sessions is None:
            self._kept_state = None
            return [None] * len(prompts)
        state = self._weights_state()
        if state != self._kept_state:
            kept = {}
        self._kept_state = state
        donors = [entry for entry in kept.values() if entry.latents is None]
        found = []
        for row, (prompt, session) in enumerate(zip(prompts, sessions)):
            entry = kept.pop(session, None)
            if entry is not None and not (
                    len(entry.tokens) < len(prompt) and prompt[:len(entry.tokens)] == entry.tokens
                    and (entry.latents is None) == (latents is None)
                    and (latents is None or torch.equal(entry.latents, latents[row]))):
                entry = None
            found.append(entry)
        fresh = [row for row, entry in enumerate(found) if entry is None]
        if donors and fresh and latents is None:
            width = max(len(d.tokens) for d in donors)
            table = np.full((len(donors), width), -1, dtype=np.int64)
            for i, donor in enumerate(donors):
                table[i, :len(donor.tokens)] = donor.tokens
            for row in fresh:
                prompt = np.asarray(prompts[row][:width], dtype=np.int64)
                # Shared prefix with every donor; at most all but the prompt's last token.
                same = table[:, :len(prompt)] == prompt
                shared = np.logical_and.accumulate(same, axis=1).sum(axis=1)
                shared = np.minimum(shared, len(prompts[row]) - 1)
                best = int(shared.argmax())
                length = int(shared[best])
                if length >= self.MIN_SHARED:
                    donor = donors[best]
                    found[row] = _KeptCache(donor.tokens[:length],
                                            [(k[:, :length], v[:, :length])
                                             for k, v in donor.layers], None)
        return found

    def _prefill(self, prompts: list[list[int]], reused: list[_KeptCache | None],
                 latents: torch.Tensor | None) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Prefill rows that need about the same number of new tokens: (last-position logits,
        the cache, its (rows, width) attention mask). A row's layout is [pad][kept cache][pad]
        [new tokens]: both parts left-padded, so the last position is its last prompt token."""
        device = self.model.device
        cached = [len(e.tokens) if e is not None else 0 for e in reused]
        new = [prompt[start:] for prompt, start in zip(prompts, cached)]
        batch, past, width = len(prompts), max(cached), max(len(ids) for ids in new)
        self.prefilled_tokens += sum(map(len, new))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, past + width), dtype=torch.long)
        position_ids = torch.zeros((batch, width), dtype=torch.long)
        for row, (ids, start) in enumerate(zip(new, cached)):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, past - start:past] = 1
            attention_mask[row, past + width - len(ids):] = 1
            # Positions count real tokens only; pads get 0 and are masked.
            position_ids[row, width - len(ids):] = torch.arange(start, start + len(ids))
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if past:
            layers = []
            for index, first in enumerate(next(e for e in reused if e is not None).layers):
                shape = (batch, first[0].size(0), past, first[0].size(-1))
                keys, values = first[0].new_zeros(shape), first[1].new_zeros(shape)
                for row, entry in enumerate(reused):
                    if entry is not None:
                        keys[row, :, past - cached[row]:] = entry.layers[index][0]
                        values[row, :, past - cached[row]:] = entry.layers[index][1]
                layers.append((keys, values))
            cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        else:
            cache = DynamicCache(config=self.model.config)
        if latents is None:
            inputs = {"input_ids": input_ids}
        else:
            latents = latents.to(device)
            embedding = self.model.get_input_embeddings()
            fresh = [row for row, start in enumerate(cached) if start == 0]
            if len(fresh) == batch:
                embeds = splice_embeddings(embedding, input_ids, latents, self.latent_id)
            else:
                # Rows that extend a kept cache have their latents in it already.
                embeds = embedding(input_ids)
                if fresh:
                    at = torch.tensor(fresh, device=device)
                    embeds[at] = splice_embeddings(embedding, input_ids[at], latents[at],
                                                   self.latent_id)
            inputs = {"inputs_embeds": embeds}
        out = self.model(**inputs, attention_mask=attention_mask,
                         position_ids=position_ids.to(device), use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float(), cache, attention_mask

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  latents: torch.Tensor | None,
                  sessions: Sequence[Hashable] | None) -> list[Generation]:
        device = self.model.device
        reused = self._reusable(prompts, latents, sessions)
        keeping = self.reuse_cache and sessions is not None
        batch, width = len(prompts), max(len(p) for p in prompts)
        # Prefill in groups of rows with similar numbers of new tokens (a short tool answer is not
        # padded to a new episode's whole prompt), then move every row's keys and values into one
        # decode cache, right-aligned like a left-padded batch, with room for the whole call.
        logits, layers = None, None
        capacity = width + params.max_new_tokens
        # A prompt given several times (a GRPO group's) is prefilled once; its copies take the
        # same cache rows and logits, then sample on their own.
        first: dict[tuple, int] = {}
        copies: list[tuple[int, int]] = []
        for row, (prompt, entry) in enumerate(zip(prompts, reused)):
            if entry is None and latents is None:
                key = tuple(prompt)
                if key in first:
                    copies.append((row, first[key]))
                    continue
                first[key] = row
        copied = {row for row, _ in copies}
        prefilled = [row for row in range(batch) if row not in copied]
        for group in length_groups([len(prompts[r]) - (len(reused[r].tokens) if reused[r] is not None
                                                       else 0) for r in prefilled]):
            rows = [prefilled[g] for g in group]
            group_logits, group_cache, group_mask = self._prefill(
                [prompts[r] for r in rows], [reused[r] for r in rows],
                latents[rows] if latents is not None else None)
            if logits is None:
                logits = group_logits.new_empty((batch, group_logits.size(-1)))
                layers = [_BufferedLayer(*(part.new_zeros(
                    (batch, part.size(1), capacity, part.size(-1)))
                    for part in (layer.keys, layer.values)), width)
                    for layer in group_cache.layers]
            at = torch.tensor(rows, device=device)
            logits[at] = group_logits
            # (row in group, position in group cache) of every real token, in order, and where it
            # goes in the decode cache: row r's tokens fill positions width - len(r) .. width - 1.
            local, source = group_mask.nonzero(as_tuple=True)
            rank = group_mask.cumsum(-1)[local, source] - 1
            target = width - group_mask.sum(-1)[local] + rank
            for layer, part in zip(layers, group_cache.layers):
                layer.key_buffer[at[local], :, target] = part.keys[local, :, source]
                layer.value_buffer[at[local], :, target] = part.values[local, :, source]
        if copies:
            to, source = (torch.tensor(x, device=device) for x in zip(*copies))
            logits[to] = logits[source]
            for layer in layers:
                layer.key_buffer[to] = layer.key_buffer[source]
                layer.value_buffer[to] = layer.value_buffer[source]
        del reused
        cache = DynamicCache(config=self.model.config)
        cache.layers = layers
        cache_arg = {self._cache_kwarg: cache}
        attention_mask = torch.zeros((batch, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            attention_mask[row, width - len(prompt):] = 1
        next_position = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        stop_ids = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long, device=device)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)

        def kept(i: int, row: int) -> None:
            real = attention_mask[i].bool()
            self._kept[sessions[row]] = _KeptCache(
                prompts[row] + token_ids[row][:-1],
                [(layer.keys[i][:, real], layer.values[i][:, real]) for layer in cache.layers],
                latents[row] if latents is not None else None)

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
            last = step == params.max_new_tokens - 1 or not live
            if keeping:
                going_on = set(live)
                for i, row in enumerate(rows):
                    if last or i not in going_on:
                        kept(i, row)
            if last:
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
