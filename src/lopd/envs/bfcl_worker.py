"""The BFCL child process: executes call strings against the package's API instances and runs the
official checker, for one episode. Protocol: JSON lines on stdin (first the episode, then requests
``{"kind": "exec" | "check", "payload": ...}``), one JSON line answer per request on the original
stdout. Anything the API code prints goes to /dev/null, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = open(os.devnull, "w")
    from bfcl.eval_checker.multi_turn_eval.multi_turn_checker import (
        multi_turn_checker,
        multi_turn_irrelevance_checker,
    )
    from bfcl.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

    setup = json.loads(sys.stdin.readline())
    entry, ground_truth, run_name = setup["entry"], setup["ground_truth"], setup["run_name"]
    long_context = "long_context" in entry["id"] or "composite" in entry["id"]
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["kind"] == "exec":
                results, _ = execute_multi_turn_func_call(
                    [request["payload"]], entry["initial_config"], entry["involved_classes"],
                    run_name, entry["id"], long_context=long_context)
                value = str(results[0])
            elif request["kind"] == "check":
                decoded = request["payload"]
                verdict = multi_turn_irrelevance_checker(decoded, ground_truth)
                if verdict["valid"]:
                    verdict = multi_turn_checker(decoded, ground_truth, entry, entry["id"],
                                                 run_name + "_check")
                value = {"valid": bool(verdict["valid"]),
                         "error": str(verdict.get("error_type", ""))}
            else:
                raise ValueError(f"unknown request {request['kind']!r}")
            answers.write(json.dumps({"status": "ok", "value": value}) + "\n")
        except Exception as exc:  # the checker asserts on some malformed histories
            answers.write(json.dumps({"status": "error",
                                      "value": f"{type(exc).__name__}: {exc}"}) + "\n")


if __name__ == "__main__":
    main()
