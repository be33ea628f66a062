import json
import re

import pytest

from lopd.cli import build_parser, main

SUBCOMMANDS = [[], ["quickstart"], ["config"], ["model"], ["model", "new"], ["model", "info"], ["model", "prepare"],
               ["tasks"], ["eval"], ["base"], ["cold-start"], ["bank"], ["bank", "build"], ["bank", "add"],
               ["bank", "query"], ["bank", "stats"], ["bank", "eval"], ["train"], ["sweep"], ["compare"]]


@pytest.mark.parametrize("words", SUBCOMMANDS)
def test_every_help_works(words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(words + ["--help"])
    assert exit_.value.code == 0
    assert "usage: lopd" in capsys.readouterr().out


def test_model_new_then_info(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["model", "new", "--out", str(out), "--set", "model.vocab_size=400",
                 "--json", str(tmp_path / "new.json")]) == 0
    built = json.loads((tmp_path / "new.json").read_text())
    assert main(["model", "info", str(out), "--json", str(tmp_path / "info.json")]) == 0
    printed = capsys.readouterr().out
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["parameters"] == built["parameters"] > 100_000
    assert re.search(rf"^parameters\s+{info['parameters']}$", printed, re.M)
    assert info["chat_template"] is True and info["latent_token"] == "<|latent|>"
    assert "<|im_start|>" in info["special_tokens"]


def test_model_new_from_a_corpus_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"order O{i} shipped"}) for i in range(50)))
    assert main(["model", "new", "--out", str(tmp_path / "m"), "--corpus", str(corpus),
                 "--json", str(tmp_path / "f.json")]) == 0
    assert json.loads((tmp_path / "f.json").read_text())["corpus_texts"] == 50


def test_bad_config_value_fails_naming_the_key(tmp_path, capsys):
    assert main(["model", "new", "--out", str(tmp_path / "m"), "--set", "model.architecture=huge"]) == 2
    assert "model.architecture" in capsys.readouterr().err


