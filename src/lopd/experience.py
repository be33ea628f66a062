"""The experience bank: successful training rollouts, stored, embedded and searched.

An entry is one successful rollout of a training-split task, kept as its *compact trace*: the task
and the agent's actions with short result summaries (:meth:`lopd.agent.Rollout.compact_trace`).
That text is what the composer encodes, and the document embedding is computed from it; queries
embed the task text alone (asymmetric retrieval, with an optional query instruction for
instruction-tuned embedders). Vectors are L2-normalised, so exact inner-product search (FAISS
``IndexFlatIP``) is cosine similarity.

Storage is one folder holding one SQLite database (WAL mode): every entry is a row that carries its
own embedding as a float32 BLOB, and a settings table records the embedder and the rules the bank
was created with. The database is the only thing on disk; the FAISS index is rebuilt from the
stored vectors on open. Keeping rows and vectors in one table means one transaction covers both:
an add that fails half-way (an exception, a killed process) is rolled back by SQLite and leaves no
row and no vector behind, so the index always matches the table. The in-memory index is updated
only from committed rows.

Rules the bank enforces: only training-split tasks enter (anything else raises :class:`BankError`
naming the task and split); rollouts whose reward is below the bank's threshold are skipped and
reported; the same (task, compact trace) is stored once. A search excludes the querying task's own
entries (leave-one-out) unless self-retrieval is allowed.

A bank can *withhold* tasks (:meth:`ExperienceBank.withhold`): the validation tasks of a
validation-mode run. The set is stored in the bank's settings, so every copy and checkpoint of it
keeps it; a withheld task's entries stay in the table but are invisible (never searched, listed,
counted or handed to a cold start), and adding one raises :class:`BankError`. This is how the
comparison protocol's rule "validation tasks never enter the bank and are never retrieved" is kept
by the bank itself rather than by each caller.

The settings also count the rollouts sampled to fill the bank (``rollouts_sampled``, raised by
:meth:`ExperienceBank.charge`): they are part of what a method using the bank has consumed.

One piece, though long: the store (SQLite rows with their vectors), the search (the FAISS index
rebuilt from those rows) and the rules above must change together, in one transaction, so they
are one class; the retrieval the methods call and its measurement follow it. The embedders are
:mod:`lopd.embedding`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import faiss
import numpy as np
import torch

from lopd.agent import Rollout
from lopd.embedding import BankError, Embedder, EmbedderSpec, load_embedder
from lopd.envs.environment import Task

DB_NAME = "bank.sqlite"
ROLLOUTS_NAME = "rollouts.jsonl"
SCHEMA_VERSION = 1
TRAIN_SPLIT = "train"


# ----------------------------------------------------------------------------------------------
# Entries


@dataclass(frozen=True)
class Experience:
    """One stored success. ``trace`` starts with the task line, so it is the whole document."""

    task_id: str
    env: str
    domain: str
    split: str
    task: str
    """The task text (instruction) the query side is compared with."""
    trace: str
    """The compact trace: ``Task: ...`` then one line per action with a short result summary."""
    reward: float
    source: str = ""
    """What produced the rollout, e.g. ``model:tiny`` or ``oracle``."""
    meta: dict = field(default_factory=dict)
    """The task's environment metadata (toolworld: template, variant, seed)."""
    entry_id: int | None = None
    """Assigned by the bank when stored."""
    created_at: str | None = None
    """UTC time the entry was stored (ISO 8601)."""

    @classmethod
    def from_rollout(cls, rollout: Rollout, task: Task, source: str = "",
                     max_observation_chars: int = 80) -> Experience:
        """The entry for ``rollout`` of ``task`` (which supplies environment, split and meta)."""
        if rollout.task_id != task.task_id:
            raise BankError(f"rollout of task {rollout.task_id} paired with task {task.task_id}")
        if rollout.instruction != task.instruction:
            raise BankError(f"rollout of task {rollout.task_id} has a different instruction than "
                            "the task of that id: the rollouts come from another environment "
                            "seed or version")
        return cls(task_id=task.task_id, env=task.env, domain=task.domain, split=task.split,
                   task=task.instruction, trace=rollout.compact_trace(max_observation_chars),
                   reward=float(rollout.reward), source=source, meta=dict(task.meta))

    def to_dict(self) -> dict:
        return asdict(self)


