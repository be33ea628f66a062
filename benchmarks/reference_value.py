"""Does another task's experience tell the self-teacher anything? A diagnostic, not a test.

The base acts on the held-out tasks (sampled like the bank's rollouts); on its successes the frozen
teacher's NLL per action token is measured with references of four kinds, as text and as the
composer's latents:

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

import torch

from lopd import agent, models
from lopd.algorithms import cold_start as cs
from lopd.composer import Composer
from lopd.config import load_config
from lopd.envs import get_env
from lopd.experience import ExperienceBank
from lopd.latent import ReferenceFormat
from lopd.report import format_table, write_json
from lopd.rollout import SamplingParams, TransformersEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank", required=True)
    parser.add_argument("--composer", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tasks", type=int, default=200, help="held-out tasks to act on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    cfg = load_config(args.config)
    torch.set_num_threads(cfg.run.num_threads)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    tasks = env.tasks("eval")[:args.tasks]
    template = {t.task_id: t.meta.get("template") for t in tasks}
    model, tokenizer = models.load_model(args.model)
    model.eval()
    engine = TransformersEngine(model, tokenizer)
    sampling = SamplingParams.from_config(cfg.rollout, cfg.rollout.temperature, args.seed)
    policy = agent.ModelPolicy(engine, tokenizer, sampling)
    held = [r for r in agent.rollout_episodes(env, tasks, policy, tokenizer, cfg.rollout)
            if r.success]
    n_ret = cfg.bank.n_ret
    rng = random.Random(args.seed)
    with ExperienceBank.open(args.bank) as bank:
        composer = Composer.load(args.composer, model, tokenizer)
        fmt = ReferenceFormat.for_tokenizer(tokenizer)
        hits = bank.search([r.instruction for r in held], n_ret,
                           exclude_task_ids=[r.task_id for r in held])
        shared = sum(h.entry.meta.get("template") == template[r.task_id]
                     for r, found in zip(held, hits) for h in found)
        by_template: dict = {}
        for entry in bank.entries:
            by_template.setdefault(entry.meta.get("template"), []).append(entry)
        same, other = [], []
        for r in held:
            own = [e for e in by_template.get(template[r.task_id], []) if e.task_id != r.task_id]
            rest = [e for t, es in by_template.items() if t != template[r.task_id] for e in es]
            same.append([e.trace for e in rng.sample(own, min(n_ret, len(own)))])
            other.append([e.trace for e in rng.sample(rest, n_ret)])
        kinds = {"retrieved": [[h.entry.trace for h in found] for found in hits],
                 "same template": same, "other template": other}
        none = cs.mean_teacher_nll(composer, held, fmt, None, "none")
        table = {"none": {"text": none, "latents": none}}
        for name, traces in kinds.items():
            table[name] = {"text": cs.mean_teacher_nll(composer, held, fmt, traces, "text"),
                           "latents": cs.mean_teacher_nll(composer, held, fmt, traces, "latent")}
    print(f"{len(held)} held-out successes of {args.model}; retrieved entries sharing the query's "
          f"template: {shared}/{n_ret * len(held)}")
    print(format_table(["reference", "NLL, as text", "NLL, as latents", "text vs none"],
                       [[k, f"{v['text']:.5f}", f"{v['latents']:.5f}",
                         f"{v['text'] - table['none']['text']:+.5f}"] for k, v in table.items()]))
    if args.json_path:
        write_json(args.json_path, {"settings": vars(args), "held_out_successes": len(held),
                                    "retrieved_sharing_template": shared,
                                    "retrieved_total": n_ret * len(held),
                                    "nll_per_action_token": table})


if __name__ == "__main__":
    main()
