"""Models and tokenizers: load any Hugging Face causal LM and prepare it for lopd, or build the
tiny default.

Preparing (``lopd model prepare``) is what lets an external checkpoint (Qwen3, Llama 3, OLMo) run:
the ``<|latent|>`` sentinel is added with a mean-initialised embedding row, and generation stops at
the chat template's own end-of-turn token. What lopd needs from a chat template is read off the
template itself (:func:`render`, :func:`turn_end_token`, :func:`lopd.latent.user_header`), never
assumed to be ChatML.

The tiny default is what makes the project run end to end on a 2-core CPU: a byte-level BPE
tokenizer trained on the caller's corpus (environment transcripts) and a Qwen3-architecture model of
about one million parameters, random-initialised from a seed. It is an ordinary transformers model,
so every code path that works on it works on Qwen3-4B as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lopd.chat import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    LATENT_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    turn_end_token,
)

# Where `lopd base` ships the embedded default model inside the package.
ASSETS = Path(__file__).parent / "assets"
EMBEDDED = {name: ASSETS / name for name in ("toolworld-1m", "toolworld-1m-plain", "codeworld-1m")}
EMBEDDED_DIR = EMBEDDED["toolworld-1m"]
"""Models shipped in the package: the toolworld base of the default (coded) setting, the first-stage
toolworld base it was trained from (plain requests only), and the codeworld base (each with a
tokenizer trained on its own domain; docs/results/base-models.md)."""


@dataclasses.dataclass(frozen=True)
class ArchPreset:
    """Shape of a newly built Qwen3 model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


ARCH_PRESETS = {
    "qwen3-1m": ArchPreset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=512),
    "qwen3-4m": ArchPreset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=768),
}


# ----------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it as a transformers tokenizer.

    The special tokens the design needs are reserved first (ids 0..5), the chat template is
    installed, and padding is on the left as batched generation wants.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = list(corpus)
    if not texts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, LATENT_TOKEN, TOOL_CALL_START, TOOL_CALL_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load a tokenizer with left padding and a pad token (batched generation needs both)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Model


def build_model(tokenizer, preset: str = "qwen3-1m", seed: int = 0,
                max_position_embeddings: int = 2048) -> Qwen3ForCausalLM:
    """A random-initialised Qwen3 causal LM sized by ``preset``; the same seed gives the same weights."""
    if preset not in ARCH_PRESETS:
        raise ValueError(f"unknown architecture {preset!r}; presets: {', '.join(ARCH_PRESETS)}")
    arch = ARCH_PRESETS[preset]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    # Initialise under a private generator state so that building a model never shifts the
    # caller's random stream, and the weights depend on `seed` alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def resolve_model_path(name_or_path: str | Path) -> str:
    """The local folder of an embedded model ('toolworld-1m', 'toolworld-1m-plain',
    'codeworld-1m') or of a model folder, which must hold a config.

    Anything else is refused here in one line, never passed on to transformers as a hub id: lopd
    downloads nothing, and a mistyped path would otherwise end in a page of hub errors."""
    name = str(name_or_path)
    if name in EMBEDDED:
        if not (EMBEDDED[name] / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded model {name!r} is not in this install ({EMBEDDED[name]}); "
                "build one with `lopd base --out DIR` and pass that folder instead")
        return str(EMBEDDED[name])
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"model {name}: no such folder, and not an embedded model "
                                f"(embedded: {', '.join(EMBEDDED)})")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    return str(path)


def hidden_size_of(name_or_path: str | Path) -> int | None:
    """The hidden size a model folder's config.json declares (its text model's, for a model with
    several), None where it declares none; read without loading the model."""
    config = json.loads((Path(resolve_model_path(name_or_path)) / "config.json").read_text())
    return config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")


