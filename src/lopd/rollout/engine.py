"""The rollout-engine interface: token ids in, sampled token ids and their log-probs out.

Engines see token ids only, never text or chat messages: the agent loop owns the chat format and
the token bookkeeping, so every engine produces sequences that line up exactly with what the
trainer scores. A vLLM engine implements the same :meth:`RolloutEngine.generate` with
``TokensPrompt`` inputs; its prefix cache reuses the shared conversation prefix across the turns of
an episode. The transformers engine keeps each episode's KV cache between turns instead (the loop
names the episode of every prompt: ``sessions``), so a turn prefills only its new tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from lopd.config import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Names follow vLLM / TRL."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest most likely tokens whose mass reaches ``top_p`` (1 = off)."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (0 = off)."""
    max_new_tokens: int = 96
    """Most tokens generated for one prompt (the stop token included)."""
    seed: int | None = None
    """Seed of the sampler; the same seed, prompts and model give the same samples. None draws
    from torch's global random state."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, temperature: float, seed: int | None = None) -> SamplingParams:
        """A config's ``rollout`` section (top-p, top-k, max completion length) at ``temperature``."""
        return cls(temperature=temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                   max_new_tokens=rollout_cfg.max_completion_length, seed=seed)


@dataclass
class Generation:
    """What the engine generated for one prompt."""

    token_ids: list[int]
    """The generated tokens, the stop token included when one was produced."""
    logprobs: list[float]
    """One per generated token: log-softmax of ``logits / temperature`` (temperature 1 when
    greedy) at the chosen token, i.e. under the sampling temperature but *before* top-k / top-p
    truncation. This is the sampling policy's log-prob that importance ratios (PPO-clip) and
    on-policy distillation compare against; with truncation on, the truncated policy's log-prob
    would be this value minus the log of the kept mass."""
    finished: bool
    """True when a stop token ended the generation; False when it ran into ``max_new_tokens``."""


def check_prompts(prompts: list[list[int]]) -> None:
    """The prompt contract of :meth:`RolloutEngine.generate`: every prompt holds a token."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class RolloutEngine(ABC):
    """Generates continuations of token-id prompts, batched."""

    stop_token_ids: frozenset[int]
    """Generation of a prompt ends at the first of these tokens."""
    max_length: int | None
    """Longest sequence (prompt + generated tokens) the model supports; None when unbounded."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 latents: torch.Tensor | None = None,
                 sessions: Sequence[Hashable] | None = None) -> list[Generation]:
        """One :class:`Generation` per prompt, in the order of ``prompts``.

        ``latents`` (batch, n, d), when given, replace the embeddings of the ``n`` ``<|latent|>``
        tokens each prompt holds (see :mod:`lopd.latent`); vLLM passes the spliced embeddings as
        ``prompt_embeds``.

        ``sessions``, when given, names the conversation each prompt belongs to (an episode): an
        engine may keep a session's state until its next prompt, which extends this prompt and
        its generation (the transformers engine keeps the KV cache; vLLM's prefix cache finds the
        shared prefix by itself). The results are the same with or without."""

    def release(self) -> None:
        """Drop whatever the engine keeps between calls for ``sessions`` (their KV caches); the
        agent loop calls it when its episodes are over."""

    def sync_weights(self, model) -> None:
        """Generate from ``model``'s current weights from now on. Engines that generate from the
        model object itself (transformers) need nothing; engines holding their own copy of the
        weights (vLLM) reload them. Call after every update of the model."""

    def sleep(self) -> None:
        """Release the memory the engine holds for generation while the model is updated; the
        next :meth:`sync_weights` or :meth:`generate` takes it back. Engines that hold nothing of
        their own (transformers) need nothing."""

    def close(self) -> None:
        """Free everything the engine holds of its own (vLLM: its copy of the weights, its KV
        cache); the engine is not used again. Engines that hold nothing of their own
        (transformers) need nothing."""


def check_sampling(rollout_cfg) -> None:
    """Refuse training rollouts that the training forward would not score as sampled.

    The student's loss scores each action token with log-softmax of its plain logits; a rollout
    sampled at another temperature or from a truncated (top-p / top-k) distribution comes from
    another policy, and its ratios and distillation targets would be off-policy without saying so
    (DESIGN §3b). Rather than rescale and truncate in the training forward, such settings are
    refused at start-up; evaluation episodes keep their own ``rollout.eval_temperature``.
    """
    offending = [f"rollout.{key}={getattr(rollout_cfg, key)}"
                 for key, bad in (("temperature", rollout_cfg.temperature != 1.0),
                                  ("top_p", rollout_cfg.top_p < 1.0),
                                  ("top_k", rollout_cfg.top_k > 0)) if bad]
    if offending:
        verb = "is" if len(offending) == 1 else "are"
        raise ConfigError("training rollouts must sample what the training forward scores "
                          f"(temperature 1, no truncation): {', '.join(offending)} {verb} "
                          "refused; evaluation keeps rollout.eval_temperature")
