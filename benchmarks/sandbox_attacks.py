"""What the sandbox's judging gives answers that compute nothing, and what hostile answers cost the
trusted parent.

    python benchmarks/sandbox_attacks.py --json docs/results/code/sandbox_attacks.json

1. codeworld, every eval task, ``reward: fraction``: answers that never compute — the example's
   output for every input; the example's output for the example's input, else an empty value of
   its type; the example's output for its input, else an exception — and, with
   ``env.code_attempts`` 4, an answer that copies every expected value the feedback shows into a
   lookup table for its next attempt. Each is scored as the environment scores it, and also as
   the plain fraction of hidden tests passed (without the rule that gives 0 to an answer returning
   one value on every hidden test).
2. The parent's CPU time per answer (``getrusage``, this process) for a channel value that is a
   set and a dict of 30,000 integers that all hash alike, written on the channel by the answer
   itself, for an answer that prints without end for its whole wall clock (rewinding its output
   when the file-size limit stops it), and, beside them, for
   building that set in this process (what a parent that decoded it would pay).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import time
from concurrent.futures import ThreadPoolExecutor

from lopd.chat import FinalAnswer
from lopd.envs import sandbox
from lopd.envs.codegen import fence
from lopd.envs.codeworld import CodeWorld


def _empty_like(value) -> str:
    return repr(type(value)()) if type(value) in (list, dict, str, int, float, bool) else "None"


def answers(task) -> dict[str, str]:
    example, name = task.meta["tests"][-1], task.meta["entry_point"]
    known = f"    if list(args) == {example['args']!r}:\n        return {example['expected']!r}\n"
    return {
        "example's output for every input": f"def {name}(*args):\n"
                                            f"    return {example['expected']!r}\n",
        "example's output, else an empty value": f"def {name}(*args):\n{known}"
                                                 f"    return {_empty_like(example['expected'])}\n",
        "example's output, else an exception": f"def {name}(*args):\n{known}"
                                               "    raise ValueError\n",
    }


FEEDBACK = re.compile(r"^(?:Example )?(\w+)\((.*)\) returned .*, expected (.*?)\.?$", re.M)


def as_python(shown: str) -> str:
    """An expected value as feedback shows it (a Python literal, or JSON) as Python source."""
    try:
        return repr(json.loads(shown))
    except ValueError:
        return shown


def feedback_reader(env: CodeWorld, task):
    """Four attempts, each answering every expected value the feedback showed so far."""
    episode, table = env.reset(task), {}
    for _ in range(env.attempts):
        lines = "".join(f"    if args == ({args},):\n        return {expected}\n"
                        for args, expected in table.items())
        result = episode.step(FinalAnswer(fence(f"def {task.meta['entry_point']}(*args):\n"
                                                f"{lines}    return None\n")))
        if result.done:
            break
        for _, args, expected in FEEDBACK.findall(result.observation):
            table[args] = as_python(expected)
    return episode


def scores(episodes) -> dict:
    rewards = [e.verify().reward for e in episodes]
    plain = [sum(o.passed for o in e.outcomes) / len(e.tests) for e in episodes]
    return {"tasks": len(episodes), "mean_reward": round(sum(rewards) / len(rewards), 4),
            "mean_fraction_passed": round(sum(plain) / len(plain), 4),
            "tasks_with_credit": sum(r > 0 for r in rewards)}


def exploit_table(workers: int) -> dict:
    env = CodeWorld()
    tasks = env.tasks("eval")
    figures = {}
    for kind in answers(tasks[0]):
        def play(task, kind=kind):
            episode = env.reset(task)
            episode.step(FinalAnswer(fence(answers(task)[kind])))
            return episode

        with ThreadPoolExecutor(workers) as pool:
            figures[kind] = scores(list(pool.map(play, tasks)))
    multi = CodeWorld(attempts=4)
    with ThreadPoolExecutor(workers) as pool:
        figures["feedback copied, 4 attempts"] = scores(list(pool.map(
            lambda t: feedback_reader(multi, t), multi.tasks("eval"))))
    return figures


def cpu_seconds(fn) -> tuple[object, float]:
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


COLLIDING = 30_000


def forged(shape: str) -> str:
    """An answer that writes the channel's protocol itself, call 0's value a set or dict of ints
    that all hash alike (multiples of 2**61 - 1)."""
    item = "str(i * (2**61 - 1))" if shape == "set" else "'[' + str(i * (2**61 - 1)) + ', 1]'"
    return ("import os, sys\nfd = int(sys.argv[2])\n"
            "def put(text):\n    data = (text + '\\n').encode()\n"
            "    while data:\n        data = data[os.write(fd, data):]\n"
            "put('{\"ready\": \"\", \"network\": \"isolated\"}')\nput('{\"begin\": 0}')\n"
            f"items = ', '.join({item} for i in range({COLLIDING}))\n"
            f"put('{{\"i\": 0, \"value\": {{\"$\": \"{shape}\", \"v\": [' + items + ']}}}}')\n"
            "os._exit(0)\n")


def parent_costs() -> dict:
    limits = sandbox.Limits(wall_seconds=10, test_seconds=5, cpu_seconds=10, memory_mb=512)
    test = [{"call": "f()", "expected": 0}]
    figures = {}
    for shape in ("set", "dict"):
        report, cpu = cpu_seconds(lambda shape=shape: sandbox.run(forged(shape), test, limits))
        assert report.outcomes[0].error == "wrong value", report.outcomes
        figures[f"colliding {shape} of {COLLIDING:,} ints"] = round(cpu, 3)
    # Past the file-size limit a write fails; rewinding lets the flood go on to the wall clock.
    flood = ("import os\nwhile True:\n    try:\n        os.write(1, b'x' * 65536)\n"
             "    except OSError:\n        os.lseek(1, 0, 0)\n")
    start = time.perf_counter()
    report, cpu = cpu_seconds(lambda: sandbox.run(flood, test, limits))
    figures[f"print flood for {time.perf_counter() - start:.1f} s"] = round(cpu, 3)
    keys = [i * (2**61 - 1) for i in range(COLLIDING)]
    _, cpu = cpu_seconds(lambda: set(keys))
    figures["building that set in the parent (not done; for scale)"] = round(cpu, 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    exploits = exploit_table(args.workers)
    print(f"{'codeworld eval, answers that compute nothing':48} {'reward':>7} "
          f"{'fraction passed':>16} {'tasks with credit':>18}")
    for kind, row in exploits.items():
        print(f"{kind:48} {row['mean_reward']:>7.4f} {row['mean_fraction_passed']:>16.4f} "
              f"{row['tasks_with_credit']:>13}/{row['tasks']}")
    costs = parent_costs()
    print(f"\n{'parent CPU per answer':60} {'seconds':>8}")
    for kind, seconds in costs.items():
        print(f"{kind:60} {seconds:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"exploits": exploits, "parent_cpu_seconds": costs}, f, indent=1)


if __name__ == "__main__":
    main()
