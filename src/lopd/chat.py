"""The chat format: what the models, the agent loop, the teacher's latent context and the
environments share about a conversation's text.

* The markers lopd's own tokenizers carry (``<|im_start|>``, ``<|latent|>``, ``<tool_call>``, ...)
  and the ChatML template installed on them (:data:`CHAT_TEMPLATE`, :func:`render_chat`).
* Rendering with any tokenizer's own template (:func:`render`) and what is read off a template
  rather than assumed (:func:`turn_end_token`).
* Quoting environment text so that no special token's text becomes the token
  (:func:`quote_special_tokens`), and what a message may carry (:func:`chat_safe`).
* The actions a model's text parses into (:class:`ToolCall`, :class:`FinalAnswer`,
  :class:`Malformed`) and the parser (:func:`parse_action`).

It is the bottom of the package: it imports nothing of lopd. Whether a tokenizer's template does
everything the loop needs is checked by running the loop on it
(:func:`lopd.agent.check_chat_template`).
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|endoftext|>"


IM_START = "<|im_start|>"


IM_END = "<|im_end|>"


LATENT_TOKEN = "<|latent|>"


TOOL_CALL_START = "<tool_call>"


TOOL_CALL_END = "</tool_call>"


SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, LATENT_TOKEN, TOOL_CALL_START, TOOL_CALL_END)


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


# Tool templates lopd ships for tokenizers whose own template has no tools (many small and older
# chat models). One is applied only when asked (`lopd model prepare --chat-template NAME`), never
# silently: it changes the text the model sees, so the choice is the user's and is recorded.
TOOL_TEMPLATES = {
    # ChatML (<|im_start|>role\n...<|im_end|>): the tools' JSON schemas in the system message, a
    # call as <tool_call>{json}</tool_call> in the assistant's text, each result in a turn of its
    # own (role "tool").
    "chatml-tools": (
        "{%- if messages[0].role == 'system' or tools -%}{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
        "{%- if tools -%}{%- if messages[0].role == 'system' -%}{{- '\\n\\n' -}}{%- endif -%}"
        "{{- 'Tools you can call, as JSON schemas:\\n<tools>' -}}"
        "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
        "{{- '\\n</tools>\\nTo call one, write <tool_call>{\"name\": NAME, \"arguments\": "
        "{...}}</tool_call>; its result comes back in a tool turn.' -}}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for message in messages -%}{%- if not (loop.first and message.role == 'system') -%}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"),
}
"""name -> Jinja chat template, for ``lopd model prepare --chat-template NAME``."""


def tool_template(name_or_file: str) -> tuple[str, str]:
    """(template text, what it is) for a name in :data:`TOOL_TEMPLATES` or a Jinja file's path;
    ``ValueError`` naming both choices otherwise."""
    if name_or_file in TOOL_TEMPLATES:
        return TOOL_TEMPLATES[name_or_file], f"{name_or_file} (lopd)"
    path = Path(name_or_file)
    if path.is_file():
        return path.read_text(), f"file {path.resolve()}"
    raise ValueError(f"--chat-template {name_or_file!r} is neither a template lopd ships "
                     f"({', '.join(sorted(TOOL_TEMPLATES))}) nor a file")


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


PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"]}}}]
"""A one-tool schema for probing how a chat template renders tools (header derivation, checks)."""


_PROBE_REPLY = "Order O1 is shipped."


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False, tokenize: bool = True):
    """A conversation through the tokenizer's chat template: token ids, or the text with
    ``tokenize=False``. The ids are what the agent loop puts in a rollout (the template's text
    tokenised in one piece, no extra special tokens), so every template token lopd looks for in a
    rollout is derived through here. A template that cannot render the conversation is a
    one-line ``ValueError``."""
    from jinja2 import TemplateError

    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template")
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=tokenize, return_dict=tokenize)
    except TemplateError as exc:
        roles = "/".join(m["role"] for m in messages)
        raise ValueError(f"the chat template cannot render a {roles} conversation: {exc}") from None
    return list(out["input_ids"]) if tokenize else out


def turn_end_token(tokenizer) -> str:
    """The special token that closes an assistant turn in the tokenizer's chat template:
    ``<|im_end|>`` in ChatML (Qwen), ``<|eot_id|>`` in Llama 3, the eos in Tulu/OLMo. The agent
    loop ends every turn with it and the engine must stop on it."""
    text = render(tokenizer, [{"role": "user", "content": "Where is order O1?"},
                              {"role": "assistant", "content": _PROBE_REPLY}], tokenize=False)
    at = text.rfind(_PROBE_REPLY)
    if at < 0:
        raise ValueError("the chat template does not render an assistant message's content "
                         "verbatim")
    rest = text[at + len(_PROBE_REPLY):]
    added = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len,
                   reverse=True)
    for token in added:
        if token and rest.startswith(token):
            return token
    raise ValueError(f"the chat template does not close assistant turns with a special token "
                     f"(it renders {rest[:24]!r} after the content)")


WORD_JOINER = "\u2060"
"""What :func:`quote_special_tokens` puts inside a token's text: invisible, and no tokenizer's
token text holds it."""


_MARKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _marker_pattern(tokenizer) -> re.Pattern | None:
    """One regex for the text of every added and special token of ``tokenizer``, longest first;
    kept per tokenizer object and built again when its vocabulary grows (``lopd model prepare``
    adds ``<|latent|>`` to a tokenizer that may have quoted text before)."""
    size = len(tokenizer)
    kept = _MARKERS.get(tokenizer)
    if kept is None or kept[0] != size:
        # A one-character token cannot be split, and all-whitespace ones (the runs of spaces some
        # tokenizers add) are ordinary text: tokenized as those tokens, they forge nothing.
        markers = sorted((m for m in {*tokenizer.get_added_vocab(), *tokenizer.all_special_tokens}
                          if len(m) > 1 and not m.isspace() and WORD_JOINER not in m),
                         key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, markers))) if markers else None
        kept = _MARKERS[tokenizer] = (size, pattern)
    return kept[1]


def _split_marker(match: re.Match) -> str:
    return match.group()[0] + WORD_JOINER + match.group()[1:]


def quote_special_tokens(text: str, tokenizer) -> str:
    """``text`` with the text of every added or special token of ``tokenizer`` (``<|im_start|>``,
    ``<|eot_id|>``, ``<tool_call>``, ``<|latent|>``, ...) broken by a :data:`WORD_JOINER` after
    its first character, so that it tokenizes as plain text; ``text`` itself when it holds none.

    The chat template renders a message's content verbatim and the result is tokenized as one
    string, so such text in content would become the token itself. Content that comes from an
    environment can carry a model's own output (a tool echoing an argument, a code environment's
    test feedback): unquoted, it could open chat turns or latent slots in the context. Longest
    texts are matched first, and quoting repeats until none is left: one token's text can overlap
    another's, and breaking one occurrence may leave the other whole."""
    pattern = _marker_pattern(tokenizer)
    if pattern is None:
        return text
    while True:
        quoted, n = pattern.subn(_split_marker, text)
        if not n:
            return text
        text = quoted


