"""Machinery shared by the toolworld domains: tools, checks, templates, ids and vocabularies.

A domain is a typed in-memory database (a dataclass whose fields are ``dict[id, row dataclass]``
tables), a set of :class:`Tool` s that read and mutate it, and a set of :class:`Template` s that
build one task instance (:class:`Instance`) from a random generator. Checks compare the final
database with the initial one, so everything the verifier needs is the two snapshots.

Entity values come from small closed vocabularies and ids are a letter plus three digits
("O482"): a ~1M-parameter model with a 2K-token BPE vocabulary can copy those, but not long
numbers, e-mail addresses or free text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
         "Max", "Nia", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vera", "Wes", "Yara", "Zoe",
         "Leo", "Mia", "Noah", "Ella", "Sam", "Ruby")
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Berlin", "Madrid", "Dublin")

# Probability that a template's request can be carried out; otherwise a precondition fails and
# the right move is to report it with a ticket.
P_OK = 0.6

Snapshot = dict[str, dict[str, dict[str, Any]]]
"""table name -> row id -> field -> value."""


class ToolError(Exception):
    """A failed precondition or a bad argument; the agent sees ``"Error: " + message``."""


# ----------------------------------------------------------------------------------------------
# Tools


@dataclass(frozen=True)
class Param:
    """One tool argument. All arguments are required; ``enum`` lists the allowed strings."""

    type: str  # "string" or "integer"
    description: str
    enum: tuple[str, ...] | None = None

    def schema(self) -> dict:
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        return out

    def check(self, name: str, value: Any) -> None:
        if self.type == "integer":
            # bool is a subclass of int in Python, but true/false is not a quantity.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ToolError(f"{name} must be an integer")
        elif not isinstance(value, str):
            raise ToolError(f"{name} must be a string")
        if self.enum is not None and value not in self.enum:
            raise ToolError(f"{name} must be one of {', '.join(self.enum)}")


@dataclass(frozen=True)
class Tool:
    """A function of the database with a JSON schema. ``fn(db, **arguments)`` returns a
    JSON-serialisable result or raises :class:`ToolError`."""

    name: str
    description: str
    params: dict[str, Param]
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The Hugging Face / OpenAI function schema of this tool."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object",
                           "properties": {k: p.schema() for k, p in self.params.items()},
                           "required": list(self.params)}}}

    def __call__(self, db: Any, arguments: Any) -> str:
        """Validate ``arguments``, run the tool and return its result as compact JSON text."""
        if not isinstance(arguments, dict):
            raise ToolError(f"arguments of {self.name} must be an object")
        for key in arguments:
            if key not in self.params:
                raise ToolError(f"unexpected argument {key!r} for {self.name}")
        for key, param in self.params.items():
            if key not in arguments:
                raise ToolError(f"missing argument {key!r} for {self.name}")
            param.check(key, arguments[key])
        return json.dumps(self.fn(db, **arguments), separators=(",", ":"))


def call(tool: str, /, **arguments: Any) -> dict:
    """One oracle tool call in the ``Task.oracle`` format (positional-only ``tool``: tools take a
    ``name`` argument too)."""
    return {"name": tool, "arguments": arguments}


def get_row(table: dict[str, Any], key: str, noun: str) -> Any:
    """The row ``key`` of ``table``, or a clear error naming the missing ``noun``."""
    row = table.get(key)
    if row is None:
        raise ToolError(f"no {noun} {key}")
    return row


def find_by_name(table: dict[str, Any], name: str, noun: str) -> Any:
    """The row whose ``name`` is ``name`` (names are unique within an episode)."""
    for row in table.values():
        if row.name == name:
            return row
    raise ToolError(f"no {noun} named {name}")


def listing(rows: list[Any], keys: tuple[str, ...]) -> list[dict]:
    """Selected fields of ``rows``, sorted by id so that a row's position says nothing about
    whether it is the one the task is about."""
    return [{k: getattr(row, k) for k in keys}
            for row in sorted(rows, key=lambda r: getattr(r, keys[0]))]


def next_id(table: dict[str, Any], prefix: str) -> str:
    """A fresh id for a created row: one above the largest in ``table`` (ids are drawn below
    900, so this stays at three digits)."""
    return f"{prefix}{max((int(k[1:]) for k in table), default=99) + 1}"


@dataclass
class Ticket:
    """A report filed by the agent when a request cannot be carried out."""

    ticket_id: str
    target: str
    reason: str


def ticket_tool(param: str, noun: str, table: str, reasons: tuple[str, ...]) -> Tool:
    """The ``open_ticket(<param>, reason)`` tool of a domain; tickets go to ``db.tickets``."""

    def open_ticket(db: Any, reason: str, **target: str) -> dict:
        key = target[param]
        get_row(getattr(db, table), key, noun)
        if any(t.target == key and t.reason == reason for t in db.tickets.values()):
            raise ToolError(f"a ticket for {key} with reason {reason} is already open")
        ticket_id = f"T{len(db.tickets) + 1}"
        db.tickets[ticket_id] = Ticket(ticket_id, key, reason)
        return {"ticket_id": ticket_id, param: key, "reason": reason}

    return Tool("open_ticket", "Report a request that cannot be done",
                {param: Param("string", f"{noun} id"),
                 "reason": Param("string", "why it cannot be done", reasons)}, open_ticket)


# ----------------------------------------------------------------------------------------------
# Checks


def snapshot(db: Any) -> Snapshot:
    """A plain copy of every table of ``db`` (row fields are immutable values)."""
    return {f.name: {key: dict(vars(row)) for key, row in getattr(db, f.name).items()}
            for f in fields(db)}


@dataclass(frozen=True)
class FieldIs:
    """Row ``key`` of ``table`` has ``field == value`` at the end."""

    table: str
    key: str
    field: str
    value: Any

    def describe(self) -> str:
        return f"{self.key} {self.field} is {self.value}"

    def holds(self, initial: Snapshot, final: Snapshot) -> bool:
        row = final[self.table].get(self.key)
        return row is not None and row[self.field] == self.value


@dataclass(frozen=True)
class RowAdded:
    """A row that was not there at the start has all the fields of ``match``."""

    table: str
    match: tuple[tuple[str, Any], ...]

    def describe(self) -> str:
        return f"new {self.table} row with " + ", ".join(f"{k}={v}" for k, v in self.match)

    def matches(self, row: dict[str, Any]) -> bool:
        return all(row.get(k) == v for k, v in self.match)

    def holds(self, initial: Snapshot, final: Snapshot) -> bool:
        return any(key not in initial[self.table] and self.matches(row)
                   for key, row in final[self.table].items())


Check = FieldIs | RowAdded
NOTHING_ELSE = "no other entity changed"


def nothing_else_changed(initial: Snapshot, final: Snapshot, checks: list[Check]) -> bool:
    """Every field no check is about keeps its initial value, no row disappears, and every new
    row is accounted for by a distinct :class:`RowAdded` check."""
    covered = {(c.table, c.key, c.field) for c in checks if isinstance(c, FieldIs)}
    pending = [c for c in checks if isinstance(c, RowAdded)]
    for table, rows in initial.items():
        for key, row in rows.items():
            now = final[table].get(key)
            if now is None:
                return False
            if any(now[f] != v for f, v in row.items() if (table, key, f) not in covered):
                return False
        for key, row in final[table].items():
            if key in rows:
                continue
            spec = next((c for c in pending if c.table == table and c.matches(row)), None)
            if spec is None:
                return False
            pending.remove(spec)
    return True


def ticket_check(target: str, reason: str) -> RowAdded:
    """The check that a ticket about ``target`` with ``reason`` was opened."""
    return RowAdded("tickets", (("target", target), ("reason", reason)))


# ----------------------------------------------------------------------------------------------
# Templates and instances


@dataclass
class Instance:
    """One generated task: its instruction, initial database, oracle tool calls and checks."""

    instruction: str
    db: Any
    calls: list[dict]
    checks: list[Check]
    variant: str
    """``ok`` when the request can be carried out, else the ticket reason the oracle reports."""


@dataclass(frozen=True)
class Template:
    """A family of tasks; ``build(rng)`` makes one instance, deterministically from ``rng``."""

    name: str
    weight: float
    build: Callable[[random.Random], Instance]


@dataclass(frozen=True)
class Domain:
    """One stateful API world: its tools and the templates of its tasks."""

    name: str
    label: str
    """How the system prompt names the agent: "an e-commerce" support agent."""
    tools: tuple[Tool, ...]
    templates: tuple[Template, ...]

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def template(self, name: str) -> Template:
        for t in self.templates:
            if t.name == name:
                return t
        raise ValueError(f"domain {self.name} has no template {name!r}")


class TaskRandom(random.Random):
    """The generator templates draw from. ``choice`` and ``randint`` scale one ``random()``
    draw, several times faster than the exact integer sampling of :class:`random.Random`, which
    dominated the time to generate 30,000 tasks (the bias is below 2**-40)."""

    def choice(self, seq):
        return seq[int(self.random() * len(seq))]

    def randint(self, a: int, b: int) -> int:
        return a + int(self.random() * (b - a + 1))


class Ids:
    """Unique ids within one episode: a prefix letter and three digits."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def new(self, prefix: str) -> str:
        while True:
            key = f"{prefix}{self.rng.randint(100, 899)}"
            if key not in self.used:
                self.used.add(key)
                return key


def attempt(instruction: str, db: Any, lookups: list[dict], action: dict, effects: list[Check],
            report: tuple[dict, str, str] | None) -> Instance:
    """An instance whose oracle makes the ``lookups`` then the ``action``.

    ``report`` is None when the action succeeds: the checks are its ``effects``. Otherwise it is
    ``(ticket call, target id, reason)``: the action fails on a precondition, the oracle then opens
    the ticket, and the checks are that every field the action would set keeps its value and
    that the ticket exists.
    """
    if report is None:
        return Instance(instruction, db, lookups + [action], effects, "ok")
    ticket, target, reason = report
    unchanged: list[Check] = [
        FieldIs(e.table, e.key, e.field, getattr(getattr(db, e.table)[e.key], e.field))
        for e in effects if isinstance(e, FieldIs)]
    return Instance(instruction, db, lookups + [action, ticket],
                    unchanged + [ticket_check(target, reason)], reason)
