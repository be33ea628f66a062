"""BFCL-v3 multi-turn, offline: the Berkeley Function-Calling Leaderboard's stateful tool-use tasks.

The data (questions, initial states, ground truth), the executable API classes (GorillaFileSystem,
TwitterAPI, TradingBot, TravelAPI, VehicleControlAPI, MessageAPI, TicketAPI, MathAPI) and the
official multi-turn checker ship in the PyPI package ``nvidia-bfcl`` (install it with ``--no-deps``;
``make`` does). This adapter runs any lopd agent through our own loop:

* the first user turn opens the episode; a final answer ("Task Completed") ends a user turn and the
  next user message comes back as the observation; at most ``max_steps_per_turn`` actions per user
  turn (default 40: BFCL caps a turn at 20 model responses, each of which may hold several parallel
  calls; here a message holds one call, and the longest ground-truth turn has 34 calls);
* tool calls are validated against the converted function docs (as for every environment), turned
  into a call string from the *parsed* name and JSON arguments (Python literals via ``repr``, so no
  model text is ever evaluated as code), and executed against the package's API instances;
* miss_func: the held-back functions are not callable until their turn, whose user message reveals
  their docs; miss_param and the irrelevant turns are scored by the official checker;
* reward = 1 when the official checker (irrelevance check, then state and execution-result checks
  after every turn) accepts the whole episode, else 0.

Isolation: the API classes and the checker ``eval`` call strings and keep instances in module
globals, so every episode runs them in its own child process (a fresh interpreter, ``python -m
lopd.envs.bfcl_worker``) under a fresh run name; the parent only exchanges JSON lines with it.
"""

from __future__ import annotations

import ast
import json
import uuid
from functools import cache
from importlib import resources

from lopd.chat import FINAL_MARKER, Action, FinalAnswer, Malformed, ToolCall
from lopd.envs.environment import Environment, Episode, StepResult, Task, Verdict

SUBSETS = ("base", "miss_func", "miss_param", "long_context")
DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control",
}
SYSTEM_PROMPT = ("You are an assistant that acts by calling functions. Make one function call per "
                 f"message. When a request is done, or cannot be done, answer in text ending with "
                 f"'{FINAL_MARKER}'.")
REVEAL = "I have updated some more functions you can choose from: {docs}. What about now?"
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def _require_package():
    import importlib.util

    if importlib.util.find_spec("bfcl") is None:
        raise ImportError("BFCL needs the package nvidia-bfcl: pip install --no-deps "
                          "nvidia-bfcl==26.3 (a full install pulls a CUDA torch); `make` installs "
                          "it")


def _data_text(name: str) -> str:
    return resources.files("bfcl").joinpath("data", name).read_text()


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in _data_text(name).splitlines() if line.strip()]