# ----------------------------------------------------------------------------------------------
# Actions, and parsing a model's text into one

FINAL_MARKER = "Task Completed"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a tool that exists, with arguments that match its schema."""

    name: str
    arguments: dict[str, Any]

    def to_text(self) -> str:
        """The assistant text for this call, in the Hermes/Qwen format."""
        return "<tool_call>" + json.dumps({"name": self.name, "arguments": self.arguments}) + "</tool_call>"


@dataclass(frozen=True)
class FinalAnswer:
    """Text without a tool call that contains the final marker: the episode ends."""

    text: str


@dataclass(frozen=True)
class Malformed:
    """Anything else the model wrote; ``error`` is shown to the model as the observation."""

    text: str
    error: str


Action = ToolCall | FinalAnswer | Malformed


_TYPE_NAMES = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "a boolean", "array": "an array", "object": "an object", "null": "null"}


def one_line(text: str, limit: int = 40) -> str:
    """``text`` on one line, cut after ``limit`` characters (marked with "...")."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def tool_function(tool: dict) -> dict:
    """The function part of a tool schema, in the HF/OpenAI wrapper format or bare."""
    return tool.get("function", tool) if isinstance(tool, dict) else {}


def _has_type(value: Any, type_name: str) -> bool:
    # bool is a subclass of int in Python but not an integer or number in JSON schema.
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "null":
        return value is None
    return True  # a type this checker does not know is not held against the model


