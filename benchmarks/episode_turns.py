"""What an agent did, turn by turn, in episodes written by ``lopd eval --episodes``.

Per episode and in all: how many turns parsed as tool calls, final answers and malformed text;
how many tool calls the environment answered with an error; how many answers end with the final
marker and how many only contain it (quoting it, say); and the environment's most frequent replies
to malformed turns. Reads JSONL, or JSONL compressed with gzip (``.gz``).

    python benchmarks/episode_turns.py EPISODES.jsonl [--top 5] [--quiet]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys

from lopd.chat import FINAL_MARKER


def read(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        episodes = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                episode = json.loads(line)
                episode["turns"]
            except (ValueError, KeyError, TypeError):
                sys.exit(f"{path}:{number}: not an episode record with turns")
            episodes.append(episode)
    return episodes


def count(episode: dict) -> collections.Counter:
    turns = episode["turns"]
    kinds = collections.Counter(t["kind"] for t in turns)
    calls = [t for t in turns if t["kind"] == "tool_call"]
    answers = [t["action"] for t in turns if t["kind"] == "answer"]
    return collections.Counter(
        turns=len(turns), tool_calls=kinds["tool_call"], answers=kinds["answer"],
        malformed=kinds["malformed"], code=kinds["code"],
        call_errors=sum(str(t["observation"] or "").startswith("Error") for t in calls),
        answers_ending_with_marker=sum(a.rstrip().rstrip(".").endswith(FINAL_MARKER)
                                       for a in answers),
        distinct_calls=len({json.dumps(t["call"], sort_keys=True) for t in calls}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("episodes")
    p.add_argument("--top", type=int, default=5, help="most frequent replies to malformed turns")
    p.add_argument("--quiet", action="store_true", help="totals only")
    args = p.parse_args(argv)
    episodes = read(args.episodes)
    total = collections.Counter()
    replies = collections.Counter()
    fields = ("turns", "tool_calls", "call_errors", "answers", "answers_ending_with_marker",
              "malformed", "code", "distinct_calls")
    if not args.quiet:
        print("task  ending  " + "  ".join(fields))
    for episode in episodes:
        counts = count(episode)
        total.update(counts)
        replies.update(str(t["observation"] or "")[:80] for t in episode["turns"]
                       if t["kind"] == "malformed")
        if not args.quiet:
            print(f"{episode['task_id']}  {episode['finish_reason']}  "
                  + "  ".join(str(counts[f]) for f in fields))
    print(f"{len(episodes)} episodes: " + ", ".join(f"{f} {total[f]}" for f in fields))
    for reply, n in replies.most_common(args.top):
        print(f"  {n} malformed turns answered {reply!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
