"""The latent composer φ = (ψ, χ): retrieved experiences in, continuous latent tokens out.

* ψ — a LoRA adapter on the frozen base. The base reads "current task ⊕ retrieved trajectory" with
  the adapter on; its last hidden layer is the encoding of that experience.
* χ — a compressor in the style of a Perceiver resampler / QFormer: K learned queries refined by one
  pre-LayerNorm block (attention + FFN) applied ``depth`` times with *shared* parameters; the
  queries attend to the concatenation of the encoder states and themselves. The result is projected
  to the base's embedding width and rescaled to the mean norm of its real token embeddings, so the
  teacher sees latents on the same scale as the tokens it was trained on.

One copy of the base weights serves both roles: the encoder runs with the adapter enabled, the
teacher (and any inference) with it disabled (:meth:`Composer.teacher`).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import OrderedDict
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lopd.chat import quote_special_tokens
from lopd.config import ComposerConfig, from_dict
from lopd.latent import ReferenceFormat, insert_reference
from lopd.models import lora_model
from lopd.policies import ModelPolicy, TurnContext
from lopd.rollout import Generation
from lopd.runtime import length_groups


class SharedBlock(nn.Module):
    """Pre-LN block: queries attend to [encoder states; queries], then a position-wise FFN."""

    def __init__(self, width: int, num_heads: int, ffn_mult: int):
        super().__init__()
        self.norm_queries = nn.LayerNorm(width)
        self.norm_states = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, num_heads, batch_first=True)
        self.norm_ffn = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_mult * width), nn.GELU(),
                                 nn.Linear(ffn_mult * width, width))

    def forward(self, queries: torch.Tensor, states: torch.Tensor,
                ignore: torch.Tensor) -> torch.Tensor:
        q = self.norm_queries(queries)
        memory = torch.cat([self.norm_states(states), q], dim=1)
        attended, _ = self.attention(q, memory, memory, key_padding_mask=ignore, need_weights=False)
        queries = queries + attended
        return queries + self.ffn(self.norm_ffn(queries))


class Compressor(nn.Module):
    """χ: K learned queries, one shared block applied ``depth`` times, projection to ``out_width``."""

    def __init__(self, width: int, out_width: int, spec: ComposerConfig):
        super().__init__()
        if width % spec.num_heads:
            raise ValueError(f"composer num_heads={spec.num_heads} must divide the encoder width {width}")
        self.depth = spec.depth
        self.queries = nn.Parameter(torch.randn(spec.num_latents, width) * 0.02)
        self.block = SharedBlock(width, spec.num_heads, spec.ffn_mult)
        self.norm_out = nn.LayerNorm(width)
        self.project = nn.Linear(width, out_width)

    def forward(self, states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, T, width) encoder states and their (N, T) mask -> (N, K, out_width)."""
        queries = self.queries.unsqueeze(0).expand(states.size(0), -1, -1)
        ignore = torch.cat([attention_mask == 0,
                            attention_mask.new_zeros(queries.shape[:2], dtype=torch.bool)], dim=1)
        for _ in range(self.depth):
            queries = self.block(queries, states, ignore)
        return self.project(self.norm_out(queries))


def experience_text(task: str, trace: str) -> str:
    """The encoder's input for one retrieved experience: the current task, then the trajectory."""
    return f"Current task: {task}\nRetrieved experience:\n{trace}"


