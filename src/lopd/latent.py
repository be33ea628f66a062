"""Latent injection: a span of sentinel tokens in the teacher's prompt, replaced by latent vectors.

The teacher reads the student's own trajectory with one addition: inside the first user message, a
reference block "from a similar task" whose body is ``n_ret * K`` copies of ``<|latent|>``. Before the
first transformer layer the embedding rows at those positions are overwritten by the composer's
latents ``Z`` (``inputs_embeds`` in transformers, ``prompt_embeds`` in vLLM). Nothing else changes:
every other token, position and mask is the student's, so teacher and student score the same actions.

The reference block is inserted at the token level (right after the user header), not by
re-rendering text, so the student's token ids are kept exactly and the same insertion serves latents
(sentinels) and plain-text references (the "raw trace as text" ablation) alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopd.models import IM_START, LATENT_TOKEN

REFERENCE_PREFIX = "Reference from a similar task (context, not an instruction):\n"
REFERENCE_SUFFIX = "\n\n"


@dataclass(frozen=True)
class ReferenceFormat:
    """Token ids of the pieces of a reference block, for one tokenizer."""

    header: tuple[int, ...]
    """The first user message's header (``<|im_start|>user\\n``): the block goes right after it."""
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    latent_id: int

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ReferenceFormat:
        latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
        if latent_id is None or latent_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {LATENT_TOKEN} token; add it as a special token "
                             "(tokenizers built by lopd have it)")

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(header=encode(f"{IM_START}user\n"), prefix=encode(REFERENCE_PREFIX),
                   suffix=encode(REFERENCE_SUFFIX), latent_id=latent_id)

    def latent_block(self, n_latents: int) -> list[int]:
        return [*self.prefix, *([self.latent_id] * n_latents), *self.suffix]

    def text_block(self, tokenizer, texts: Sequence[str]) -> list[int]:
        """A reference block that carries retrieved traces as plain text instead of latents."""
        body = tokenizer.encode("\n".join(texts), add_special_tokens=False)
        return [*self.prefix, *body, *self.suffix]


def find_subsequence(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Index of the first occurrence of ``sub`` in ``seq``, or -1."""
    n = len(sub)
    first = sub[0]
    for i in range(len(seq) - n + 1):
        if seq[i] == first and tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1


def insert_reference(input_ids: Sequence[int], block: Sequence[int],
                     fmt: ReferenceFormat) -> tuple[list[int], int]:
    """``input_ids`` with ``block`` inserted at the start of the first user message.

    Returns the new ids and the insertion index; every token at or after that index moves right by
    ``len(block)`` (shift masks and log-prob arrays the same way with :func:`shift_after`).
    """
    at = find_subsequence(input_ids, fmt.header)
    if at < 0:
        raise ValueError("no user message header found in the sequence; cannot place the reference")
    at += len(fmt.header)
    return [*input_ids[:at], *block, *input_ids[at:]], at


def shift_after(values: Sequence, at: int, length: int, fill) -> list:
    """``values`` with ``length`` copies of ``fill`` inserted at index ``at``."""
    return [*values[:at], *([fill] * length), *values[at:]]


def splice_embeddings(embedding: torch.nn.Module, input_ids: torch.Tensor, latents: torch.Tensor,
                      latent_id: int) -> torch.Tensor:
    """Token embeddings of ``input_ids`` (B, T) with sentinel rows replaced by ``latents`` (B, n, d).

    Every row must hold exactly ``n`` sentinels; they are filled in order. Gradients flow into
    ``latents``; padding (left or right) does not matter, since only sentinel positions change.
    """
    embeds = embedding(input_ids)
    is_latent = input_ids == latent_id
    counts = is_latent.sum(dim=1)
    if latents.dim() != 3 or latents.size(0) != input_ids.size(0):
        raise ValueError(f"latents must be (batch={input_ids.size(0)}, n, d), got {tuple(latents.shape)}")
    if not bool((counts == latents.size(1)).all()):
        raise ValueError(f"every row needs exactly {latents.size(1)} {LATENT_TOKEN} tokens; "
                         f"rows have {counts.tolist()}")
    if latents.size(-1) != embeds.size(-1):
        raise ValueError(f"latent width {latents.size(-1)} != embedding width {embeds.size(-1)}")
    # Boolean-mask assignment fills positions in row-major order, i.e. row by row, left to right.
    return embeds.masked_scatter(is_latent.unsqueeze(-1), latents.to(embeds.dtype))
