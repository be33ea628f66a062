"""Models and tokenizers: load any Hugging Face causal LM, or build the tiny default.

The tiny default is what makes the project run end to end on a 2-core CPU: a byte-level BPE
tokenizer trained on the caller's corpus (environment transcripts) and a Qwen3-architecture model of
about one million parameters, random-initialised from a seed. It is an ordinary transformers model,
so every code path that works on it works on Qwen3-4B as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config
from transformers import Qwen3ForCausalLM

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
LATENT_TOKEN = "<|latent|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, LATENT_TOKEN, TOOL_CALL_START, TOOL_CALL_END)

# Where `lopd base` ships the embedded default model inside the package.
ASSETS = Path(__file__).parent / "assets"
EMBEDDED = {name: ASSETS / name for name in ("toolworld-1m", "toolworld-1m-plain", "codeworld-1m")}
EMBEDDED_DIR = EMBEDDED["toolworld-1m"]
"""Models shipped in the package: the toolworld base of the default (coded) setting, the first-stage
toolworld base it was trained from (plain requests only), and the codeworld base (issue notes say
why the two domains have separate tiny models)."""

# ChatML, as Qwen uses it, with one change that matters for a 1M-parameter model: tools are listed
# as one short signature line each instead of their full JSON schema, which keeps prompts short.
# Real checkpoints keep their own template; this one is only installed on tokenizers we build.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_done=false) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and (message.role == 'system' or tools) -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if message.role == 'system' -%}{{ message.content }}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if message.role == 'system' -%}{{ '\\n' }}{%- endif -%}"
    "{{ 'Tools:' }}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{ '\\n- ' + fn.name + '(' + (fn.parameters.properties.keys() | join(', ')) + ')' }}"
    "{%- if fn.description -%}{{ ': ' + fn.description }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- set ns.system_done = message.role == 'system' -%}"
    "{%- endif -%}"
    "{%- if not (loop.first and ns.system_done) -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


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
    """'toolworld-1m' / 'toolworld-1m-plain' / 'codeworld-1m' are the embedded models; a folder must hold a config;
    anything else is a hub id."""
    name = str(name_or_path)
    if name in EMBEDDED:
        if not (EMBEDDED[name] / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded model {name!r} is not in this install ({EMBEDDED[name]}); "
                "build one with `lopd base --out DIR` and pass that folder instead")
        return str(EMBEDDED[name])
    path = Path(name)
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return str(path)
    return name


def load_model(name_or_path: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """Load a causal LM and its tokenizer from a local folder (or a hub id where a network exists)."""
    path = resolve_model_path(name_or_path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_model(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model) -> int:
    """Unique parameters (tied input/output embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def model_info(path: str | Path) -> dict:
    """Facts about a saved model folder, as printed by ``lopd model info``."""
    model, tokenizer = load_model(path)
    cfg = model.config
    return {
        "path": resolve_model_path(path),
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "parameters": count_parameters(model),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": cfg.max_position_embeddings,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "special_tokens": list(tokenizer.all_special_tokens),
        "latent_token": LATENT_TOKEN if LATENT_TOKEN in tokenizer.get_vocab() else None,
        "chat_template": tokenizer.chat_template is not None,
    }


def render_chat(messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    """Render a conversation with the project's chat template without needing a tokenizer.

    Used to build the tokenizer's own training corpus, before any tokenizer exists; gives the same
    text as ``tokenizer.apply_chat_template(..., tokenize=False)`` on a tokenizer we built.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
