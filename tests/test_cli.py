import json
import re

import pytest

from lopd.cli import build_parser, main

SUBCOMMANDS = [[], ["quickstart"], ["config"], ["model"], ["model", "new"], ["model", "info"],
               ["tasks"], ["eval"], ["base"], ["cold-start"], ["bank"], ["bank", "build"], ["bank", "add"],
               ["bank", "query"], ["bank", "stats"], ["bank", "eval"]]


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
    assert main(["model", "new", "--out", str(tmp_path / "m"), "--set", "model.preset=huge"]) == 2
    assert "model.preset" in capsys.readouterr().err


def test_info_on_a_folder_without_a_model(tmp_path, capsys):
    assert main(["model", "info", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_parser_lists_the_commands():
    text = build_parser().format_help()
    for command in ("quickstart", "config", "model"):
        assert command in text
