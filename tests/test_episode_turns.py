"""benchmarks/episode_turns.py: the counts of hand-written episodes, and a bad file named."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "episode_turns.py"

EPISODES = [
    {"task_id": "t0", "finish_reason": "answer", "turns": [
        {"kind": "tool_call", "action": "...", "call": {"name": "ls", "arguments": {}},
         "observation": "a.txt"},
        {"kind": "tool_call", "action": "...", "call": {"name": "ls", "arguments": {}},
         "observation": "a.txt"},
        {"kind": "tool_call", "action": "...", "call": {"name": "cat", "arguments": {"f": "b"}},
         "observation": "Error: no such file"},
        {"kind": "answer", "action": "Done. Task Completed.", "call": None, "observation": None}]},
    {"task_id": "t1", "finish_reason": "max_length", "turns": [
        {"kind": "malformed", "action": "run ls", "call": None,
         "observation": "Error: no tool call and no 'Task Completed'"},
        {"kind": "answer", "action": "The error says 'Task Completed' is missing", "call": None,
         "observation": "next request"},
        {"kind": "malformed", "action": "run ls", "call": None,
         "observation": "Error: no tool call and no 'Task Completed'"}]},
]


def run(path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args],
                          capture_output=True, text=True, timeout=60)


def test_counts_turns_calls_answers_and_replies(tmp_path):
    path = tmp_path / "episodes.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(e) + "\n" for e in EPISODES)
    out = run(path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # turns, tool_calls, call_errors, answers, answers ending with the marker, malformed, code,
    # distinct calls
    assert lines[1] == "t0  answer  4  3  1  1  1  0  0  2"
    assert lines[2] == "t1  max_length  3  0  0  1  0  2  0  0"
    assert lines[3] == ("2 episodes: turns 7, tool_calls 3, call_errors 1, answers 2, "
                        "answers_ending_with_marker 1, malformed 2, code 0, distinct_calls 2")
    assert lines[4] == "  2 malformed turns answered \"Error: no tool call and no 'Task Completed'\""


def test_a_line_that_is_not_an_episode_is_named(tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_text(json.dumps(EPISODES[0]) + "\n" + json.dumps({"task_id": "x"}) + "\n")
    out = run(path, "--quiet")
    assert out.returncode == 1
    assert out.stderr.strip() == f"{path}:2: not an episode record with turns"
