"""toolworld: procedurally generated stateful API worlds in the style of EnvScaler.

Four domains (ecommerce, insurance, logistics, healthcare), each a typed in-memory database with
eight tools (look-ups, listings, mutations with preconditions, ``open_ticket``) and eight or nine
task templates. A task needs one to five tool calls. When a precondition fails (a shipped order
cannot be cancelled) the right move is to report it: open a ticket with the reason from the
domain's closed list, so that reporting is verifiable in the final state.

Reward is the fraction of a checklist of state checks that hold at the end: each requested change
(or, for a report, "the entity is unchanged" and "the ticket exists"), plus "no other entity
changed". Every task has a check that fails on the untouched initial state, so an agent that only
answers "Task Completed" never succeeds.

Splits: ``pretrain`` (30,000 tasks by default: the pool for supervised training of the base
model), ``train`` (2,349) and ``eval`` (200). **No template is held out**: every split draws from
every template, but no task instance is in two splits. The instance key is (domain, template,
instruction, oracle solution): two tasks with the same request and the same correct actions are
one instance, whatever their distractor rows. Splits are generated in the order eval, train,
pretrain; each skips the keys of the splits before it and its own duplicates. So ``eval`` depends
only on the seed and its size, ``train`` also on the eval size, and a smaller size gives a prefix
of a larger one. Each task stores its template and a seed in ``meta``; ``reset`` rebuilds the
initial state from those, so tasks survive a round trip through JSONL.

Coded requests (``coded_fraction`` > 0, off by default): some train and eval requests name what
to do only by a code word, and keep nothing but their ids and people's names ("Request cedar: O482,
C384."). A code stands for one template *and* one fixed set of the values the request leaves out
(which city, plan, day, amount...), both drawn from the seed, one code word per template; a task is
coded (with probability ``coded_fraction``) when its values are its code's. Several templates of a
domain share the same ids (cancel, return or change the quantity of order O482 of customer C384?),
so an agent can only guess, while a solved task with the same code shows the procedure and the
values: experience carries what the request does not, the regime the method is for. Pre-training
codes any task, at half that rate (about the share of train and eval tasks coded), with a code word
drawn per task: the base learns to read a coded request from a reference with the same code (see
:func:`lopd.base_model.with_references`), never what a code means. A coded task is the same instance as
its plain form (the key uses the plain request), so splits stay disjoint. (Writing the code into
the plain requests too was tried: the tiny base's copying breaks on unseen words around the
entities; plain success fell from 0.45 to 0.03-0.19.)

Task mix: the domains take turns, and each domain's templates come in proportion to their
weights (single-call templates weigh more), so about 70% of the tasks need one or two tool calls
and the rest three to five; about a third are reports.

The vocabulary is built for a ~1M-parameter model: ids are a letter and three digits, entity
values come from small closed lists, instructions are one sentence and tool results are compact
JSON.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Sequence

from lopd.chat import FINAL_MARKER, Action, FinalAnswer, Malformed, ToolCall
from lopd.envs.environment import Environment, Episode, StepResult, Task, Verdict
from lopd.envs.toolworld import ecommerce, healthcare, insurance, logistics
from lopd.envs.toolworld.core import (
    NAMES,
    NOTHING_ELSE,
    Domain,
    Instance,
    TaskRandom,
    Template,
    ToolError,
    nothing_else_changed,
    snapshot,
)

DOMAINS: dict[str, Domain] = {d.name: d for d in (
    ecommerce.DOMAIN, insurance.DOMAIN, logistics.DOMAIN, healthcare.DOMAIN)}
DEFAULT_SIZES = {"pretrain": 30_000, "train": 2_349, "eval": 200}
# Earlier splits claim instance keys first, so the evaluation set never depends on the others.
GENERATION_ORDER = ("eval", "train", "pretrain")


def system_prompt(domain: Domain) -> str:
    """One sentence: the tools themselves are rendered by the chat template from ``Task.tools``."""
    return (f"You are {domain.label} support agent: use the tools, open a ticket when a request "
            f"is not allowed, and reply {FINAL_MARKER} when done.")


def instance_key(task: Task) -> str:
    """What makes two tasks the same instance: domain, template, request (in its plain form, so a
    coded task is the same instance as its plain twin) and oracle actions."""
    request = task.meta.get("plain_instruction", task.instruction)
    return json.dumps([task.domain, task.meta["template"], request, task.oracle],
                      separators=(",", ":"))


_ID = re.compile(r"[A-Z]\d{3}")
# Code words of coded requests: distinct English words (so that a sentence embedder tells them
# apart) that no template, tool or entity uses.
CODE_WORDS = (
    "amber", "birch", "cobalt", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lotus", "marble", "nectar", "orchid", "pebble", "quartz", "raven", "saffron", "thistle",
    "umber", "velvet", "willow", "yarrow", "zephyr", "acorn", "bramble", "cedar", "dune",
    "ember", "fennel", "glacier", "hazel", "iris", "jasper", "kelp", "lichen", "meadow", "nutmeg",
    "opal", "poppy", "quill")
# The words of the templates' sentences that say what to do (verbs and the nouns around the
# entities); everything else in a request (ids, numbers, names, cities, products, days, plans,
# kinds) is an entity and stays in the coded form.
_REQUEST_WORDS = frozenset("""
    a all an appointment appointments assign available book booked cancel change claim claims
    client courier customer delivered doctor file for hold holder in in-transit move of on open
    order orders patient pay pending plan policy prescription put quantity refill reroute
    rerouted return set shipment shipments the to upgrade wants with city""".split())


def template_codes(seed: int) -> dict[str, str]:
    """``"domain/template"`` -> its code word under environment seed ``seed``."""
    names = sorted(f"{d.name}/{t.name}" for d in DOMAINS.values() for t in d.templates)
    if len(names) > len(CODE_WORDS):
        raise RuntimeError(f"{len(names)} templates but only {len(CODE_WORDS)} code words")
    words = list(CODE_WORDS)
    random.Random(f"toolworld/{seed}/codes").shuffle(words)
    return dict(zip(names, words))


def request_parts(instruction: str) -> tuple[list[str], tuple[str, ...]]:
    """The entities of a plain request: (ids and people's names, in order; the other values, such
    as cities, plans, days, products, amounts, in order)."""
    words = [w for w in re.findall(r"[A-Za-z0-9-]+", instruction) if w.lower() not in _REQUEST_WORDS]
    kept = [w for w in words if _ID.fullmatch(w) or w in NAMES]
    return kept, tuple(w for w in words if w not in kept)


def coded_request(instruction: str, code: str) -> str:
    """``instruction`` as a coded request: the code, then only its ids and names. The procedure
    and every other value (the city, plan, day, amount...) are what the code stands for."""
    kept, _ = request_parts(instruction)
    return f"Request {code}: {', '.join(kept)}."


class _TemplateSchedule:
    """The templates of a domain in proportion to their weights, evenly interleaved (smooth
    weighted round robin), so that even the 200-task eval split covers every template in
    proportion rather than by the luck of random draws."""

    def __init__(self, domain: Domain):
        self.templates = domain.templates
        self.total = sum(t.weight for t in self.templates)
        self.credit = [0.0] * len(self.templates)

    def next(self) -> Template:
        for i, template in enumerate(self.templates):
            self.credit[i] += template.weight
        best = max(range(len(self.templates)), key=self.credit.__getitem__)
        self.credit[best] -= self.total
        return self.templates[best]


class ToolWorldEpisode(Episode):
    """One task running on its own copy of the domain's database."""

    def __init__(self, task: Task, domain: Domain, instance: Instance):
        self.task = task
        self.domain = domain
        self.db = instance.db
        self.checks = instance.checks
        self.initial = snapshot(instance.db)
        self.done = False
        self.final_reward = 0.0

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": system_prompt(self.domain)},
                {"role": "user", "content": self.task.instruction}]

    def step(self, action: Action) -> StepResult:
        if self.done:
            return StepResult(None, self.final_reward, True)
        if isinstance(action, FinalAnswer):
            verdict = self.verify()
            self.done, self.final_reward = True, verdict.reward
            return StepResult(None, verdict.reward, True, {"success": verdict.success})
        if isinstance(action, Malformed):
            return StepResult("Error: " + action.error, 0.0, False, {"error": True})
        if not isinstance(action, ToolCall):
            return StepResult(f"Error: unsupported action {type(action).__name__}", 0.0, False,
                              {"error": True})
        tool = self.domain.tool(action.name)
        if tool is None:
            observation = f"Error: unknown tool {action.name}"
        else:
            try:
                observation = tool(self.db, action.arguments)
            except ToolError as exc:
                observation = f"Error: {exc}"
        return StepResult(observation, 0.0, False,
                          {"tool": action.name, "error": observation.startswith("Error:")})

    def verify(self) -> Verdict:
        final = snapshot(self.db)
        checks = [(c.describe(), c.holds(self.initial, final)) for c in self.checks]
        checks.append((NOTHING_ELSE, nothing_else_changed(self.initial, final, self.checks)))
        passed = sum(ok for _, ok in checks)
        return Verdict(passed / len(checks), passed == len(checks), checks)