class Hit(NamedTuple):
    """One search result: the stored entry and its cosine similarity to the query."""

    entry: Experience
    score: float


@dataclass
class AddResult:
    """What one :meth:`ExperienceBank.add` did with each entry it was given."""

    added: list[Experience] = field(default_factory=list)
    """Stored now, with their entry ids."""
    duplicates: list[Experience] = field(default_factory=list)
    """Same (task, trace) as a stored entry or an earlier one of the same call."""
    below_threshold: list[Experience] = field(default_factory=list)
    """Reward below the bank's threshold; not stored."""

    def counts(self) -> dict[str, int]:
        return {"added": len(self.added), "duplicates": len(self.duplicates),
                "below_threshold": len(self.below_threshold)}


# ----------------------------------------------------------------------------------------------
# The bank

_SCHEMA = """
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE entries (
    entry_id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    env TEXT NOT NULL,
    domain TEXT NOT NULL,
    split TEXT NOT NULL CHECK (split = 'train'),
    task TEXT NOT NULL,
    trace TEXT NOT NULL,
    reward REAL NOT NULL,
    source TEXT NOT NULL,
    meta TEXT NOT NULL,
    created_at TEXT NOT NULL,
    embedding BLOB NOT NULL,
    UNIQUE (task_id, trace)
);
"""
_COLUMNS = ("task_id", "env", "domain", "split", "task", "trace", "reward", "source", "meta",
            "created_at", "embedding")
_INSERT = (f"INSERT OR IGNORE INTO entries ({', '.join(_COLUMNS)}) "
           f"VALUES ({', '.join('?' * len(_COLUMNS))})")


def _row(entry: Experience, vector: np.ndarray, created_at: str) -> tuple:
    """The ``entries`` row of one entry and its embedding."""
    return (entry.task_id, entry.env, entry.domain, entry.split, entry.task, entry.trace,
            float(entry.reward), entry.source, json.dumps(entry.meta, sort_keys=True), created_at,
            np.ascontiguousarray(vector, dtype="<f4").tobytes())


