"""The latent-decoding experiment (``lopd experiment latent-decoding``); no training.

The latents of retrieved experiences projected through the LM head (the nearest vocabulary tokens
per latent), with and without the current task in the composer's input, and how much of the
retrieved procedure (tool names and argument keys) the projections contain, against latents of
random experiences and chance. Reported in ``docs/results/latent-decoding.md``.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.ablation import _mean_std as _stats
from lopd.experiments.common import write_report

_ACTION = re.compile(r"^\d+\. ([A-Za-z_][\w]*)\((\{.*?\})?\)")


def procedure(trace: str) -> list[str]:
    """The procedure of a compact trace: each action's tool name and its argument keys, in order
    (entity values and results are left out)."""
    words = []
    for line in trace.splitlines():
        match = _ACTION.match(line)
        if not match:
            continue
        words.append(match.group(1))
        if match.group(2):
            try:
                words.extend(json.loads(match.group(2)))
            except ValueError:
                pass
    return words


PROJECTIONS = ("raw", "centred")
"""``raw``: the LM head applied to each latent; ``centred``: the same logits minus their mean over
every latent of the experiment's tasks under the same composer input, so the component all
latents share (which ranks the same frequent tokens first everywhere) is removed."""

CONDITIONS = ("task-conditioned", "unconditioned", "random experiences")
_CONDITION_NAMES = {"task-conditioned": "current task + retrieved experience",
                    "unconditioned": "retrieved experience only",
                    "random experiences": "current task + random experiences (recall of the "
                                          "retrieved procedure)"}


def latent_decoding(config, overrides: list[str], out: Path, tasks: int = 24, top: int = 5,
                    examples: int = 3) -> dict:
    """See the module docstring. Tasks are training tasks whose nearest retrieved experience shares
    their template (a structurally related retrieval), taken in order; the eval split is not
    touched. Both :data:`PROJECTIONS` are reported."""
    import torch

    from lopd import runtime, stages
    from lopd.composer import Composer
    from lopd.experience import template_of

    cfg = load_config(config, overrides)
    if not cfg.lopd.composer or not cfg.lopd.bank:
        raise ValueError("latent-decoding needs a composer and its bank: set lopd.composer and "
                         "lopd.bank (--composer, --bank)")
    if tasks < 1 or top < 1:
        raise ValueError(f"tasks and top must be >= 1, got {tasks}, {top}")
    out.mkdir(parents=True, exist_ok=True)
    device = runtime.setup(cfg.run)
    env = stages.get_env(cfg)
    model, tokenizer = stages.load_model(cfg, None, device)
    composer = Composer.load(cfg.lopd.composer, model, tokenizer).eval()
    head = model.get_output_embeddings()
    k, n_ret = composer.spec.num_latents, cfg.bank.n_ret
    vocab = head.weight.size(0)
    rng = random.Random(cfg.run.seed)

    def ids(words) -> set[int]:
        return {i for w in words for i in tokenizer.encode(w, add_special_tokens=False)}

    chosen, latents = [], {name: [] for name in CONDITIONS}
    with stages.open_bank(cfg, cfg.lopd.bank, device) as bank, torch.no_grad():
        entries = bank.entries
        for task in env.tasks("train"):
            if len(chosen) == tasks:
                break
            hits = bank.search([task.instruction], n_ret, exclude_task_ids=[task.task_id])[0]
            if len(hits) < n_ret or "template" not in task.meta or \
                    template_of(hits[0].entry.domain, hits[0].entry.meta) != \
                    template_of(task.domain, task.meta):
                continue
            others = [e for e in entries if e.task_id != task.task_id
                      and e.meta.get("template") != task.meta.get("template")]
            randoms = rng.sample(others, n_ret)
            chosen.append((task, [h.entry for h in hits], randoms))
            traces = [h.entry.trace for h in hits]
            for name, text, inputs in (("task-conditioned", task.instruction, traces),
                                       ("unconditioned", "", traces),
                                       ("random experiences", task.instruction,
                                        [e.trace for e in randoms])):
                latents[name].append(composer.encode([text], [inputs])[0].float())
        if not chosen:
            raise ValueError("no training task has a structurally related retrieval in "
                             f"{cfg.lopd.bank}")
        logits = {name: head(torch.stack(z).to(head.weight.dtype)).float()
                  for name, z in latents.items()}  # (tasks, n_ret·K, vocab)
    per_task = [{"task_id": task.task_id, "task": task.instruction,
                 "retrieved": [e.trace for e in retrieved], "random": [e.trace for e in randoms],
                 "top_tokens": {}, "procedure_recall": {}, "task_token_recall": {}, "chance": {}}
                for task, retrieved, randoms in chosen]
    for projection in PROJECTIONS:
        for name, scores in logits.items():
            if projection == "centred":
                scores = scores - scores.mean(dim=(0, 1), keepdim=True)
            top_ids = scores.topk(top, dim=-1).indices.tolist()
            for row, (task, retrieved, randoms), task_top in zip(per_task, chosen, top_ids):
                recall, specific, union, cover = [], [], set(), []
                for j in range(n_ret):
                    block = {i for latent in task_top[j * k:(j + 1) * k] for i in latent}
                    union |= block
                    cover.append(len(block) / vocab)
                    want = ids(procedure(retrieved[j].trace))
                    recall.append(len(want & block) / len(want) if want else 0.0)
                    # What a procedure of another template does not share with it.
                    own = want - ids(procedure(randoms[j].trace))
                    if own:
                        specific.append(len(own & block) / len(own))
                words = ids(re.findall(r"[A-Za-z0-9_]+", task.instruction))
                key = f"{projection}/{name}"
                row["procedure_recall"][key] = statistics.fmean(recall)
                row.setdefault("specific_recall", {})[key] = (statistics.fmean(specific)
                                                              if specific else 0.0)
                row["task_token_recall"][key] = len(words & union) / len(words) if words else 0.0
                row["chance"][key] = statistics.fmean(cover)
                row["top_tokens"][key] = [[tokenizer.decode([i]) for i in latent]
                                          for latent in task_top]
    summary = {f"{p}/{n}": {
        "procedure_recall": _stats([r["procedure_recall"][f"{p}/{n}"] for r in per_task]),
        "specific_recall": _stats([r["specific_recall"][f"{p}/{n}"] for r in per_task]),
        "task_token_recall": _stats([r["task_token_recall"][f"{p}/{n}"] for r in per_task]),
        "chance": statistics.fmean(r["chance"][f"{p}/{n}"] for r in per_task)}
        for p in PROJECTIONS for n in CONDITIONS}
    report = {"experiment": "latent-decoding", "config": str(config), "overrides": overrides,
              "composer": str(cfg.lopd.composer), "bank": str(cfg.lopd.bank), "n_ret": n_ret,
              "latents_per_experience": k, "top": top, "vocabulary": vocab,
              "tasks": len(per_task), "summary": summary, "per_task": per_task}
    plot_latent_decoding(report, out / "latent-decoding.png")
    return write_report(out, "latent-decoding", report,
                        latent_decoding_markdown(report, examples))


def latent_decoding_markdown(report: dict, examples: int) -> str:
    top, k = report["top"], report["latents_per_experience"]
    lines = ["| projection | composer input | procedure recall (mean ± std over tasks) | "
             "specific procedure recall | current-task token recall | chance (the projections' "
             "share of the vocabulary) |", "| --- | --- | --- | --- | --- | --- |"]
    for key, row in report["summary"].items():
        projection, name = key.split("/")
        (pm, ps), (tm, ts) = row["procedure_recall"], row["task_token_recall"]
        qm, qs = row["specific_recall"]
        lines.append(f"| {projection} | {_CONDITION_NAMES[name]} | {pm:.3f} ± {ps:.3f} | "
                     f"{qm:.3f} ± {qs:.3f} | {tm:.3f} ± {ts:.3f} | {row['chance']:.3f} |")
    lines += ["", f"{report['tasks']} training tasks whose nearest retrieval shares their "
              f"template; n_ret {report['n_ret']}, K {k} latents per experience, vocabulary "
              f"{report['vocabulary']}. Each latent is projected through the LM head and its top "
              f"{top} tokens kept; *raw* takes the logits as they are, *centred* subtracts their "
              "mean over all the tasks' latents under the same composer input. *Procedure "
              "recall*: the fraction of the token ids of a retrieved experience's tool names and "
              f"argument keys found among the top-{top} tokens of that experience's {k} latents "
              "(for the random row: the latents of a random experience of another template in "
              "its place, scored against the retrieved one's procedure). *Specific procedure "
              "recall*: the same over the procedure's token ids that the random experience's "
              "procedure lacks (what is particular to the retrieved one). *Current-task token "
              "recall*: the fraction of the current instruction's word tokens among all its "
              "latents' top tokens. *Chance*: the share of the vocabulary one experience's top "
              "tokens cover (the recall a random token set of that size would have on average).",
              "", "## Examples", ""]
    for row in report["per_task"][:examples]:
        lines += [f"### {row['task_id']}", "", f"Task: {row['task']}", "",
                  "Retrieved experience (the first of n_ret):", "", "```", row["retrieved"][0],
                  "```", ""]
        for projection in PROJECTIONS:
            for name in ("task-conditioned", "unconditioned"):
                key = f"{projection}/{name}"
                lines += [f"Top-{top} tokens of that experience's latents, {projection}, "
                          f"{_CONDITION_NAMES[name]} (procedure recall "
                          f"{row['procedure_recall'][key]:.2f}):", ""]
                for j, latent in enumerate(row["top_tokens"][key][:k]):
                    lines.append(f"- z{j + 1}: " + " ".join(
                        "`" + (t.strip() or repr(t)).replace("`", "'") + "`" for t in latent))
                lines.append("")
    lines += [f"Config: `{report['config']}` with "
              + (", ".join(f"`{o}`" for o in report["overrides"]) or "no overrides") + "."]
    return "\n".join(lines) + "\n"


def plot_latent_decoding(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("procedure_recall", "retrieved procedure"),
              ("specific_recall", "its tokens another template lacks"),
              ("task_token_recall", "the current task's tokens"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.9), sharey=True)
    width = 0.38
    for ax, (key, title) in zip(axes, panels):
        for p, projection in enumerate(PROJECTIONS):
            rows = [report["summary"][f"{projection}/{n}"] for n in CONDITIONS]
            xs = [i + (p - 0.5) * width for i in range(len(CONDITIONS))]
            ax.bar(xs, [r[key][0] for r in rows], width, yerr=[r[key][1] for r in rows],
                   capsize=3, alpha=0.7, label=projection)
            ax.scatter(xs, [r["chance"] for r in rows], marker="_", s=200, color="k",
                       zorder=3, label="chance" if p == 0 else None)
        ax.set_xticks(range(len(CONDITIONS)), CONDITIONS, fontsize=8)
        ax.set_title(f"share of {title}\namong the latents' top tokens", fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylim(bottom=0)
    fig.suptitle(f"latent decoding: top-{report['top']} LM-head tokens per latent, "
                 f"{report['tasks']} tasks (mean ± std over tasks; black: chance)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