class Composer(nn.Module):
    """φ over a frozen base model. ``base`` is wrapped in place with the LoRA adapter; use
    :meth:`teacher` for every pass that must see the plain base (θ0)."""

    ADAPTER = "default"
    ANCHOR = "anchor"
    ADAPTER_FILE = "adapter.safetensors"
    COMPRESSOR_FILE = "compressor.safetensors"
    CONFIG_FILE = "composer.json"

    def __init__(self, base, tokenizer, spec: ComposerConfig | None = None):
        super().__init__()
        from peft import LoraConfig

        self.spec = spec or ComposerConfig()
        self.tokenizer = tokenizer
        for p in base.parameters():
            p.requires_grad_(False)
        lora = LoraConfig(r=self.spec.lora_r, lora_alpha=self.spec.lora_alpha,
                          lora_dropout=self.spec.lora_dropout,
                          target_modules=list(self.spec.lora_targets))
        self.encoder = lora_model(base, lora)
        # φ trains: the LoRA matrices and the compressor are float32 even on a bfloat16 base
        # (bf16-mixed precision runs them under autocast; their weights and Adam state stay fp32).
        for p in self.encoder.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        width = base.config.hidden_size
        embed_width = base.get_input_embeddings().weight.size(1)
        self.compressor = Compressor(width, embed_width, self.spec).to(device=base.device,
                                                                        dtype=torch.float32)
        with torch.no_grad():
            norm = base.get_input_embeddings().weight.float().norm(dim=-1).mean()
        self.register_buffer("target_norm", norm)
        self.anchor_compressor: Compressor | None = None
        self._anchor_cache: OrderedDict | None = None
        self._anchor_cache_entries = 0

    # -- the two views of the one base --------------------------------------------------------

    @property
    def base(self):
        """The base model (LoRA layers injected; active only inside :meth:`encode`)."""
        return self.encoder.get_base_model()

    @contextlib.contextmanager
    def teacher(self):
        """Within this context the base runs with the adapter off: exactly the frozen θ0.

        peft marks the adapter as not requiring gradients while it is disabled, so call
        ``backward`` *after* leaving the context (or use :meth:`teacher_forward`), else the
        adapter's gradients are silently dropped.
        """
        with self.encoder.disable_adapter():
            yield self.base

    def teacher_forward(self, **model_inputs):
        """One forward pass of the frozen base θ0 (adapter off); safe to backpropagate through."""
        with self.teacher() as teacher:
            return teacher(**model_inputs)

    # -- composing latents ---------------------------------------------------------------------

    def encode(self, tasks: list[str], experiences: list[list[str]],
               anchor: bool = False) -> torch.Tensor:
        """Latents for each task from its retrieved experience traces: (B, n·K, d).

        Every task needs the same number n of experiences; their latents are concatenated in order.
        ``anchor=True`` composes with the frozen copy φ0 made by :meth:`freeze_anchor` instead.
        """
        if anchor:
            if self.anchor_compressor is None:
                raise RuntimeError("no anchor composer: call freeze_anchor() first")
            with self._adapter(self.ANCHOR):
                return self._encode(tasks, experiences, self.anchor_compressor,
                                    self._anchor_cache)
        return self._encode(tasks, experiences, self.compressor)

    def _encode(self, tasks: list[str], experiences: list[list[str]], compressor: Compressor,
                cache: OrderedDict | None = None) -> torch.Tensor:
        counts = {len(e) for e in experiences}
        if len(counts) != 1 or len(tasks) != len(experiences):
            raise ValueError(f"each of the {len(tasks)} tasks needs the same number of experiences; "
                             f"got {[len(e) for e in experiences]}")
        (n,) = counts
        texts = [experience_text(t, trace) for t, traces in zip(tasks, experiences) for trace in traces]
        # Each distinct encoder input is encoded once (a task met twice in a batch, the same
        # experience retrieved for it), and inputs of similar length together: every input is
        # encoded on its own (right padding, causal encoder, masked compressor), so neither the
        # grouping nor the padding changes its latents.
        unique = list(dict.fromkeys(texts))
        latents: list[torch.Tensor | None] = [None] * len(unique)
        if cache is not None:
            for i, text in enumerate(unique):
                if text in cache:
                    cache.move_to_end(text)
                    latents[i] = cache[text]
        missing = [i for i, z in enumerate(latents) if z is None]
        if missing:
            # Traces quote tool output and the model's own text: plain text to the encoder too.
            ids = self.tokenizer([quote_special_tokens(unique[i], self.tokenizer) for i in missing],
                                 truncation=True,
                                 max_length=self.spec.max_experience_tokens)["input_ids"]
            for group in length_groups([len(x) for x in ids]):
                batch = self.tokenizer.pad({"input_ids": [ids[g] for g in group]},
                                           padding="longest", padding_side="right",
                                           return_tensors="pt").to(self.base.device)
                # The decoder stack alone: the encoding is the last hidden layer, no vocabulary
                # logits.
                states = self.base.get_decoder()(**batch).last_hidden_state
                z = compressor(states.to(compressor.queries.dtype), batch["attention_mask"])
                z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-6) * self.target_norm
                for row, g in enumerate(group):
                    latents[missing[g]] = z[row]
            if cache is not None:
                for i in missing:
                    cache[unique[i]] = latents[i].detach()
                while len(cache) > self._anchor_cache_entries:
                    cache.popitem(last=False)
        index = {text: i for i, text in enumerate(unique)}
        z = torch.stack(latents)[torch.tensor([index[t] for t in texts], device=latents[0].device)]
        return z.reshape(len(tasks), n * self.spec.num_latents, z.size(-1))

    # -- the anchor φ0 ----------------------------------------------------------------------

    def freeze_anchor(self, cache_mb: float = 0.0) -> None:
        """Keep a frozen copy of the current φ as φ0 (a second LoRA adapter beside ψ on the same
        base, and a copy of the compressor), so the anchor term can compare Z_φ with Z_φ0 without
        a second copy of the base.

        φ0 never changes, so with ``cache_mb`` > 0 its latents are kept (up to that many MiB, the
        least recently used dropped first) and an encoder input met again is not re-encoded;
        not with LoRA dropout, which makes every encoding a different sample."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        if self.anchor_compressor is not None:
            raise RuntimeError("the anchor is already frozen")
        self.encoder.add_adapter(self.ANCHOR, self.encoder.peft_config[self.ADAPTER])
        set_peft_model_state_dict(self.encoder, get_peft_model_state_dict(self.encoder),
                                  adapter_name=self.ANCHOR)
        self.encoder.set_adapter(self.ADAPTER)
        self.anchor_compressor = copy.deepcopy(self.compressor).requires_grad_(False)
        self._freeze_anchor_adapter()
        entry_mb = self.spec.num_latents * self.compressor.project.out_features * \
            self.compressor.queries.element_size() / 2**20
        self._anchor_cache_entries = int(cache_mb / entry_mb)
        self._anchor_cache = OrderedDict() if self._anchor_cache_entries > 0 \
            and self.spec.lora_dropout == 0 else None

    def _freeze_anchor_adapter(self) -> None:
        for name, p in self.encoder.named_parameters():
            if f".{self.ANCHOR}." in name:
                p.requires_grad_(False)

    @contextlib.contextmanager
    def _adapter(self, name: str):
        """Encode with adapter ``name`` active; ψ is active again (and φ0 frozen) afterwards."""
        self.encoder.set_adapter(name)
        try:
            yield
        finally:
            self.encoder.set_adapter(self.ADAPTER)
            self._freeze_anchor_adapter()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """ψ and χ: the LoRA matrices and the compressor; the base stays frozen."""
        return [p for p in self.parameters() if p.requires_grad]

    # -- persistence ---------------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        from peft import get_peft_model_state_dict

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        adapter = {k: v.detach().cpu().contiguous()
                   for k, v in get_peft_model_state_dict(self.encoder).items()}
        save_file(adapter, folder / self.ADAPTER_FILE)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.compressor.state_dict().items()},
                  folder / self.COMPRESSOR_FILE)
        (folder / self.CONFIG_FILE).write_text(json.dumps(
            {"spec": asdict(self.spec), "target_norm": float(self.target_norm),
             "base_hidden_size": self.base.config.hidden_size}, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path, base, tokenizer) -> Composer:
        folder = Path(folder)
        config_path = folder / cls.CONFIG_FILE
        if not config_path.exists():
            raise FileNotFoundError(f"{folder} is not a composer folder (no {cls.CONFIG_FILE})")
        config = json.loads(config_path.read_text())
        if config["base_hidden_size"] != base.config.hidden_size:
            raise ValueError(f"composer in {folder} was built for a base of hidden size "
                             f"{config['base_hidden_size']}, this base has {base.config.hidden_size}")
        composer = cls(base, tokenizer, from_dict(ComposerConfig, config["spec"]))
        composer.load_weights(folder)
        return composer

    def load_weights(self, folder: str | Path) -> None:
        """Load φ (adapter ψ and compressor χ) saved by :meth:`save` into this composer."""
        from peft import set_peft_model_state_dict

        folder = Path(folder)
        config = json.loads((folder / self.CONFIG_FILE).read_text())
        if from_dict(ComposerConfig, config["spec"]) != self.spec:
            raise ValueError(f"composer in {folder} has a different architecture than this one")
        device = str(self.target_norm.device)
        result = set_peft_model_state_dict(self.encoder, load_file(folder / self.ADAPTER_FILE,
                                                                   device=device))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"adapter in {folder} does not fit this base: {result.unexpected_keys[:3]}")
        self.compressor.load_state_dict(load_file(folder / self.COMPRESSOR_FILE, device=device))
        self.target_norm.fill_(config["target_norm"])


class ComposerPolicy(ModelPolicy):
    """The "Base + Composer" agent: the base acts with latents of retrieved experiences in view.

    For each task the composer encodes the ``n_ret`` nearest bank entries once; at every turn the
    reference block is inserted into the prompt and the latents are spliced in at prefill. The
    rollout keeps the plain conversation (no block), like any other policy's.
    """

    def __init__(self, engine, composer: Composer, bank, params, n_ret: int):
        """``engine``: a rollout engine over ``composer.base`` (:func:`lopd.stages.make_engine`)."""
        super().__init__(engine, composer.tokenizer, params)
        self.composer, self.bank, self.n_ret = composer, bank, n_ret
        self.fmt = ReferenceFormat.for_tokenizer(composer.tokenizer)
        self.block = self.fmt.latent_block(n_ret * composer.spec.num_latents)
        if self.max_length is not None:
            self.max_length -= len(self.block)
        self._latents: dict[str, torch.Tensor] = {}

    def _latents_for(self, tasks) -> torch.Tensor:
        missing = [t for t in tasks if t.task_id not in self._latents]
        if missing:
            hits = self.bank.search([t.instruction for t in missing], self.n_ret,
                                    exclude_task_ids=[t.task_id for t in missing])
            with torch.no_grad():
                z = self.composer.encode([t.instruction for t in missing],
                                         [[h.entry.trace for h in found] for found in hits])
            self._latents.update({t.task_id: row for t, row in zip(missing, z)})
        return torch.stack([self._latents[t.task_id] for t in tasks])

    def act(self, contexts: list[TurnContext], max_new_tokens: int, tokenizer) -> list[Generation]:
        latents = self._latents_for([c.task for c in contexts])
        prompts = [insert_reference(c.prompt_ids, self.block, self.fmt)[0] for c in contexts]
        seed = self._seeds.getrandbits(63) if self._seeds is not None else None
        params = replace(self.params, max_new_tokens=max_new_tokens, seed=seed)
        with self.composer.teacher():      # the base acts as itself: adapter off
            return self.engine.generate(prompts, params, latents=latents,
                                        sessions=[c.session for c in contexts])