def _read_settings(conn: sqlite3.Connection, path: Path) -> tuple[dict, EmbedderSpec]:
    """The settings table of an opened bank, checked, and the embedder spec it names."""
    try:
        settings = {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM settings")}
    except (sqlite3.DatabaseError, ValueError) as exc:
        raise BankError(f"{path} is not a readable experience bank: {exc}") from None
    version = settings.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BankError(f"{path}: bank schema version {version!r}; this lopd reads version "
                        f"{SCHEMA_VERSION}")
    try:
        spec = EmbedderSpec(**settings["embedder"])
        for key in ("dim", "reward_threshold", "max_observation_chars"):
            float(settings[key])
    except (ValueError, KeyError, TypeError) as exc:
        raise BankError(f"{path}: damaged bank settings ({type(exc).__name__}: {exc})") from None
    return settings, spec


def _writable_folder(folder: Path) -> None:
    """Refuse a bank folder that is, or lies under, an existing file: said before anything is
    loaded or written, instead of an OSError from deep inside ``mkdir``."""
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                raise BankError(f"bank folder {folder} is a file, not a folder" if path == folder
                                else f"bank folder {folder}: {path} is a file, not a folder")
            return


class ExperienceBank:
    """Successful training rollouts in one folder, searchable by task text.

    Create one with :meth:`create`, reopen it with :meth:`open`. The embedder, the reward
    threshold and the observation cap are fixed at creation and stored in the bank.
    """

    def __init__(self, folder: Path, conn: sqlite3.Connection, embedder: Embedder,
                 settings: dict):
        self.folder = folder
        self._conn = conn
        self.embedder = embedder
        self.reward_threshold = float(settings["reward_threshold"])
        self.max_observation_chars = int(settings["max_observation_chars"])
        self.dim = int(settings["dim"])
        self._withheld = frozenset(settings.get("withheld_task_ids", []))
        self._rollouts_sampled = int(settings.get("rollouts_sampled", 0))
        self._reset()
        self.refresh()

    def _reset(self) -> None:
        self._index = faiss.IndexFlatIP(self.dim)
        self._entries: list[Experience] = []
        self._per_task: Counter[str] = Counter()
        self._last_id = 0

    # ------------------------------------------------------------------------------------------
    # Opening and creating

    @classmethod
    def create(cls, folder: str | Path, embedder: Embedder, reward_threshold: float = 1.0,
               max_observation_chars: int = 80) -> ExperienceBank:
        """A new, empty bank in ``folder`` (created if needed; must not hold a bank already)."""
        folder = Path(folder)
        if not 0.0 <= reward_threshold <= 1.0:
            raise BankError(f"reward_threshold must be in [0, 1], got {reward_threshold}")
        if max_observation_chars < 1:
            raise BankError(f"max_observation_chars must be >= 1, got {max_observation_chars}")
        _writable_folder(folder)
        path = folder / DB_NAME
        if path.exists():
            raise BankError(f"{folder} already holds an experience bank; open it instead")
        folder.mkdir(parents=True, exist_ok=True)
        settings = {"schema_version": SCHEMA_VERSION, "embedder": asdict(embedder.spec),
                    "dim": embedder.dim, "reward_threshold": float(reward_threshold),
                    "max_observation_chars": int(max_observation_chars),
                    "created_at": _now()}
        # Built under a temporary name and renamed, so a crash never leaves a half-made bank.
        tmp = folder / f".{DB_NAME}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.executescript(_SCHEMA)
            conn.executemany("INSERT INTO settings VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in settings.items()])
        finally:
            conn.close()
        tmp.replace(path)
        # Autocommit mode: `add` opens its transaction explicitly (BEGIN IMMEDIATE).
        conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        return cls(folder, conn, embedder, settings)

    @classmethod
    def open(cls, folder: str | Path, embedder: Embedder | None = None, batch_size: int = 32,
             device: torch.device | str = "cpu", trust_remote_code: bool = False) -> ExperienceBank:
        """Open the bank in ``folder``. Without ``embedder`` the stored one is loaded; a given
        embedder must match the stored spec and dimension (vectors must stay comparable)."""
        folder = Path(folder)
        path = folder / DB_NAME
        if not path.is_file():
            raise BankError(f"no experience bank in {folder} (no {DB_NAME}); build one with "
                            "`lopd bank build`")
        conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        try:
            settings, spec = _read_settings(conn, path)
            if embedder is None:
                embedder = load_embedder(spec, batch_size=batch_size, device=device,
                                         trust_remote_code=trust_remote_code)
            elif embedder.spec != spec or embedder.dim != settings["dim"]:
                raise BankError(f"{folder} was built with embedder {spec.describe()} "
                                f"({settings['dim']}-d), not {embedder.spec.describe()} "
                                f"({embedder.dim}-d)")
            conn.execute("PRAGMA journal_mode=WAL")
            return cls(folder, conn, embedder, settings)
        except BaseException:
            conn.close()
            raise

    @classmethod
    def open_or_create(cls, folder: str | Path, spec: EmbedderSpec, reward_threshold: float = 1.0,
                       max_observation_chars: int = 80, batch_size: int = 32,
                       device: torch.device | str = "cpu",
                       trust_remote_code: bool = False) -> ExperienceBank:
        """Open the bank in ``folder`` (its stored settings win), or create it from these."""
        _writable_folder(Path(folder))
        if (Path(folder) / DB_NAME).exists():
            return cls.open(folder, batch_size=batch_size, device=device,
                            trust_remote_code=trust_remote_code)
        embedder = load_embedder(spec, batch_size=batch_size, device=device,
                                 trust_remote_code=trust_remote_code)
        return cls.create(folder, embedder, reward_threshold, max_observation_chars)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ExperienceBank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # Reading

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Experience]:
        """All visible entries (withheld tasks' left out) in storage order (entry ids ascending)."""
        return list(self._entries)

    @property
    def withheld(self) -> frozenset[str]:
        """Task ids this bank withholds: never searched, listed or added."""
        return self._withheld

    @property
    def rollouts_sampled(self) -> int:
        """Rollouts sampled to fill this bank (what building it cost, in generations)."""
        return self._rollouts_sampled

    def embeddings(self) -> np.ndarray:
        """The ``(len(self), dim)`` matrix of stored document vectors, in storage order."""
        return self._index.reconstruct_n(0, self._index.ntotal)

    def refresh(self) -> None:
        """Load entries committed since the last refresh into memory and the index.

        The table is the only truth and memory follows it: this runs on open and after every
        add, and picks up entries another process added to the same bank (SQLite commits entry
        ids in increasing order, so "newer than the last id held" misses none).
        """
        try:
            rows = self._conn.execute(
                f"SELECT entry_id, {', '.join(_COLUMNS)} FROM entries WHERE entry_id > ? "
                "ORDER BY entry_id", (self._last_id,)).fetchall()
        except sqlite3.DatabaseError as exc:
            raise BankError(f"{self.folder / DB_NAME} is not a readable experience bank: {exc}") \
                from None
        if not rows:
            return
        self._last_id = rows[-1][0]
        rows = [row for row in rows if row[1] not in self._withheld]
        if not rows:
            return
        vectors = np.empty((len(rows), self.dim), dtype=np.float32)
        entries = []
        for i, (entry_id, task_id, env, domain, split, task, trace, reward, source, meta,
                created_at, blob) in enumerate(rows):
            if len(blob) != 4 * self.dim:
                raise BankError(f"{self.folder / DB_NAME}: entry {entry_id} has a "
                                f"{len(blob) // 4}-d embedding, the bank is {self.dim}-d")
            vectors[i] = np.frombuffer(blob, dtype="<f4")
            entries.append(Experience(task_id, env, domain, split, task, trace, reward, source,
                                      json.loads(meta), entry_id, created_at))
        self._index.add(vectors)
        self._entries.extend(entries)
        self._per_task.update(e.task_id for e in entries)

    def search(self, query_tasks: Sequence[str], n_ret: int,
               exclude_task_ids: Sequence[str | None] | None = None,
               allow_self_retrieval: bool = False) -> list[list[Hit]]:
        """The ``n_ret`` entries most similar to each query task, best first, with cosine scores.

        ``exclude_task_ids[i]`` is the id of the task behind query i (None for free text): its
        own entries are never returned (leave-one-out) unless ``allow_self_retrieval``. A query
        gets fewer hits only when the bank has fewer eligible entries.
        """
        if n_ret < 1:
            raise ValueError(f"n_ret must be >= 1, got {n_ret}")
        if exclude_task_ids is None or allow_self_retrieval:
            exclude_task_ids = [None] * len(query_tasks)
        if len(exclude_task_ids) != len(query_tasks):
            raise ValueError(f"{len(query_tasks)} queries but {len(exclude_task_ids)} "
                             "exclude_task_ids")
        if not query_tasks or not self._entries:
            return [[] for _ in query_tasks]
        # Ask for enough neighbours that n_ret remain after dropping the excluded task's entries.
        extra = max((self._per_task[t] for t in exclude_task_ids if t is not None), default=0)
        k = min(len(self._entries), n_ret + extra)
        scores, ids = self._index.search(self.embedder.embed_queries(list(query_tasks)), k)
        results = []
        for row_scores, row_ids, excluded in zip(scores, ids, exclude_task_ids):
            hits = []
            for score, i in zip(row_scores, row_ids):
                if i < 0 or self._entries[i].task_id == excluded:
                    continue
                hits.append(Hit(self._entries[i], float(score)))
                if len(hits) == n_ret:
                    break
            results.append(hits)
        return results

    def stats(self) -> dict:
        """Counts per domain and source, and the settings the bank was created with."""
        return {
            "path": str(self.folder),
            "entries": len(self._entries),
            "tasks": len(self._per_task),
            "per_domain": dict(sorted(Counter(e.domain for e in self._entries).items())),
            "per_source": dict(sorted(Counter(e.source for e in self._entries).items())),
            "reward_threshold": self.reward_threshold,
            "max_observation_chars": self.max_observation_chars,
            "embedder": self.embedder.spec.describe(),
            "embedder_spec": asdict(self.embedder.spec),
            "dim": self.dim,
            "withheld_tasks": len(self._withheld),
            "rollouts_sampled": self._rollouts_sampled,
        }

    # ------------------------------------------------------------------------------------------
    # Writing

    def add(self, entries: Iterable[Experience]) -> AddResult:
        """Store the entries that pass the bank's rules, atomically.

        Raises :class:`BankError` before writing anything if an entry is not from the training
        split. Entries below the reward threshold and duplicates are skipped and reported. The
        rows and their embeddings are written in one transaction: if anything fails in it the
        bank is exactly as before.
        """
        entries = list(entries)
        for entry in entries:
            if entry.split != TRAIN_SPLIT:
                raise BankError(f"task {entry.task_id} is from the {entry.split!r} split; only "
                                f"{TRAIN_SPLIT!r}-split tasks may enter the experience bank")
            if entry.task_id in self._withheld:
                raise BankError(f"task {entry.task_id} is withheld from {self.folder} (a "
                                "validation task): it may not enter the bank")
        result = AddResult()
        candidates = []
        seen = set()
        for entry in entries:
            key = (entry.task_id, entry.trace)
            if entry.reward < self.reward_threshold:
                result.below_threshold.append(entry)
            elif key in seen or self._contains(key):
                result.duplicates.append(entry)
            else:
                seen.add(key)
                candidates.append(entry)
        if not candidates:
            return result
        # Embedding is the slow part: done before the write lock is taken.
        vectors = self.embedder.embed_documents([e.trace for e in candidates])
        created_at = _now()
        inserted = []
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for entry, vector in zip(candidates, vectors):
                cursor = self._conn.execute(_INSERT, _row(entry, vector, created_at))
                if cursor.rowcount:
                    inserted.append(replace(entry, entry_id=cursor.lastrowid,
                                            created_at=created_at))
                else:  # stored by another writer since the duplicate check
                    result.duplicates.append(entry)
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        result.added = inserted
        self.refresh()
        return result

    def withhold(self, task_ids: Iterable[str]) -> None:
        """Withhold ``task_ids`` from now on (added to those already withheld; stored)."""
        withheld = self._withheld | frozenset(task_ids)
        if withheld == self._withheld:
            return
        self._write_setting("withheld_task_ids", sorted(withheld))
        self._withheld = withheld
        self._reset()
        self.refresh()

    def charge(self, rollouts: int) -> None:
        """Count ``rollouts`` more sampled rollouts as spent on filling this bank (stored)."""
        if rollouts < 0:
            raise ValueError(f"rollouts must be >= 0, got {rollouts}")
        self._rollouts_sampled += int(rollouts)
        self._write_setting("rollouts_sampled", self._rollouts_sampled)

    def _write_setting(self, key: str, value) -> None:
        self._conn.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)",
                           (key, json.dumps(value)))

    def snapshot(self, folder: str | Path) -> Path:
        """A consistent copy of this bank (table and stored rollouts) in ``folder``, which must not
        hold a bank. SQLite's backup API copies committed state even while the WAL is in use."""
        folder = Path(folder)
        _writable_folder(folder)
        if (folder / DB_NAME).exists():
            raise BankError(f"{folder} already holds an experience bank")
        folder.mkdir(parents=True, exist_ok=True)
        target = sqlite3.connect(str(folder / DB_NAME))
        try:
            self._conn.backup(target)
        finally:
            target.close()
        rollouts = self.folder / ROLLOUTS_NAME
        if rollouts.exists():
            shutil.copyfile(rollouts, folder / ROLLOUTS_NAME)
        return folder

    def _contains(self, key: tuple[str, str]) -> bool:
        return self._conn.execute("SELECT 1 FROM entries WHERE task_id = ? AND trace = ?",
                                  key).fetchone() is not None

    def add_rollouts(self, rollouts: Iterable[Rollout], tasks: Mapping[str, Task],
                     source: str = "") -> AddResult:
        """:meth:`add` for rollouts; ``tasks`` maps task ids to the tasks the rollouts ran."""
        rollouts = list(rollouts)
        entries = []
        for rollout in rollouts:
            task = tasks.get(rollout.task_id)
            if task is None:
                raise BankError(f"task {rollout.task_id} is not a {TRAIN_SPLIT!r}-split task of "
                                "the environment the bank is filled from")
            entries.append(Experience.from_rollout(rollout, task, source,
                                                   self.max_observation_chars))
        result = self.add(entries)
        # The full rollouts of the new entries (token ids, action masks) are what the composer's
        # cold start trains on; they go beside the table once the entries are committed.
        added = {(e.task_id, e.trace) for e in result.added}
        kept = [r for r, e in zip(rollouts, entries) if (e.task_id, e.trace) in added]
        if kept:
            with (self.folder / ROLLOUTS_NAME).open("a") as f:
                for rollout in kept:
                    f.write(json.dumps(rollout.to_dict()) + "\n")
        return result

    def stored_rollouts(self) -> list[Rollout]:
        """The full rollouts behind the entries added with :meth:`add_rollouts` (cold-start data)."""
        path = self.folder / ROLLOUTS_NAME
        if not path.exists():
            return []
        stored = {(e.task_id, e.trace) for e in self._entries}
        rollouts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rollout = Rollout.from_dict(json.loads(line))
            except (ValueError, TypeError, KeyError) as exc:
                raise BankError(f"{path}:{number}: not a rollout record ({exc})") from None
            if (rollout.task_id, rollout.compact_trace(self.max_observation_chars)) in stored:
                rollouts.append(rollout)
        return rollouts


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ----------------------------------------------------------------------------------------------
# Measuring retrieval


