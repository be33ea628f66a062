"""Text corpora for training the tiny default tokenizer.

A tokenizer for an agent should learn the pieces its transcripts are made of: the chat scaffolding,
the tool-call JSON, entity ids and the words of the tasks. ``read_corpus`` takes the caller's text;
``synthetic_transcripts`` is the built-in fallback: tool-use conversations rendered with the chat
template, so the tokenizer has merges for the scaffolding even before an environment exists.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lopd.chat import TOOL_CALL_END, TOOL_CALL_START, render_chat

_OBJECTS = ["order", "item", "policy", "claim", "shipment", "package", "patient", "appointment"]
_VERBS = ["get", "list", "update", "cancel", "create", "find", "check", "refund"]


def read_corpus(path: str | Path) -> list[str]:
    """Texts from a ``.txt`` file (one text per line) or a ``.jsonl`` file (a "text" field each)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{n}: expected an object with a string field 'text'")
            texts.append(record["text"])
        return texts
    return [line for line in path.read_text().splitlines() if line.strip()]


def synthetic_transcripts(n: int = 300, seed: int = 0) -> list[str]:
    """``n`` short tool-use conversations in the project's chat format."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        obj, verb = rng.choice(_OBJECTS), rng.choice(_VERBS)
        entity = f"{obj[0].upper()}{rng.randint(100, 999)}"
        tool = {"type": "function", "function": {
            "name": f"{verb}_{obj}", "description": f"{verb.capitalize()} a {obj}.",
            "parameters": {"type": "object", "properties": {f"{obj}_id": {"type": "string"}},
                           "required": [f"{obj}_id"]}}}
        call = json.dumps({"name": f"{verb}_{obj}", "arguments": {f"{obj}_id": entity}})
        messages = [
            {"role": "system", "content": "You are an agent. Use the tools, then say Task Completed."},
            {"role": "user", "content": f"Please {verb} {obj} {entity}."},
            {"role": "assistant", "content": f"{TOOL_CALL_START}{call}{TOOL_CALL_END}"},
            {"role": "tool", "content": json.dumps({"status": "ok", f"{obj}_id": entity})},
            {"role": "assistant", "content": f"Done: {obj} {entity}. Task Completed"},
        ]
        texts.append(render_chat(messages, tools=[tool]))
    return texts
