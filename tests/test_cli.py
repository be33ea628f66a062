import json
import re
import shutil

import pytest

from conftest import cut, snapshot
from lopd import stages
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
    from lopd import pipeline, stages

    assets = make_lopd_inputs(tmp_path / "assets")
    (assets / "bank" / stages.PROVENANCE_FILE).write_text(json.dumps(
        {"bank_rollouts": 40, "commands": ["lopd bank build --agent oracle --limit 40"]}))
    monkeypatch.setattr(stages, "EMBEDDED_BANK", assets / "bank")
    monkeypatch.setattr(stages, "EMBEDDED_COMPOSER", assets / "composer")
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

    monkeypatch.setattr(stages, "EMBEDDED_BANK", tmp_path / "no-bank")
    monkeypatch.setattr(stages, "EMBEDDED_COMPOSER", tmp_path / "no-composer")
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


# ----------------------------------------------------------------------------------------------
# Bad inputs: one line on stderr naming what is wrong, exit status 2, nothing saved lost.

SMALL = [arg for sets in ("env.train_size=20", "env.eval_size=2", "env.pretrain_size=0")
         for arg in ("--set", sets)]
EMBEDDED = "embedded: toolworld-1m, toolworld-1m-plain, codeworld-1m"


def error_line(capsys) -> str:
    """The one line a refused command printed on stderr (asserting there is only one)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.rstrip("\n")


def test_a_bank_is_never_built_into_a_file(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    build = ["bank", "build", "--agent", "oracle", "--limit", "2", *SMALL]
    assert main([*build, "--out", str(notes)]) == 2
    assert error_line(capsys) == f"lopd bank: error: bank folder {notes} is a file, not a folder"
    assert main([*build, "--out", str(notes / "bank")]) == 2
    assert error_line(capsys) == (f"lopd bank: error: bank folder {notes / 'bank'}: {notes} is a "
                                  "file, not a folder")
    assert notes.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [notes]


def test_a_missing_model_folder_is_one_line_and_nothing_is_asked_of_the_hub(tmp_path, capsys,
                                                                            monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: pytest.fail("transformers was asked for the model"))
    missing = tmp_path / "no-such-model"
    line = f"model {missing}: no such folder, and not an embedded model ({EMBEDDED})"
    assert main(["eval", "--model", str(missing), "--limit", "1", *SMALL]) == 2
    assert error_line(capsys) == f"lopd eval: error: {line}"
    assert main(["model", "info", str(missing)]) == 2
    assert error_line(capsys) == f"lopd model: error: {line}"
    assert main(["model", "prepare", str(missing), "--out", str(tmp_path / "prepared")]) == 2
    assert error_line(capsys) == f"lopd model: error: {line}"
    assert main(["model", "info", "toolworld-1n"]) == 2
    assert error_line(capsys) == ("lopd model: error: model toolworld-1n: no such folder, and not "
                                  f"an embedded model ({EMBEDDED})")
    assert sorted(tmp_path.iterdir()) == []


STATE_CUT = ("is unreadable (RuntimeError: PytorchStreamReader failed reading zip archive: failed "
             "finding central directory)")


def test_resume_falls_back_to_the_newest_whole_checkpoint_and_stays_exact(finished_run, tmp_path,
                                                                          capsys):
    """The newest checkpoint's state.pt is cut and the metrics end in a torn record (a kill
    mid-write): the run resumes from step-000002, says so in one line, and repeats steps 3 and 4
    as the uninterrupted run did."""
    from lopd import trainer

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    state = run / "checkpoints" / "step-000004" / trainer.STATE_FILE
    cut(state)
    with (run / trainer.METRICS_FILE).open("a") as f:
        f.write('{"step": 5, "generations": 2')
    assert main(["train", "--resume", str(run)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: resuming {run} from step-000002, its newest whole checkpoint; "
                     f"skipped step-000004: {state} {STATE_CUT}"]
    whole = trainer.read_jsonl(finished_run / trainer.METRICS_FILE)
    resumed = trainer.read_jsonl(run / trainer.METRICS_FILE)
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [0, 1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        for key in a:
            if not key.startswith(("time/", "memory/")):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert (run / trainer.METRICS_FILE).read_text().endswith("}\n")
    assert trainer.read_checkpoint(state.parent)["step"] == 4  # written again, whole
    assert [c.name for c in trainer.checkpoints(run)] == ["step-000002", "step-000004"]


def test_resume_with_no_readable_checkpoint_or_a_damaged_record_changes_nothing(
        finished_run, tmp_path, capsys):
    from lopd import trainer

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    lines = (run / trainer.METRICS_FILE).read_text().splitlines(keepends=True)
    (run / trainer.METRICS_FILE).write_text("".join([lines[0], '{"step": 1, oops\n', *lines[2:]]))
    saved = snapshot(run)
    assert main(["train", "--resume", str(run)]) == 2
    assert error_line(capsys) == (f"lopd train: error: {run / trainer.METRICS_FILE}:2: not a JSON "
                                  "record (Expecting property name enclosed in double quotes: "
                                  "line 1 column 13 (char 12))")
    assert snapshot(run) == saved
    state = run / "checkpoints" / "step-000004" / trainer.STATE_FILE
    weights = run / "checkpoints" / "step-000002" / "student" / "model.safetensors"
    cut(state)
    cut(weights)
    saved = snapshot(run)
    assert main(["train", "--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"lopd train: error: {run} has no readable checkpoint to resume from: skipped "
        f"step-000004: {state} {STATE_CUT}; skipped step-000002: {weights} is unreadable "
        "(SafetensorError: Error while deserializing header: incomplete metadata, file not fully "
        "covered)")
    assert snapshot(run) == saved


REFUSED_STARTS = [
    (["--algo", "lopd"], "LOPD needs a cold-started composer and a bank: pass --composer DIR and "
     "--bank DIR (or set lopd.composer and lopd.bank)"),
    (["--algo", "lopd", "--composer", "TMP/nope", "--bank", "TMP/nope"],
     "lopd.composer: TMP/nope does not exist"),
    (["--algo", "lopd", "--composer", "TMP", "--bank", "TMP"],
     "lopd.composer: TMP is not a composer folder (no composer.json)"),
    (["--algo", "grpo", "--set", "grpo.num_generations=3", "--set", "train.rollouts_per_step=4"],
     "train.rollouts_per_step=4 must be a multiple of grpo's group size 3"),
    (["--algo", "grpo", "--set", "train.eval_split=validation", "--set", "train.eval_tasks=20"],
     "train.eval_tasks=20 validation tasks leave no training task of 20"),
    (["--algo", "sdpo", "--set", "rollout.temperature=0.7"], "training rollouts must sample what "
     "the training forward scores (temperature 1, no truncation): rollout.temperature=0.7 is "
     "refused; evaluation keeps rollout.eval_temperature"),
    (["--algo", "grpo", "--set", "model.name_or_path=TMP/none"],
     f"model TMP/none: no such folder, and not an embedded model ({EMBEDDED})"),
    (["--algo", "grpo", "--set", "train.learning_rate=1e999"],
     "train.learning_rate: got '1e999' (read as inf); expected a finite number"),
]


@pytest.mark.parametrize("args, message", REFUSED_STARTS,
                         ids=["lopd-inputs", "lopd-missing", "lopd-not-a-composer", "groups",
                              "validation", "temperature", "model", "inf"])
def test_a_refused_start_leaves_no_run_folder(args, message, tmp_path, capsys):
    """Every check that needs only the config runs before the run folder is written (the
    temperature refusal of test_protocol, generalised)."""
    out = tmp_path / "run"
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    assert main(["train", "--out", str(out), *SMALL, *args]) == 2
    assert error_line(capsys) == "lopd train: error: " + message.replace("TMP", str(tmp_path))
    assert not out.exists()


def test_after_a_refused_start_the_corrected_command_trains(tmp_path, capsys):
    from lopd import trainer

    out = tmp_path / "run"
    start = ["train", "--algo", "grpo", "--out", str(out), *SMALL,
             *(arg for sets in ("train.rollouts_per_step=4", "train.eval_tasks=2",
                                "train.max_steps=1", "rollout.max_turns=2",
                                "rollout.max_completion_length=32") for arg in ("--set", sets))]
    assert main([*start, "--set", "grpo.num_generations=3"]) == 2
    assert "grpo's group size 3" in error_line(capsys) and not out.exists()
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert main([*start[:4], str(notes), *start[5:]]) == 2
    assert error_line(capsys) == f"lopd train: error: {notes} is a file, not a run folder"
    assert notes.read_text() == "keep me"
    assert main([*start, "--set", "grpo.num_generations=2"]) == 0
    assert [c.name for c in trainer.checkpoints(out)] == ["step-000001"]
    assert (out / trainer.CONFIG_FILE).is_file()