def _convert(schema):
    """BFCL's parameter schema (types dict, float, tuple, any) as JSON schema."""
    if isinstance(schema, list):
        return [_convert(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type":
            kind = _TYPES.get(value, value)
            if kind is not None:
                out["type"] = kind
        elif key in ("properties",):
            out[key] = {k: _convert(v) for k, v in value.items()}
        elif key == "items":
            out[key] = _convert(value)
        elif key in ("description", "required", "enum", "default"):
            out[key] = value
    return out


@cache
def function_docs(class_name: str) -> tuple[dict, ...]:
    """The class's functions as tool schemas (HF/OpenAI format), in the package's order."""
    docs = _jsonl(f"multi_turn_func_doc/{DOC_FILES[class_name]}.json")
    return tuple({"type": "function", "function": {
        "name": d["name"], "description": d["description"],
        "parameters": _convert(d["parameters"])}} for d in docs)


def _untyped(tool: dict) -> dict:
    """``tool`` with its parameters' names and required list only."""
    params = tool["function"]["parameters"]
    return {"type": "function", "function": {
        "name": tool["function"]["name"],
        "parameters": {"type": "object", "properties": {k: {} for k in params.get("properties", {})},
                       "required": list(params.get("required", []))}}}


def _parse_call(text: str, tools: dict[str, dict]) -> dict:
    """A ground-truth call string (``f(1, b='x')``) as ``{"name", "arguments"}``: positional
    arguments get the parameter names of the function's docs, in order."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a function call: {text!r}")
    name = node.func.id
    params = list(tools[name]["function"]["parameters"].get("properties", {}))
    arguments = {params[i]: ast.literal_eval(arg) for i, arg in enumerate(node.args)}
    arguments.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return {"name": name, "arguments": arguments}


def call_string(call: ToolCall) -> str:
    """The Python call the API executes: the validated name, every argument a literal."""
    if not call.name.isidentifier():
        raise ValueError(f"not a function name: {call.name!r}")
    args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items() if k.isidentifier())
    return f"{call.name}({args})"


# ----------------------------------------------------------------------------------------------
# The child process: API instances and the checker live only there (``python -m
# lopd.envs.bfcl_worker``); the parent sends it JSON lines and reads JSON lines back.


class _Worker:
    def __init__(self, entry: dict, ground_truth: list[list[str]]):
        import subprocess
        import sys

        self._process = subprocess.Popen(
            [sys.executable, "-m", "lopd.envs.bfcl_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._send({"entry": entry, "ground_truth": ground_truth,
                    "run_name": f"lopd_{uuid.uuid4().hex}"})

    def _send(self, message: dict) -> None:
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def ask(self, kind: str, payload):
        """The worker's answer to one request; RuntimeError when it failed or died."""
        try:
            self._send({"kind": kind, "payload": payload})
            line = self._process.stdout.readline()
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"the BFCL worker is gone ({exc})") from None
        if not line:
            raise RuntimeError(f"the BFCL worker exited (code {self._process.poll()})")
        reply = json.loads(line)
        if reply["status"] != "ok":
            raise RuntimeError(reply["value"])
        return reply["value"]

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.close()
                self._process.wait(timeout=5)
            except Exception:
                self._process.kill()
                self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            try:
                stream.close()
            except Exception:
                pass


class BFCLEpisode(Episode):
    def __init__(self, task: Task, entry: dict, ground_truth: list[list[str]],
                 max_steps_per_turn: int):
        self.task = task
        self.entry = entry
        self.ground_truth = ground_truth
        self.max_steps = max_steps_per_turn
        self.turn = 0
        self.steps_in_turn = 0
        self.decoded: list[list[list[str]]] = [[]]
        self.done = False
        self._held_back = {int(k): v for k, v in entry.get("missed_function", {}).items()}
        # What the agent may call: every function of the involved classes (as in BFCL's own
        # harness, a held-back function executes if called; its doc is only shown at its turn),
        # checked for names and required arguments but not for types (BFCL's own ground truth
        # passes a string where a doc says integer).
        self._tools = [_untyped(t) for c in entry["involved_classes"] for t in function_docs(c)]
        self._worker = _Worker(entry, ground_truth)
        self._verdict: Verdict | None = None

    @property
    def tools(self) -> list[dict]:
        return self._tools

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": self.entry["question"][0][0]["content"]}]

    def _ask(self, kind: str, payload):
        return self._worker.ask(kind, payload)

    def _next_turn(self) -> StepResult:
        self.turn += 1
        self.steps_in_turn = 0
        if self.turn >= len(self.entry["question"]):
            verdict = self.verify()
            return StepResult(None, verdict.reward, True, {"success": verdict.success})
        self.decoded.append([])
        revealed = self._held_back.get(self.turn, [])
        question = self.entry["question"][self.turn]
        if revealed:
            docs = [t["function"] for c in self.entry["involved_classes"]
                    for t in function_docs(c) if t["function"]["name"] in revealed]
            text = REVEAL.format(docs=json.dumps(docs))
        else:
            text = question[0]["content"] if question else REVEAL.format(docs="[]")
        return StepResult(text, 0.0, False, {"role": "user"})

    def step(self, action: Action) -> StepResult:
        if self.done:
            return StepResult(None, self.verify().reward, True)
        if isinstance(action, FinalAnswer):
            return self._next_turn()
        if isinstance(action, Malformed):
            result = StepResult("Error: " + action.error, 0.0, False, {"error": True})
        else:
            call = call_string(action)
            self.decoded[-1].append([call])
            try:
                observation = self._ask("exec", call)
            except RuntimeError as exc:
                observation = f"Error during execution: {exc}"
            result = StepResult(str(observation), 0.0, False)
        self.steps_in_turn += 1
        if self.steps_in_turn >= self.max_steps:
            return self._next_turn()
        return result

    def verify(self) -> Verdict:
        if self._verdict is not None:
            return self._verdict
        decoded = self.decoded + [[] for _ in range(len(self.ground_truth) - len(self.decoded))]
        try:
            outcome = self._ask("check", decoded)
            valid, error = outcome["valid"], outcome["error"]
        except RuntimeError as exc:
            valid, error = False, f"checker: {exc}"
        self.done = True
        self._verdict = Verdict(float(valid), valid, [("official multi-turn checker" +
                                                       (f" ({error})" if error else ""), valid)])
        self.close()
        return self._verdict

    def close(self) -> None:
        self._worker.close()


class BFCL(Environment):
    """BFCL-v3 multi-turn. Splits: one per subset (200 tasks each) and ``eval`` = all four,
    interleaved task by task, so that its first N tasks hold N/4 of each subset.

    ``seed`` and ``sizes`` are accepted for the common environment signature and ignored: the
    benchmark is fixed."""

    name = "bfcl"
    splits = (*SUBSETS, "eval")

    def __init__(self, seed: int = 0, sizes: dict | None = None, max_steps_per_turn: int = 40):
        _require_package()
        self.max_steps_per_turn = max_steps_per_turn
        # The longest task has 9 user turns; the agent loop stops an episode after this many actions.
        self.max_episode_turns = 10 * max_steps_per_turn
        self._entries: dict[str, tuple[dict, list[list[str]]]] = {}

    @cache
    def _subset(self, subset: str) -> tuple[Task, ...]:
        entries = _jsonl(f"BFCL_v3_multi_turn_{subset}.json")
        answers = {a["id"]: a["ground_truth"] for a in _jsonl(
            f"possible_answer/BFCL_v3_multi_turn_{subset}.json")}
        tasks = []
        for entry in entries:
            every = [t for c in entry["involved_classes"] for t in function_docs(c)]
            by_name = {t["function"]["name"]: t for t in every}
            hidden = {n for names in entry.get("missed_function", {}).values() for n in names}
            tools = [t for t in every if t["function"]["name"] not in hidden]
            ground_truth = answers[entry["id"]]
            oracle = []
            for turn in ground_truth:
                oracle += [_parse_call(call, by_name) for call in turn]
                oracle.append({"answer": FINAL_MARKER})
            task = Task(task_id=entry["id"], env=self.name, split=subset, domain=subset,
                        instruction=entry["question"][0][0]["content"], tools=tools, oracle=oracle,
                        meta={"involved_classes": entry["involved_classes"]})
            self._entries[entry["id"]] = (entry, ground_truth)
            tasks.append(task)
        return tuple(tasks)

    def tasks(self, split: str) -> list[Task]:
        if split == "eval":
            # Interleaved (base 0, miss_func 0, miss_param 0, long_context 0, base 1, ...): the
            # first N tasks of the split cover the four subsets evenly.
            return [t for group in zip(*(self._subset(s) for s in SUBSETS)) for t in group]
        if split not in SUBSETS:
            raise ValueError(f"BFCL has no split {split!r}; splits: {', '.join(self.splits)}")
        return list(self._subset(split))

    def reset(self, task: Task) -> Episode:
        if task.task_id not in self._entries:
            self._subset(task.split)
        entry, ground_truth = self._entries[task.task_id]
        return BFCLEpisode(task, entry, ground_truth, self.max_steps_per_turn)
