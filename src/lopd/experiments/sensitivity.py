"""The sensitivity experiment (``lopd experiment sensitivity``): n_ret and K.

n_ret ∈ {1, 2, 3, 5} (experiences retrieved per task) with K fixed, and K ∈ {8, 16, 32, 64}
latents per experience, each K with its own cold start (``OUT/cold-start/K-k``) on the same bank:
the held-out reward of the LOPD students per arm (greedy, without retrieval or latents) and the
latent tokens each arm puts in the teacher's prompt (n_ret · K) against the model's context.
Reported in ``docs/results/sensitivity.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.common import run_arms

N_RET = (1, 2, 3, 5)
LATENTS = (8, 16, 32, 64)


def configured_latents(cfg) -> int | None:
    """K of the composer folder ``lopd.composer`` (None when none is set)."""
    if not cfg.lopd.composer:
        return None
    from lopd.composer import Composer

    spec = Path(cfg.lopd.composer) / Composer.CONFIG_FILE
    if not spec.exists():
        raise FileNotFoundError(f"{cfg.lopd.composer} is not a composer folder (no "
                                f"{Composer.CONFIG_FILE})")
    return json.loads(spec.read_text())["spec"]["num_latents"]


def cold_start_for(config, sets: list[str], bank: str, folder: Path) -> dict:
    """The cold start in ``folder`` made with ``config`` + ``sets`` on ``bank``: made when missing
    (a cut-off one, without its ``cold_start.json``, which is written last, starts over), reused
    when its saved config is the wanted one, refused otherwise."""
    import shutil

    from lopd import pipeline
    from lopd.experiments.runs import differing_keys

    wanted = load_config(config, sets)
    record = folder / "cold_start.json"
    if not record.exists():
        shutil.rmtree(folder, ignore_errors=True)
        pipeline.cold_start(wanted, bank, folder)
    saved = json.loads(record.read_text())
    shown = differing_keys(saved["config"], wanted)
    if shown:
        raise ValueError(f"{folder} holds a cold start with another config than this experiment "
                         f"asks for ({shown}); move it away or use another --out")
    return saved["figures"]


def sensitivity(config, overrides: list[str], out: Path, seeds: int = 3, jobs: int = 1,
                n_ret=N_RET, latents=(), cold_start_sets: list[str] = ()) -> dict:
    """n_ret arms (K as configured) and K arms (n_ret as configured). Each K has its own cold
    start: the configured composer for its own K, otherwise one made in ``OUT/cold-start/K-k``
    with the config (plus ``cold_start_sets``, which reach the cold starts only) on ``lopd.bank``.
    The K of the configured composer is the n_ret arm of the configured n_ret when there is one
    (the same run), else an arm of its own. Every arm's latent tokens (n_ret · K) are set against
    the model's context."""
    cfg = load_config(config, overrides)
    if not n_ret and not latents:
        raise ValueError("sensitivity needs n_ret or K values")
    if any(n < 1 for n in n_ret) or any(k < 1 for k in latents):
        raise ValueError(f"n_ret and K must be >= 1, got n_ret {list(n_ret)}, K {list(latents)}")
    own = configured_latents(cfg)
    if latents and own is None:
        raise ValueError("the K arms need the configured cold start and its bank: set "
                         "lopd.composer and lopd.bank (--composer, --bank)")
    if latents and not cfg.lopd.bank:
        raise ValueError("the K arms need a bank for their cold starts: set lopd.bank (--bank)")
    if latents and own != cfg.composer.num_latents:
        raise ValueError(f"composer.num_latents={cfg.composer.num_latents} but the composer in "
                         f"{cfg.lopd.composer} has K {own}: set composer.num_latents={own}")
    arms, labels, tokens = {}, {}, {}
    for n in n_ret:
        arms[f"n_ret-{n}"] = [f"bank.n_ret={n}"]
        labels[f"n_ret-{n}"] = f"n_ret = {n}, K = {own or cfg.composer.num_latents}"
        tokens[f"n_ret-{n}"] = n * cfg.composer.num_latents
    cold_starts, shared = {}, None
    for k in latents:
        if k == own and cfg.bank.n_ret in n_ret:
            shared = f"n_ret-{cfg.bank.n_ret}"
            continue
        if k == own:
            arms[f"K-{k}"] = [f"composer.num_latents={k}"]
        else:
            folder = out / "cold-start" / f"K-{k}"
            cold_starts[k] = cold_start_for(config, [*overrides, f"composer.num_latents={k}",
                                                     *cold_start_sets], cfg.lopd.bank, folder)
            arms[f"K-{k}"] = [f"composer.num_latents={k}", f"lopd.composer={folder}"]
        labels[f"K-{k}"] = f"K = {k}, n_ret = {cfg.bank.n_ret}"
        tokens[f"K-{k}"] = k * cfg.bank.n_ret
    context = cfg.model.max_position_embeddings
    configured = [f"n_ret-{cfg.bank.n_ret}", f"K-{cfg.composer.num_latents}"]
    reference = next((a for a in configured if a in arms), next(iter(arms)))
    extra = {"latent_tokens": tokens, "context_positions": context,
             "cold_starts": {str(k): {"steps": f["steps"], "seconds": f["seconds"],
                                      "final_nll": f["final_nll"]}
                             for k, f in cold_starts.items()},
             "cold_start_settings": list(cold_start_sets), "configured_latents": own,
             "shared_arm": shared}
    report = run_arms("sensitivity", config, overrides, arms, seeds, out, jobs, reference, labels,
                      extra)
    text = (out / "sensitivity.md").read_text()
    text += ("\nLatent tokens in the teacher's prompt per arm (n_ret · K), of the model's "
             f"{context} positions: " + ", ".join(f"{labels[a]}: {t}" for a, t in tokens.items())
             + ".\n")
    if shared:
        text += (f"\nK = {own} (the configured composer's) is the arm {labels[shared]}: the same "
                 "run.\n")
    if cold_starts:
        settings = ", ".join(f"`{c}`" for c in cold_start_sets) or "as configured"
        made = ", ".join(f"K = {k}: {f['steps']} steps, {f['seconds']:.0f} s, final NLL "
                         f"{f['final_nll']:.4f}" for k, f in cold_starts.items())
        text += f"\nCold starts of the K arms (settings {settings}): {made}.\n"
    (out / "sensitivity.md").write_text(text)
    return report