def template_of(domain: str, meta: Mapping) -> str:
    """A task's template key (``domain/template``): template names repeat across domains."""
    if "template" not in meta:
        raise BankError("retrieval quality needs tasks whose meta names their template")
    return f"{domain}/{meta['template']}"


def retrieval_quality(bank: ExperienceBank, queries: Sequence[Task], k: int = 3,
                      allow_self_retrieval: bool = False) -> dict:
    """How often retrieval finds the query's own kind of task.

    For each query task (leave-one-out applies), the top ``k`` hits are compared with the
    query's template. Reported: the fraction whose top-1 hit shares the template (and the
    domain), the fraction with a template match anywhere in the top ``k``, the fraction of
    all top-``k`` hits that match, the top-1 rate a uniformly random entry would reach
    (chance) and the fraction of queries whose template the bank holds at all (the ceiling of
    the top-1 rate), overall and per domain.
    """
    if not queries:
        raise BankError("no query tasks")
    if not len(bank):
        raise BankError(f"the bank in {bank.folder} is empty")
    hits = bank.search([t.instruction for t in queries], k, [t.task_id for t in queries],
                       allow_self_retrieval=allow_self_retrieval)
    share = Counter(template_of(e.domain, e.meta) for e in bank.entries)

    def figures(pairs: list[tuple[Task, list[Hit]]]) -> dict:
        top1 = hit_k = precision = domain1 = chance = covered = 0.0
        for task, task_hits in pairs:
            want = template_of(task.domain, task.meta)
            match = [template_of(h.entry.domain, h.entry.meta) == want for h in task_hits]
            top1 += bool(match) and match[0]
            hit_k += any(match)
            precision += sum(match) / k
            domain1 += bool(task_hits) and task_hits[0].entry.domain == task.domain
            chance += share[want] / len(bank)
            covered += share[want] > 0
        n = len(pairs)
        return {"queries": n, "top1_template": top1 / n, f"top{k}_any_template": hit_k / n,
                f"top{k}_precision": precision / n, "top1_domain": domain1 / n,
                "chance_top1_template": chance / n, "template_in_bank": covered / n}

    pairs = list(zip(queries, hits))
    by_domain: dict[str, list] = {}
    for task, task_hits in pairs:
        by_domain.setdefault(task.domain, []).append((task, task_hits))
    result = figures(pairs)
    result["k"] = k
    result["per_domain"] = {d: figures(p) for d, p in sorted(by_domain.items())}
    return result


