"""Does another task's experience tell the self-teacher anything? A diagnostic, not a test.

The base acts on validation tasks carved from the end of the training split (sampled like the
bank's rollouts; the eval split is never touched, since this diagnostic informs choices); their
entries are withheld from the bank, so no reference is the task's own or another validation
task's. On the base's successes the frozen teacher's NLL per action token is measured with
references of four kinds, as text and as the composer's latents:

* none — the teacher reads the rollout as the student did;
* retrieved — the bank's ``n_ret`` nearest entries (what LOPD uses);
* same template — ``n_ret`` bank entries of the task's own template, drawn at random (perfect
  retrieval, for environments whose tasks carry ``meta["template"]``);
* other template — ``n_ret`` entries of other templates (a wrong reference).

It also prints how many retrieved entries share the query's template. If even same-template text
does not lower the NLL below "none", the environment's experience carries nothing the base lacks and
no composer can make the teacher privileged.

    python benchmarks/reference_value.py --bank runs/bank-tiny --composer runs/composer-tiny
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from lopd import policies, stages
from lopd.algorithms import cold_start as cs
from lopd.composer import Composer
from lopd.config import load_config
from lopd.experience import ExperienceBank
from lopd.latent import ReferenceFormat
from lopd.tables import format_table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank", required=True)
    parser.add_argument("--composer", required=True)
    parser.add_argument("--model", default="toolworld-1m")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tasks", type=int, default=200,
                        help="validation tasks (the last ones of the training split) to act on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--acting", choices=["base", "oracle"], default="base",
                        help="whose validation successes are scored: the base's sampled ones (what "
                        "the cold start measures), or the oracle's on every task (no selection: "
                        "the base's own successes are where it already knew what to do)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override, e.g. "
                        "env.coded_fraction=1.0")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.run.num_threads)
    env = stages.get_env(cfg)
    train = env.tasks("train")
    if not 0 < args.tasks < len(train):
        parser.error(f"--tasks {args.tasks}: choose 1..{len(train) - 1} of the {len(train)} "
                     "training tasks")
    tasks = train[-args.tasks:]
    template = {t.task_id: t.meta.get("template") for t in tasks}
    model, tokenizer = stages.load_model(cfg, args.model)
    policy = (policies.OraclePolicy() if args.acting == "oracle"
              else stages.model_policy(cfg, model, tokenizer, cfg.rollout.temperature, args.seed))
    held = [r for r in stages.run_episodes(cfg, env, tasks, policy, tokenizer) if r.success]
    code = {t.task_id: t.meta["code"] for t in tasks if "code" in t.meta}
    coded = set(code)
    n_ret = cfg.bank.n_ret
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, stages.open_bank(cfg, args.bank) as source, \
            ExperienceBank.open(source.snapshot(Path(tmp) / "bank"),
                                embedder=source.embedder) as bank:
        bank.withhold(t.task_id for t in tasks)   # a copy: the given bank is not changed
        composer = Composer.load(args.composer, model, tokenizer)
        fmt = ReferenceFormat.for_tokenizer(tokenizer)
        hits = bank.search([r.instruction for r in held], n_ret,
                           exclude_task_ids=[r.task_id for r in held])
        shared = sum(h.entry.meta.get("template") == template[r.task_id]
                     for r, found in zip(held, hits) for h in found)
        # A coded request's "same template" references are entries with its code (the same
        # template and values, coded alike); a plain request's are plain entries of its template.
        by_template: dict = {}
        for entry in bank.entries:
            by_template.setdefault((entry.meta.get("template"), entry.meta.get("code")),
                                   []).append(entry)
        retrieved = [[h.entry.trace for h in found] for found in hits]
        same, other = [], []
        for r, found in zip(held, retrieved):
            key = (template[r.task_id], code.get(r.task_id))
            own = [e for e in by_template.get(key, []) if e.task_id != r.task_id]
            if len(own) < n_ret:   # too few stored successes with this code: add plain ones
                own += [e for e in by_template.get((key[0], None), []) if e.task_id != r.task_id]
            if len(own) >= n_ret:
                same.append([e.trace for e in rng.sample(own, n_ret)])
            elif own:              # a template the bank barely has: repeat what there is
                same.append([e.trace for e in rng.choices(own, k=n_ret)])
            else:                  # none at all: the retrieved entries stand in
                same.append(found)
            rest = [e for k, es in by_template.items() if k[0] != key[0] for e in es]
            other.append([e.trace for e in rng.sample(rest, n_ret)])
        kinds = {"retrieved": retrieved, "same template": same, "other template": other}
        groups = {"all": list(range(len(held)))}
        if coded:
            groups["coded"] = [i for i, r in enumerate(held) if r.task_id in coded]
            groups["plain"] = [i for i, r in enumerate(held) if r.task_id not in coded]
        tables = {}
        for group, rows in groups.items():
            if not rows:
                continue
            part = [held[i] for i in rows]
            none = cs.mean_teacher_nll(composer, part, fmt, None, "none")
            table = {"none": {"text": none, "latents": none}}
            for name, traces in kinds.items():
                chosen = [traces[i] for i in rows]
                table[name] = {"text": cs.mean_teacher_nll(composer, part, fmt, chosen, "text"),
                               "latents": cs.mean_teacher_nll(composer, part, fmt, chosen,
                                                              "latent")}
            tables[group] = (len(rows), table)
    who = "the oracle" if args.acting == "oracle" else args.model
    print(f"{len(held)} validation successes of {who}; retrieved entries sharing the query's "
          f"template: {shared}/{n_ret * len(held)}")
    for group, (n, table) in tables.items():
        print()
        print(format_table(["reference", "NLL, as text", "NLL, as latents", "text vs none"],
                           [[k, f"{v['text']:.5f}", f"{v['latents']:.5f}",
                             f"{v['text'] - table['none']['text']:+.5f}"]
                            for k, v in table.items()],
                           title=f"{group} requests ({n} successes)" if coded else None))
    table = tables["all"][1]
    if args.json_path:
        write_json(args.json_path, {"settings": vars(args), "held_out_successes": len(held),
                                    "retrieved_sharing_template": shared,
                                    "retrieved_total": n_ret * len(held),
                                    "nll_per_action_token": table,
                                    "by_request_kind": {g: {"successes": n, **t}
                                                        for g, (n, t) in tables.items()
                                                        if g != "all"}})


if __name__ == "__main__":
    main()