def test_info_on_a_folder_without_a_model(tmp_path, capsys):
    assert main(["model", "info", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_parser_lists_the_commands():
    text = build_parser().format_help()
    for command in ("quickstart", "config", "model"):
        assert command in text


QUICK = ["--lopd-steps", "1",
         "--set", "env.train_size=60", "--set", "env.eval_size=4", "--set", "env.pretrain_size=300",
         "--set", "train.eval_tasks=4", "--set", "train.rollouts_per_step=4",
         "--set", "rollout.max_turns=3", "--set", "bank.embedder=policy", "--set", "bank.n_ret=2",
         "--set", "composer.num_latents=2", "--set", "composer.depth=1",
         "--set", "cold_start.max_steps=2"]


def test_quickstart_rebuild_runs_every_stage_then_reuses_them(tmp_path, capsys, monkeypatch):
    from lopd import pipeline, trainer

    args = ["quickstart", "--rebuild", "--bank-tasks", "24", *QUICK,
            "--set", f"run.output_dir={tmp_path}"]
    assert main(args) == 0
    first = capsys.readouterr().out
    folder = tmp_path / "quickstart"
    report = (folder / "report.md").read_text()
    assert "| base |" in report and "| LOPD, 1 steps |" in report
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["oracle"] == 1.0 and summary["lopd"]["generations"] == 4
    # Two sampling passes (seeds run.seed, run.seed + 1) over the 24 tasks fill the bank.
    assert summary["bank"]["seeds"] == [0, 1] and summary["bank"]["rollouts"] == 48
    assert summary["before_lopd"]["bank_rollouts"] == 48
    assert summary["cold_start"]["steps"] == summary["before_lopd"]["cold_start_steps"] == 2
    assert "48 base rollouts built the bank" in report
    below = summary["lopd"]["mean_reward"] < summary["base"]["mean_reward"]
    said = "is below the base after 1 steps" if below else "the base after 1 steps"
    assert said in summary["verdict"] and summary["verdict"] in report
    assert summary["verdict"] in first and "one seed of a short run" in report
    assert "docs/results/" in report
    # A re-run reuses the bank, the composer and the finished LOPD run.
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: pytest.fail("LOPD ran again"))
    monkeypatch.setattr(pipeline, "build_bank", lambda *a, **k: pytest.fail("bank built again"))
    monkeypatch.setattr(pipeline, "cold_start", lambda *a, **k: pytest.fail("cold start again"))
    assert main(args) == 0
    assert json.loads((folder / "summary.json").read_text())["lopd"] == summary["lopd"]


def test_quickstart_uses_the_embedded_composer_and_bank(tmp_path, capsys, monkeypatch):
    from conftest import make_lopd_inputs
    from lopd import pipeline

    assets = make_lopd_inputs(tmp_path / "assets")
    (assets / "bank" / pipeline.PROVENANCE_FILE).write_text(json.dumps(
        {"bank_rollouts": 40, "commands": ["lopd bank build --agent oracle --limit 40"]}))
    monkeypatch.setattr(pipeline, "EMBEDDED_BANK", assets / "bank")
    monkeypatch.setattr(pipeline, "EMBEDDED_COMPOSER", assets / "composer")
    monkeypatch.setattr(pipeline, "build_bank", lambda *a, **k: pytest.fail("built a bank"))
    monkeypatch.setattr(pipeline, "cold_start", lambda *a, **k: pytest.fail("ran a cold start"))
    files = sorted(p.name for p in assets.rglob("*"))
    assert main(["quickstart", *QUICK, "--set", f"run.output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "quickstart"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["assets"] == "embedded" and summary["bank"]["entries"] == 40
    assert summary["before_lopd"] == {"bank_rollouts": 40, "cold_start_steps": "unknown",
                                      "commands": ["lopd bank build --agent oracle --limit 40"]}
    # LOPD reads the package's composer in place and a copy of its bank; neither is written.
    import yaml

    run_config = yaml.safe_load((folder / "lopd" / "config.yaml").read_text())
    assert run_config["lopd"]["composer"] == str(assets / "composer")
    assert run_config["lopd"]["bank"] == str(folder / "bank")
    assert sorted(p.name for p in assets.rglob("*")) == files
    assert "5. experience bank (embedded): 40 successes of 40 base rollouts" in out
    report = (folder / "report.md").read_text()
    assert "40 base rollouts built the bank" in report
    assert "ran an unrecorded number of steps" in report


def test_quickstart_without_the_embedded_assets_says_how_to_get_them(tmp_path, capsys,
                                                                     monkeypatch):
    from lopd import pipeline

    monkeypatch.setattr(pipeline, "EMBEDDED_BANK", tmp_path / "no-bank")
    monkeypatch.setattr(pipeline, "EMBEDDED_COMPOSER", tmp_path / "no-composer")
    assert main(["quickstart", "--set", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--rebuild" in err
    assert str(tmp_path / "no-bank") in err and str(tmp_path / "no-composer") in err
    assert main(["quickstart", "--bank-tasks", "10"]) == 2
    assert "--rebuild" in capsys.readouterr().err
    assert not (tmp_path / "quickstart").exists()


def test_quickstart_verdict_says_plainly_where_lopd_stands():
    from lopd.experiments.quickstart import verdict

    below = verdict(0.64, 0.62, 24)
    assert below.startswith("LOPD is below the base after 24 steps: held-out mean reward 0.6200 "
                            "vs 0.6400 (-0.0200).")
    above = verdict(0.64, 0.67, 24)
    assert above.startswith("LOPD is above the base after 24 steps by 0.0300")
    for text in (below, above):
        assert "one seed of a short run" in text and "docs/results/" in text


def test_removed_and_unknown_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["quickstart", "--cold-start-steps", "2"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--algos", "base,nope", "--out", "x"])
    assert exit_.value.code == 2
    assert "choose from ['base', 'grpo', 'lopd', 'opsd', 'sdft', 'sdpo', 'skill_sd']" in capsys.readouterr().err


def test_quickstart_can_build_its_own_base_and_says_when_it_is_too_weak(tmp_path, capsys):
    # --build-base implies --rebuild: the embedded composer and bank belong to the embedded base.
    args = ["quickstart", "--build-base", "--bank-tasks", "24", *QUICK,
            "--set", f"run.output_dir={tmp_path}",
            "--set", "base.pretrain_tasks=300", "--set", "base.max_steps=3",
            "--set", "base.eval_every=3", "--set", "base.eval_tasks=2", "--set", "base.batch_size=8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the cold start needs more than bank.n_ret=2 successes" in err
    assert (tmp_path / "quickstart" / "base" / "config.json").exists()
