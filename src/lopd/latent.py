"""Latent injection: a span of sentinel tokens in the teacher's prompt, replaced by latent vectors.

The teacher reads the student's own trajectory with one addition: inside the first user message, a
reference block "from a similar task" whose body is ``n_ret * K`` copies of ``<|latent|>``. Before the
first transformer layer the embedding rows at those positions are overwritten by the composer's
latents ``Z`` (``inputs_embeds`` in transformers, ``prompt_embeds`` in vLLM). Nothing else changes:
every other token, position and mask is the student's, so teacher and student score the same actions.

The reference block is inserted at the token level (right after the user header), not by
re-rendering text, so the student's token ids are kept exactly and the same insertion serves latents
(sentinels) and plain-text references (the "raw trace as text" ablation) alike. The user header is
not written down for one chat format: :func:`user_header` reads it off the tokenizer's own template
(ChatML, Llama 3, Tulu/OLMo, ...).

Privileged *text* (a retrieved trace, an oracle demonstration) goes into the teacher's prompt the
same way, by a :class:`TextPlacement`: as a reference block after the user header, or at the end
of the system message, right before the tokens that close it (:func:`system_close`, read off the
template like the header). Either way the student's tokens are kept and only shifted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lopd.chat import LATENT_TOKEN, PROBE_TOOLS, quote_special_tokens, render

REFERENCE_PREFIX = "Reference from a similar task (context, not an instruction):\n"
REFERENCE_SUFFIX = "\n\n"

# Probe conversations for :func:`user_header`. The user contents start with different kinds of
# character (upper and lower case, digit, brackets, quote, non-ASCII), so a BPE merge of the
# header's last characters with the content's first shows up as a difference between their ids; the
# system messages differ in length, ending and inner line breaks, so what is common to all of them
# after the system text is the user message's opening alone.
_PROBE_USERS = ("Cancel order O1.", "cancel it", "42 items", "[urgent] hold S1", '{"order": 1}',
                "(x) y", '"quoted" z', "Über alles")
_PROBE_SYSTEMS = ("You are an agent.",
                  "You are an agent that uses tools.\n\nCall one tool per turn.\nThen answer")


def _common_prefix(seqs: Sequence[Sequence[int]]) -> list[int]:
    first = seqs[0]
    n = min(map(len, seqs))
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return list(first[:i])
    return list(first[:n])


def user_header(tokenizer) -> tuple[int, ...]:
    """The token ids that open the first user message in ``tokenizer``'s chat template, exactly as
    they occur in the agent loop's rollouts (``<|im_start|>user\\n`` in ChatML).

    Derived, not assumed: the conversation [system, user] is rendered to ids through
    :func:`lopd.chat.render` (the agent's path) for several system and user texts. The tokens
    every user text shares are the ones before its content — a header token that merges with the
    content's first characters differs between them and is left out, so the header never depends on
    what the user wrote. The header is the shortest run of those tokens that is the same after
    every system text, occurs nowhere earlier, and starts at a template token (an added token,
    else the start of a line). It is then checked on the rendering with tools.
    """
    def user_turn(system: str, user: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    text = render(tokenizer, user_turn(_PROBE_SYSTEMS[0], _PROBE_USERS[0]), tokenize=False)
    if _PROBE_USERS[0] not in text:
        raise ValueError("the chat template does not render a user message's content (no user "
                         "role?); cannot place the reference block in the first user message")
    # Every environment opens with a system message, so the header is derived after one.
    heads = [_common_prefix([render(tokenizer, user_turn(system, user)) for user in _PROBE_USERS])
             for system in _PROBE_SYSTEMS]
    added = set(tokenizer.added_tokens_decoder)

    def line_start(head: list[int], n: int) -> bool:
        if n == len(head):
            return True
        before = head[-n - 1]
        return before in added or tokenizer.decode([before]).endswith("\n")

    shortest = min(map(len, heads))
    candidates = []
    for n in range(1, shortest + 1):
        header = heads[0][-n:]
        if any(h[-n:] != header for h in heads):
            break  # longer runs reach into the system text
        if all(find_subsequence(h, header) == len(h) - n for h in heads):
            candidates.append(tuple(header))
    header = next((h for h in candidates if h[0] in added), None)
    if header is None:
        header = next((h for h in candidates if all(line_start(head, len(h)) for head in heads)),
                      None)
    if header is None:
        raise ValueError("cannot find the tokens that open the first user message in the chat "
                         "template's rendering; cannot place the reference block")
    with_tools = render(tokenizer, user_turn(_PROBE_SYSTEMS[0], _PROBE_USERS[0]), PROBE_TOOLS)
    at = find_subsequence(with_tools, header)
    if at < 0 or _PROBE_USERS[0] in tokenizer.decode(with_tools[:at + len(header)]):
        raise ValueError(f"the user header {tokenizer.decode(header)!r} does not open the first "
                         "user message when the chat template renders tools")
    return header


@dataclass(frozen=True)
class ReferenceFormat:
    """Token ids of the pieces of a reference block, for one tokenizer."""

    header: tuple[int, ...]
    """The tokens that open the first user message (:func:`user_header`; ``<|im_start|>user\\n``
    in ChatML): the block goes right after them."""
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    latent_id: int

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ReferenceFormat:
        latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
        if latent_id is None or latent_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {LATENT_TOKEN} token; add it with `lopd model "
                             "prepare SRC --out DIR` (tokenizers built by lopd have it)")

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(header=user_header(tokenizer), prefix=encode(REFERENCE_PREFIX),
                   suffix=encode(REFERENCE_SUFFIX), latent_id=latent_id)

    def insertion_point(self, input_ids: Sequence[int]) -> int:
        """Where the block goes: right after the first user header."""
        return _after_header(input_ids, self.header)

    def latent_block(self, n_latents: int) -> list[int]:
        return [*self.prefix, *([self.latent_id] * n_latents), *self.suffix]

    def text_block(self, tokenizer, texts: Sequence[str]) -> list[int]:
        """A reference block that carries retrieved traces as plain text instead of latents."""
        return [*self.prefix, *_text_ids(tokenizer, texts), *self.suffix]


def system_close(tokenizer, header: Sequence[int]) -> tuple[int, ...]:
    """The tokens that close the first system message, right before the first user ``header``
    (``<|im_end|>\\n`` in ChatML; possibly none): privileged text placed in the system message
    goes just before them, after the system text and any tool list the template writes there.

    Derived like :func:`user_header`: [system, user] is rendered for system texts that end in
    different characters, with and without tools; the tokens all renderings share right before
    the header are the template's own. A template that writes no system text before the first user
    message (one that folds it into the user turn) cannot take system-message context.
    """
    systems = (*_PROBE_SYSTEMS, "Answer with 42", "Be brief (always)")
    segments = []
    for system in systems:
        for tools in (None, PROBE_TOOLS):
            ids = render(tokenizer, [{"role": "system", "content": system},
                                     {"role": "user", "content": _PROBE_USERS[0]}], tools)
            at = find_subsequence(ids, header)
            if at < 0 or system not in tokenizer.decode(ids[:at]):
                raise ValueError("the chat template writes no system message before the first "
                                 "user message; place the privileged text in the user message")
            segments.append(ids[:at])
    n = 0
    while all(len(seg) > n for seg in segments) and len({seg[-1 - n] for seg in segments}) == 1:
        n += 1
    close = tuple(segments[0][len(segments[0]) - n:])
    if any(system not in tokenizer.decode(seg[:len(seg) - n]) for system, seg in
           zip((s for s in systems for _ in range(2)), segments)):
        raise ValueError("cannot find where the chat template's system message ends")
    return close


PLACEMENTS = ("user", "system")


@dataclass(frozen=True)
class TextPlacement:
    """Where a teacher's privileged text goes in the student's sequence, and its framing.

    ``where="user"``: a block right after the first user header (where LOPD's latents go);
    ``where="system"``: at the end of the system message, before the tokens that close it. The
    block is ``prefix ⊕ text ⊕ suffix``; nothing else in the sequence changes.
    """

    where: str
    header: tuple[int, ...]
    close: tuple[int, ...]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer, where: str, prefix: str, suffix: str = "") -> TextPlacement:
        if where not in PLACEMENTS:
            raise ValueError(f"unknown placement {where!r}; choose from {', '.join(PLACEMENTS)}")
        header = user_header(tokenizer)
        close = system_close(tokenizer, header) if where == "system" else ()

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

        return cls(where, header, close, encode(prefix), encode(suffix))

    def insertion_point(self, input_ids: Sequence[int]) -> int:
        at = _after_header(input_ids, self.header)
        if self.where == "user":
            return at
        at -= len(self.header) + len(self.close)
        if tuple(input_ids[at:at + len(self.close)]) != self.close:
            raise ValueError("the sequence's system message does not end as the chat template's "
                             "does; cannot place the privileged text")
        return at

    def text_block(self, tokenizer, texts: Sequence[str]) -> list[int]:
        """The block carrying ``texts`` (joined by line breaks) with this placement's framing."""
        return [*self.prefix, *_text_ids(tokenizer, texts), *self.suffix]


def _text_ids(tokenizer, texts: Sequence[str]) -> tuple[int, ...]:
    """``texts`` joined by line breaks, as plain text: traces quote tool output and the model's
    own text (a turn's decoded special tokens among it), which must not become a chat turn or a
    latent slot in the teacher's sequence (:func:`lopd.chat.quote_special_tokens`)."""
    return tuple(tokenizer.encode(quote_special_tokens("\n".join(texts), tokenizer),
                                  add_special_tokens=False))


def _after_header(input_ids: Sequence[int], header: Sequence[int]) -> int:
    at = find_subsequence(input_ids, header)
    if at < 0:
        raise ValueError("no user message header found in the sequence; cannot place the reference")
    return at + len(header)


def find_subsequence(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Index of the first occurrence of ``sub`` in ``seq``, or -1."""
    n = len(sub)
    first = sub[0]
    for i in range(len(seq) - n + 1):
        if seq[i] == first and tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1


def insert_reference(input_ids: Sequence[int], block: Sequence[int],
                     fmt: ReferenceFormat | TextPlacement) -> tuple[list[int], int]:
    """``input_ids`` with ``block`` inserted where ``fmt`` says: the start of the first user
    message (a :class:`ReferenceFormat`, a ``"user"`` placement) or the end of the system message.

    Returns the new ids and the insertion index; every token at or after that index moves right by
    ``len(block)`` (shift masks and log-prob arrays the same way with :func:`shift_after`).
    """
    at = fmt.insertion_point(input_ids)
    return [*input_ids[:at], *block, *input_ids[at:]], at


def shift_after(values: Sequence, at: int, length: int, fill) -> list:
    """``values`` with ``length`` copies of ``fill`` inserted at index ``at``."""
    return [*values[:at], *([fill] * length), *values[at:]]


def splice_embeddings(embedding: torch.nn.Module, input_ids: torch.Tensor, latents: torch.Tensor,
                      latent_id: int) -> torch.Tensor:
    """Token embeddings of ``input_ids`` (B, T) with sentinel rows replaced by ``latents`` (B, n, d).

    Every row must hold at least ``n`` sentinels; its first ``n`` (the reference block, which comes
    before every generated token) are filled in order. A later one is a token the model itself
    sampled (a small model can emit the sentinel's id at temperature 1) and keeps its embedding, as
    in the student's forward. Gradients flow into ``latents``; padding (left or right) does not
    matter, since only sentinel positions change.
    """
    embeds = embedding(input_ids)
    if latents.dim() != 3 or latents.size(0) != input_ids.size(0):
        raise ValueError(f"latents must be (batch={input_ids.size(0)}, n, d), got {tuple(latents.shape)}")
    sentinel = input_ids == latent_id
    is_latent = sentinel & (sentinel.cumsum(dim=1) <= latents.size(1))
    counts = is_latent.sum(dim=1)
    if not bool((counts == latents.size(1)).all()):
        raise ValueError(f"every row needs {latents.size(1)} {LATENT_TOKEN} tokens (its reference "
                         f"block); rows have {sentinel.sum(dim=1).tolist()}")
    if latents.size(-1) != embeds.size(-1):
        raise ValueError(f"latent width {latents.size(-1)} != embedding width {embeds.size(-1)}")
    # Boolean-mask assignment fills positions in row-major order, i.e. row by row, left to right.
    return embeds.masked_scatter(is_latent.unsqueeze(-1), latents.to(embeds.dtype))