def _value_error(value: Any, schema: Any, name: str) -> str | None:
    """Why ``value`` does not match ``schema`` (type, enum, array items, nested object), or None."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
        if names and not any(_has_type(value, t) for t in names):
            return f"argument '{name}' must be " + " or ".join(_TYPE_NAMES.get(t, t) for t in names)
    enum = schema.get("enum")
    # Compared as JSON values: true is not 1 and 1 is not "1".
    if isinstance(enum, list) and not any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in enum):
        return f"argument '{name}' must be one of " + ", ".join(json.dumps(v) for v in enum)
    if isinstance(value, list):
        for i, item in enumerate(value):
            error = _value_error(item, schema.get("items"), f"{name}[{i}]")
            if error:
                return error
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        return _object_error(value, schema, prefix=f"{name}.")
    return None


def _object_error(arguments: dict, schema: dict, prefix: str = "") -> str | None:
    """Why ``arguments`` do not match an object schema: unknown, missing or ill-typed keys."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    if schema.get("additionalProperties") is not True:
        for key in arguments:
            if key not in properties:
                return f"unknown argument '{prefix}{one_line(key)}'"
    required = schema.get("required")
    for key in required if isinstance(required, list) else []:
        if key not in arguments:
            return f"missing argument '{prefix}{key}'"
    for key, value in arguments.items():
        error = _value_error(value, properties.get(key), f"{prefix}{key}")
        if error:
            return error
    return None


def parse_action(text: str, tools: list[dict]) -> Action:
    """Read one assistant message as a tool call, the final answer, or a malformed action.

    A tool call is exactly one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (text
    before it is allowed, text after it is not) whose name is one of ``tools`` and whose arguments
    satisfy that tool's JSON schema. A message without a tool call is the final answer when it
    contains "Task Completed". Everything else is :class:`Malformed` with a short, specific error
    meant to be shown to the model. Never raises.
    """
    if TOOL_CALL_START not in text:
        if FINAL_MARKER in text:
            return FinalAnswer(text)
        return Malformed(text, f"no tool call and no '{FINAL_MARKER}'")
    after_start = text.split(TOOL_CALL_START, 1)[1]
    if TOOL_CALL_START in after_start:
        return Malformed(text, "more than one tool call; write exactly one")
    if TOOL_CALL_END not in after_start:
        return Malformed(text, f"missing {TOOL_CALL_END} closing tag")
    body, rest = after_start.split(TOOL_CALL_END, 1)
    if rest.strip():
        return Malformed(text, f"text after {TOOL_CALL_END}")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested brackets
        return Malformed(text, "invalid JSON in tool call")
    if not isinstance(call, dict):
        return Malformed(text, "tool call must be a JSON object with 'name' and 'arguments'")
    name = call.get("name")
    if not isinstance(name, str):
        return Malformed(text, "tool call needs a string 'name'")
    schemas = {tool_function(t).get("name"): tool_function(t).get("parameters") or {} for t in tools}
    if name not in schemas:
        return Malformed(text, f"unknown tool '{one_line(name)}'")
    if "arguments" not in call:
        return Malformed(text, "tool call needs an 'arguments' object")
    arguments = call["arguments"]
    if not isinstance(arguments, dict):
        return Malformed(text, "'arguments' must be a JSON object")
    error = _object_error(arguments, schemas[name])
    if error:
        return Malformed(text, error)
    return ToolCall(name, arguments)


# What a chat message must not carry to the template: control characters other than newline and
# tab (NUL among them), and lone surrogates.
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def chat_safe(text: str | None) -> str | None:
    """``text`` with every control character but newline and tab, and every lone surrogate,
    written as its JSON escape (NUL as ``\\u0000``, a lone high surrogate as ``\\ud800``);
    anything else unchanged, None as None.

    Tool results and error messages quote the model's *parsed* JSON, which holds what decoded model
    text never does: ``json.loads('"\\ud800"')`` is a lone surrogate, which no tokenizer can
    encode, so echoing it crashed the rollout. Escaping control characters too means no text that
    reaches the model from an environment holds a NUL, so none can contain the loop's NUL-delimited
    :data:`_CONTENT_PLACEHOLDER`. JSON's escape is what the model wrote to get the character, and
    the mapping is deterministic, so replays and batches see the same text."""
    if text is None or not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
