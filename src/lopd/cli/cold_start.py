"""`lopd cold-start`: fit the composer to a bank, then print what its latents tell the teacher."""

from __future__ import annotations

from lopd.cli.common import add_command, load
from lopd.tables import format_table, key_value_table, write_json


def cmd_cold_start(args) -> int:
    from lopd import pipeline

    cfg = load(args)
    figures = pipeline.cold_start(cfg, args.bank, args.out, args.model)
    table, groups = figures["nll_per_action_token"], figures["by_request_kind"]
    print(key_value_table({k: v for k, v in figures.items()
                           if k not in ("nll_per_action_token", "by_request_kind", "per_epoch")},
                          title=f"cold start -> {args.out} (loss curve: {args.out}/cold_start.png)"))
    if table:
        plain = table["no reference"]
        print()
        print(format_table(["teacher reference", "NLL / action token", "vs no reference"],
                           [[name, nll, nll - plain] for name, nll in table.items()],
                           title=f"teacher NLL on {figures['held_out_successes']} successes on "
                           f"{figures['validation_tasks']} validation tasks (withheld from the "
                           f"bank; n_ret={figures['n_ret']})"))
    if figures["per_epoch"]:
        names = [n for n in figures["per_epoch"][0] if n != "epoch"]
        print()
        print(format_table(["epoch", *names], [[r["epoch"], *(r[n] for n in names)]
                                               for r in figures["per_epoch"]],
                           title=f"teacher NLL / action token after each epoch (validation; "
                           f"composers in {args.out}/epochs/)"))
    if groups:
        names = [n for n in next(iter(groups.values())) if n != "successes"]
        print()
        print(format_table(["teacher reference",
                            *(f"{k} ({g['successes']})" for k, g in groups.items())],
                           [[n, *(g[n] for g in groups.values())] for n in names],
                           title="the same, by request kind (NLL / action token)"))
    write_json(args.json_path, figures)
    return 0


def register(sub) -> None:
    p = add_command(sub, "cold-start", cmd_cold_start,
                    "fit the latent composer to a bank (teacher NLL)",
                    "Train the composer (LoRA on the frozen base + compressor) so that the frozen "
                    "teacher, given latents of n_ret other retrieved experiences, maximises the "
                    "likelihood of each stored success; then print the teacher's NLL on the base's "
                    "successes on validation tasks carved from the training split (withheld from "
                    "the bank; cold_start.validation_tasks) with no reference, retrieved latents, random experiences' latents "
                    "and the raw traces as text.")
    p.add_argument("--model", help="the frozen base (folder or embedded model); default: the "
                   "config's model.name_or_path")
    p.add_argument("--bank", required=True, help="experience bank folder (lopd bank build)")
    p.add_argument("--out", required=True, help="folder to write the composer to")