class ToolWorld(Environment):
    """The toolworld task family; ``ToolWorld(seed, sizes)`` always gives the same tasks."""

    name = "toolworld"
    splits = ("pretrain", "train", "eval")
    oracle_splits = ("train",)

    def __init__(self, seed: int = 0, sizes: dict[str, int] | None = None,
                 coded_fraction: float = 0.0):
        sizes = dict(sizes or {})
        if not 0.0 <= coded_fraction <= 1.0:
            raise ValueError(f"coded_fraction must be in [0, 1], got {coded_fraction!r}")
        self.coded_fraction = coded_fraction
        self.codes = template_codes(seed)
        # What each train/eval code stands for: its template with one fixed set of the values a
        # coded request leaves out, drawn from the seed.
        self.code_values = {
            f"{d.name}/{t.name}": request_parts(t.build(TaskRandom(
                f"toolworld/{seed}/code/{d.name}/{t.name}")).instruction)[1]
            for d in DOMAINS.values() for t in d.templates}
        for split, size in sizes.items():
            if split not in self.splits:
                raise ValueError(f"unknown toolworld split {split!r}; splits: "
                                 f"{', '.join(self.splits)}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"size of split {split!r} must be a non-negative integer, "
                                 f"got {size!r}")
        self.seed = seed
        self.sizes = {**DEFAULT_SIZES, **sizes}
        # One schema list per domain, shared (read-only) by all of its tasks.
        self._tools = {name: [t.schema() for t in d.tools] for name, d in DOMAINS.items()}
        self._tasks: dict[str, list[Task]] = {}
        self._keys: dict[str, set[str]] = {}

    # ------------------------------------------------------------------------------------------
    # Tasks

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown toolworld split {split!r}; splits: {', '.join(self.splits)}")
        if split not in self._tasks:
            self._generate(split)
        return self._tasks[split]

    def _generate(self, split: str) -> None:
        taken: set[str] = set()
        for earlier in GENERATION_ORDER[:GENERATION_ORDER.index(split)]:
            self.tasks(earlier)
            taken |= self._keys[earlier]
        size = self.sizes[split]
        # A string seed is hashed with SHA-512 by `random`, so the stream is the same in every
        # process (unlike hash()), and each split has its own.
        master = random.Random(f"toolworld/{self.seed}/{split}")
        # Its own stream, so that coding never changes which tasks a split holds.
        coder = random.Random(f"toolworld/{self.seed}/{split}/coded")
        domains = list(DOMAINS.values())
        schedules = {d.name: _TemplateSchedule(d) for d in domains}
        tasks: list[Task] = []
        keys: set[str] = set()
        attempts = 0
        while len(tasks) < size:
            attempts += 1
            if attempts > 2 * size + 1000:
                raise RuntimeError(f"toolworld: only {len(tasks)} distinct {split} tasks after "
                                   f"{attempts} attempts; the templates cannot fill {size}")
            domain = domains[len(tasks) % len(domains)]
            template = schedules[domain.name].next()
            task_seed = master.getrandbits(48)
            instance = template.build(TaskRandom(task_seed))
            meta = {"template": template.name, "variant": instance.variant, "seed": task_seed}
            instruction = instance.instruction
            name = f"{domain.name}/{template.name}"
            # Pre-training codes any task, at half the rate: about the share of train and eval
            # tasks that get coded (about half of them have their code's values).
            share = self.coded_fraction / 2 if split == "pretrain" else self.coded_fraction
            if share and coder.random() < share and (
                    split == "pretrain"
                    or request_parts(instance.instruction)[1] == self.code_values[name]):
                # Pre-training codes are drawn per task, so the base can learn to read a code's
                # meaning from a reference but never the meaning of a code.
                code = coder.choice(CODE_WORDS) if split == "pretrain" else self.codes[name]
                instruction = coded_request(instance.instruction, code)
                meta.update(code=code, plain_instruction=instance.instruction)
            task = Task(task_id=f"toolworld/{domain.name}/{split}/{len(tasks):05d}",
                        env=self.name, split=split, domain=domain.name,
                        instruction=instruction, tools=self._tools[domain.name],
                        oracle=instance.calls + [{"answer": FINAL_MARKER}], meta=meta)
            key = instance_key(task)
            if key in taken or key in keys:
                continue
            keys.add(key)
            tasks.append(task)
        self._tasks[split], self._keys[split] = tasks, keys

    # ------------------------------------------------------------------------------------------
    # Episodes

    def reset(self, task: Task) -> ToolWorldEpisode:
        domain = DOMAINS.get(task.domain)
        if domain is None:
            raise ValueError(f"task {task.task_id}: unknown toolworld domain {task.domain!r}; "
                             f"domains: {', '.join(DOMAINS)}")
        instance = domain.template(task.meta["template"]).build(TaskRandom(task.meta["seed"]))
        if "code" in task.meta:
            instance.instruction = coded_request(instance.instruction, task.meta["code"])
        if instance.instruction != task.instruction:
            raise ValueError(f"task {task.task_id} does not match this version of toolworld "
                             "(its seed rebuilds a different task); regenerate the tasks")
        return ToolWorldEpisode(task, domain, instance)

    def transcript(self, task: Task) -> list[dict]:
        """The oracle conversation of ``task``: system, user, then assistant tool calls with the
        real tool results, and the final answer. Render it with ``tools=task.tools``."""
        episode = self.reset(task)
        messages = episode.messages()
        result = None
        for action in task.oracle:
            if "name" in action:
                call = ToolCall(action["name"], action["arguments"])
                result = episode.step(call)
                messages += [{"role": "assistant", "content": call.to_text()},
                             {"role": "tool", "content": result.observation}]
            else:
                messages.append({"role": "assistant", "content": action["answer"]})
                result = episode.step(FinalAnswer(action["answer"]))
        if result is None or not result.done or result.reward != 1.0:
            raise RuntimeError(f"the oracle of {task.task_id} does not solve it")
        return messages

    def transcripts(self, tasks: str | Sequence[Task], n: int | None = None) -> list[list[dict]]:
        """Oracle conversations of the first ``n`` (default: all) of ``tasks``, a split name or
        a list of tasks; conversation i belongs to task i."""
        if isinstance(tasks, str):
            tasks = self.tasks(tasks)
        return [self.transcript(task) for task in tasks[:n]]

    def stats(self, split: str) -> dict:
        """Counts of ``split``'s tasks per domain, template, outcome and oracle tool calls."""
        tasks = self.tasks(split)
        return {
            "tasks": len(tasks),
            "domains": dict(Counter(t.domain for t in tasks)),
            "templates": dict(Counter(f"{t.domain}/{t.meta['template']}" for t in tasks)),
            "reports": sum(t.meta["variant"] != "ok" for t in tasks),
            "coded": sum("code" in t.meta for t in tasks),
            "oracle_calls": dict(sorted(Counter(len(t.oracle) - 1 for t in tasks).items())),
        }


__all__ = ["CODE_WORDS", "DEFAULT_SIZES", "DOMAINS", "ToolWorld", "ToolWorldEpisode",
           "coded_request", "instance_key", "request_parts", "system_prompt", "template_codes"]
