"""``lopd experiment NAME``: the paper's controlled experiments, one module each under
:mod:`lopd.experiments` (the shared machinery in :mod:`lopd.experiments.common`)."""

from __future__ import annotations

from pathlib import Path

from lopd.cli.common import CONFIG, JSON, LOPD_INPUTS, add_command, lopd_input_overrides
from lopd.cli.train import _learning_rates
from lopd.tables import write_json

SHARED = (CONFIG, JSON, LOPD_INPUTS)


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{text!r}: expected comma-separated numbers") from None
    return parse


def _finish(args, report: dict, name: str) -> int:
    out = Path(args.out)
    print((out / f"{name}.md").read_text())
    print(f"figure: {out / (name + '.png')}; all numbers: {out / (name + '.json')}")
    write_json(args.json_path, report)
    return 0


def cmd_experiment(args) -> int:
    out, overrides = Path(args.out), lopd_input_overrides(args)
    name = args.experiment
    if name == "joint-optimisation":
        from lopd.experiments.joint_optimisation import joint_optimisation

        report = joint_optimisation(args.config, overrides, out, args.seeds, args.jobs,
                                    _numbers(float)(args.margins))
    elif name == "random-latent":
        from lopd.experiments.random_latent import random_latent

        report = random_latent(args.config, overrides, out, args.seeds, args.jobs)
    elif name == "sensitivity":
        from lopd.experiments.sensitivity import sensitivity

        report = sensitivity(args.config, overrides, out, args.seeds, args.jobs,
                             _numbers(int)(args.n_ret), _numbers(int)(args.latents),
                             args.cold_start_set)
    elif name == "internalisation":
        from lopd.experiments.internalisation import internalisation

        report = internalisation(args.config, overrides, out, args.seeds, args.jobs)
    elif name == "sample-efficiency":
        from lopd.experiments.sample_efficiency import sample_efficiency

        algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        report = sample_efficiency(args.config, overrides, out, algos, args.seeds, args.jobs,
                                   _learning_rates(args.lr), _numbers(int)(args.at))
    else:  # latent-decoding
        from lopd.experiments.latent_decoding import latent_decoding

        report = latent_decoding(args.config, overrides, out, args.tasks, args.top)
    return _finish(args, report, name)


def register(sub) -> None:
    p = sub.add_parser("experiment", help="the paper's controlled experiments (resumable)",
                       description="Each experiment trains or reuses its runs in OUT/ARM/seedS "
                       "(an interrupted one continues where it stopped) and writes OUT/NAME.md, "
                       "OUT/NAME.json and OUT/NAME.png. Students are scored greedily on the "
                       "held-out tasks without retrieval or latents.")
    names = p.add_subparsers(dest="experiment", metavar="NAME", required=True)

    def add(name: str, help: str, description: str, seeds: bool = True):
        q = add_command(names, name, cmd_experiment, help, description, SHARED)
        q.add_argument("--out", required=True, help="folder of the experiment (its runs too)")
        if seeds:
            q.add_argument("--seeds", type=int, default=3)
            q.add_argument("--jobs", type=int, default=1,
                           help="training runs at once, as separate processes")
        return q

    q = add("joint-optimisation", "frozen φ0 vs jointly optimised composers at several margins",
            "LOPD with the cold-started composer frozen (lopd.update_composer=false) against "
            "jointly optimised composers, one arm per margin m (lopd.margin).")
    q.add_argument("--margins", default="0,0.01,0.05,0.1", help="comma-separated margins m")
    add("random-latent", "retrieved vs random experiences in the composer's input",
        "LOPD whose composer reads random bank entries of other tasks (lopd.retrieval=random) "
        "against the retrieved ones, from the same cold start.")
    q = add("sensitivity", "n_ret and K (latents per experience) sensitivity",
            "One LOPD arm per n_ret (bank.n_ret, K as configured) and per K "
            "(composer.num_latents, each with its own cold start on the bank in "
            "OUT/cold-start/K-k).")
    q.add_argument("--n-ret", default="1,2,3,5", help="comma-separated n_ret values ('' for none)")
    q.add_argument("--latents", default="", metavar="K",
                   help="comma-separated K values, e.g. 8,16,32,64 (each needs a cold start)")
    q.add_argument("--cold-start-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting of the K arms' cold starts only, e.g. "
                   "cold_start.validation_tasks=0 (repeatable)")
    add("internalisation", "Vanilla vs Base + Composer vs the LOPD student",
        "The base, the base acting with retrieved latents (cold-started composer, and each LOPD "
        "run's final composer) and the LOPD student acting alone, on the same held-out tasks.")
    q = add("sample-efficiency", "held-out reward vs rollouts, read off at given counts",
            "A comparison of LOPD with the given baselines (lopd compare, the base included), "
            "each seed's reward read off at --at rollouts, by training rollouts and by rollouts "
            "charged (setup included).")
    q.add_argument("--algos", default="grpo,sdft", help="baselines beside LOPD (default: "
                   "%(default)s, the strongest of the method table)")
    q.add_argument("--lr", action="append", default=[], metavar="ALGO=RATE",
                   help="learning rate of one method (its best from the validation sweep)")
    q.add_argument("--at", default="320,576", help="rollout counts to read off")
    q = add("latent-decoding", "LM-head projections of the latents, with and without the task",
            "No training: the composer's latents for training tasks paired with structurally "
            "related retrievals, projected through the LM head; how much of the retrieved "
            "procedure the projections contain.", seeds=False)
    q.add_argument("--tasks", type=int, default=24)
    q.add_argument("--top", type=int, default=5, help="tokens kept per latent")
