import json
import re

import pytest

from lopd.cli import build_parser, main

SUBCOMMANDS = [[], ["quickstart"], ["config"], ["model"], ["model", "new"], ["model", "info"],
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


QUICK = ["--bank-tasks", "24", "--cold-start-steps", "2", "--lopd-steps", "1",
         "--set", "env.train_size=60", "--set", "env.eval_size=4", "--set", "env.pretrain_size=300",
         "--set", "train.eval_tasks=4", "--set", "train.rollouts_per_step=4",
         "--set", "rollout.max_turns=3", "--set", "bank.embedder=policy", "--set", "bank.n_ret=2",
         "--set", "composer.num_latents=2", "--set", "composer.depth=1"]


def test_quickstart_runs_every_stage_then_reuses_them(tmp_path, capsys, monkeypatch):
    out = ["--set", f"run.output_dir={tmp_path}"]
    assert main(["quickstart", *QUICK, *out]) == 0
    first = capsys.readouterr().out
    folder = tmp_path / "quickstart"
    report = (folder / "report.md").read_text()
    assert "| base |" in report and "| LOPD, 1 steps |" in report
    assert "held-out mean reward: base" in first.strip().splitlines()[-1]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["oracle"] == 1.0 and summary["lopd"]["generations"] == 4
    # A re-run reuses the bank, the composer and the finished LOPD run.
    from lopd import trainer
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: pytest.fail("LOPD ran again"))
    assert main(["quickstart", *QUICK, *out]) == 0
    assert json.loads((folder / "summary.json").read_text())["lopd"] == summary["lopd"]


def test_quickstart_can_build_its_own_base_and_says_when_it_is_too_weak(tmp_path, capsys):
    args = ["quickstart", "--build-base", *QUICK, "--set", f"run.output_dir={tmp_path}",
            "--set", "base.pretrain_tasks=300", "--set", "base.max_steps=3",
            "--set", "base.eval_every=3", "--set", "base.eval_tasks=2", "--set", "base.batch_size=8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the cold start needs more than bank.n_ret=2 successes" in err
    assert (tmp_path / "quickstart" / "base" / "config.json").exists()