def retrieve(bank: ExperienceBank, rollouts: Sequence, n_ret: int,
             leave_one_out: bool = True) -> list[list[Hit]]:
    """The ``n_ret`` nearest bank entries for each rollout's task (exactly ``n_ret``, or raise)."""
    hits = bank.search([r.instruction for r in rollouts], n_ret,
                       exclude_task_ids=[r.task_id if leave_one_out else None for r in rollouts])
    for rollout, found in zip(rollouts, hits):
        if len(found) < n_ret:
            raise ValueError(f"the bank returned {len(found)} experiences for task {rollout.task_id}, "
                             f"fewer than n_ret={n_ret}: add more successes to the bank")
    return hits


def retrieve_traces(bank: ExperienceBank, rollouts: Sequence, n_ret: int,
                    leave_one_out: bool = True) -> list[list[str]]:
    """The compact traces of the ``n_ret`` nearest bank entries for each rollout's task."""
    return [[hit.entry.trace for hit in found]
            for found in retrieve(bank, rollouts, n_ret, leave_one_out)]


def random_entries(bank: ExperienceBank, rollouts: Sequence, n_ret: int,
                   seed: str) -> list[list[Experience]]:
    """``n_ret`` visible bank entries drawn at random per rollout, never of the rollout's own task
    (exactly ``n_ret``, or raise). Each rollout's draw is seeded by ``seed`` and its task id alone,
    so it does not depend on the other rollouts of the batch or on how they are split."""
    entries = bank.entries
    drawn = []
    for rollout in rollouts:
        pool = [e for e in entries if e.task_id != rollout.task_id]
        if len(pool) < n_ret:
            raise ValueError(f"the bank holds {len(pool)} experiences of other tasks than "
                             f"{rollout.task_id}, fewer than n_ret={n_ret}: add more successes")
        drawn.append(random.Random(f"{seed}:{rollout.task_id}").sample(pool, n_ret))
    return drawn


def random_traces(bank: ExperienceBank, rollouts: Sequence, n_ret: int,
                  seed: int) -> list[list[str]]:
    """``n_ret`` bank entries drawn at random (never the rollout's own task) per rollout."""
    rng = random.Random(seed)
    entries = bank.entries
    traces = []
    for rollout in rollouts:
        pool = [e for e in rng.sample(entries, min(len(entries), 4 * n_ret))
                if e.task_id != rollout.task_id]
        traces.append([e.trace for e in pool[:n_ret]])
    return traces