@contextlib.contextmanager
def quiet_progress():
    """transformers' progress bars ("Loading weights", "Writing model shards") off for the loads
    and saves inside, then as they were.

    lopd loads and saves its models many times in a run (the student, the frozen base, the
    embedder, every evaluation and checkpoint); a bar at each would bury lopd's own stages."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def lora_model(model, lora_config):
    """``peft.get_peft_model(model, lora_config)`` without peft's FutureWarning: peft (0.21) reads
    the model's ``is_gradient_checkpointing``, which transformers 5.2x deprecated for
    ``is_activation_checkpointing``; the value it reads is the same."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        return get_peft_model(model, lora_config)


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in backward instead of keeping them (non-reentrant).
    transformers 5.2x renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name warns); the older releases lopd supports
    have only the old name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(name_or_path: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """Load a causal LM and its tokenizer from a local folder or an embedded model name."""
    path = resolve_model_path(name_or_path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_model(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model) -> int:
    """Unique parameters (tied input/output embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Any tokenizer's chat template, and the latent token on any model


def add_latent_token(model, tokenizer) -> bool:
    """Give ``tokenizer`` the ``<|latent|>`` sentinel (a special token, never split) and ``model``
    an embedding row for it, when the tokenizer lacks it; True when it was added.

    The embeddings are resized only when the matrix has no spare row for the new id (Qwen's
    matrices are padded past the vocabulary). The new row — input embedding and, when untied, the
    output head — is the mean of the rows of the tokens the tokenizer already had: the teacher
    never reads the sentinel itself (latents replace it), and the mean keeps the head's logit for
    it unremarkable instead of random.
    """
    if LATENT_TOKEN in tokenizer.get_vocab():
        return False
    known = len(tokenizer)
    tokenizer.add_special_tokens({"extra_special_tokens": [LATENT_TOKEN]},
                                 replace_extra_special_tokens=False)
    latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
    if model.get_input_embeddings().num_embeddings <= latent_id:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for tensor in _token_row_tensors(model):
            tensor[latent_id] = tensor[:known].float().mean(0).to(tensor.dtype)
    return True


def _token_row_tensors(model) -> list[torch.Tensor]:
    """The tensors with one row per token: the input embedding, and the output head's weight (and
    bias) when they are not the input embedding itself (tied)."""
    tensors = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None:
        for tensor in (head.weight, getattr(head, "bias", None)):
            if tensor is not None and all(tensor is not t for t in tensors):
                tensors.append(tensor)
    return tensors


def freeze_token_rows(model, token_ids) -> list:
    """Keep the rows of ``token_ids`` out of every update: gradient hooks zero those rows of the
    input embedding and, when untied, the output head (weight and bias), so Adam never moves them
    (its moments stay zero). Weight decay is applied apart from the gradient: keep it at 0 on these
    matrices. Returns the hook handles (``handle.remove()`` undoes it); parameters that do not
    require gradients (a LoRA student) get none."""
    index = torch.tensor(sorted(set(int(i) for i in token_ids)), dtype=torch.long)
    handles = []
    for tensor in _token_row_tensors(model):
        if tensor.requires_grad and index.numel():
            rows = index.to(tensor.device)
            handles.append(tensor.register_hook(
                lambda grad, rows=rows: grad.index_fill(0, rows, 0)))
    return handles


def add_turn_end_stop(model, tokenizer) -> int:
    """Make generation stop at the template's end-of-turn token (:func:`turn_end_token`): added to
    the model's generation eos ids when neither they nor the tokenizer's eos already name it (a
    base Llama 3 tokenizer's eos is ``<|end_of_text|>``, its turns end with ``<|eot_id|>``). The
    token id."""
    turn_end = tokenizer.convert_tokens_to_ids(turn_end_token(tokenizer))
    config = model.generation_config
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if turn_end != tokenizer.eos_token_id and turn_end not in eos:
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        config.eos_token_id = [*eos, turn_end]
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    return turn_end


# ----------------------------------------------------------------------------------------------
# Shapes of real checkpoints, for random-weight checks (benchmarks/gpu_check.py, the preset tests).
# A real model's own folder always defines its shape; these only build look-alikes without a
# download.

REAL_SHAPES = {
    "qwen3-4b": ("qwen3", {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                           "vocab_size": 151936, "tie_word_embeddings": True,
                           "max_position_embeddings": 40960}),
    "qwen3-8b": ("qwen3", {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                           "vocab_size": 151936, "tie_word_embeddings": False,
                           "max_position_embeddings": 40960}),
    "olmo3-7b": ("olmo3", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 32,
                           "vocab_size": 100278, "tie_word_embeddings": False,
                           "max_position_embeddings": 65536, "sliding_window": 4096}),
}


def shaped_config(architecture: str, tokenizer=None, width: int | None = None,
                  layers: int | None = None, vocab_size: int | None = None):
    """The transformers config of a real checkpoint's shape (``REAL_SHAPES``), optionally reduced:
    ``width`` hidden units (heads, key-value heads and FFN width scaled in proportion, head width
    ``width / heads``), ``layers`` decoder layers, ``vocab_size`` rows (default: the shape's, or
    the tokenizer's when it is larger)."""
    from transformers import AutoConfig

    if architecture not in REAL_SHAPES:
        raise ValueError(f"unknown checkpoint shape {architecture!r}; shapes: {', '.join(REAL_SHAPES)}")
    model_type, shape = REAL_SHAPES[architecture]
    shape = dict(shape)
    if width is not None:
        heads = max(2, min(shape["num_attention_heads"], width // 16))
        ratio = shape["num_attention_heads"] // shape["num_key_value_heads"]
        shape.update(intermediate_size=max(8, shape["intermediate_size"] * width // shape["hidden_size"]),
                     hidden_size=width, num_attention_heads=heads,
                     num_key_value_heads=max(1, heads // ratio))
        if "head_dim" in shape:
            shape["head_dim"] = width // heads
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    elif tokenizer is not None:
        shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    if tokenizer is not None:
        shape.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=None)
    return AutoConfig.for_model(model_type, **shape)


def build_shaped_model(architecture: str, tokenizer=None, seed: int = 0, **reduce):
    """A random-initialised causal LM of ``shaped_config(architecture, tokenizer, **reduce)``."""
    config = shaped_config(architecture, tokenizer, **reduce)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    if tokenizer is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
    return model
