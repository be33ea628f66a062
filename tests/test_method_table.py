"""The paper-shaped method table from two hand-written comparison reports: cells, spreads,
rollouts charged and the above / below / within verdicts against the base and GRPO."""

import json

import pytest

from lopd.experiments import method_table as mt


def report(rows, seeds=2, transfer=()):
    return {"seeds": seeds, "transfer": list(transfer), "per_seed": rows}


def row(mean, success, domains=None, charged=0, transfer=None):
    return {"mean_reward": mean, "success_rate": success, "per_domain": domains or {},
            "charged_generations": charged, "transfer": transfer or {}}


def write(folder, rep):
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(rep))
    return folder


@pytest.fixture
def reports(tmp_path):
    tool = report({
        "base": row([0.6, 0.6], [0.4, 0.4], {"a": [0.5, 0.5], "b": [0.7, 0.7]}),
        "grpo": row([0.70, 0.66], [0.5, 0.5], {"a": [0.6, 0.6], "b": [0.8, 0.72]}, 960),
        "lopd": row([0.64, 0.62], [0.45, 0.45], {"a": [0.55, 0.5], "b": [0.73, 0.74]}, 5658),
        "sdpo": row([0.50, 0.52], [0.3, 0.3], {"a": [0.4, 0.4], "b": [0.6, 0.64]}, 960)})
    code = report({
        "base": row([0.4, 0.4], [0.25, 0.25], transfer={"humaneval": [0.0, 0.0]}),
        "grpo": row([0.5, 0.5], [0.3, 0.32], charged=960, transfer={"humaneval": [0.0, 0.0]})},
        transfer=["humaneval"])
    return write(tmp_path / "tool", tool), write(tmp_path / "code", code)


def test_cells_are_seed_means_and_population_spreads(reports, tmp_path):
    table = mt.write(*reports, tmp_path / "out")
    assert table["columns"] == ["toolworld a", "toolworld b", "toolworld average",
                                "toolworld success", "codeworld reward", "codeworld pass@1",
                                "humaneval pass@1"]
    assert list(table["cells"]) == ["base", "grpo", "sdpo", "lopd"]  # the paper's order
    assert table["cells"]["grpo"]["toolworld average"] == pytest.approx((0.68, 0.02))
    assert table["cells"]["grpo"]["toolworld b"] == pytest.approx((0.76, 0.04))
    assert table["cells"]["grpo"]["codeworld pass@1"] == pytest.approx((0.31, 0.01))
    assert table["cells"]["lopd"]["codeworld reward"] is None  # not run on codeworld
    assert table["charged"]["lopd"] == {"toolworld": 5658}
    text = (tmp_path / "out" / "table.md").read_text()
    assert "| GRPO | 0.6000 ± 0.0000 | 0.7600 ± 0.0400 | 0.6800 ± 0.0200 | 0.5000 ± 0.0000 | " \
           "0.5000 ± 0.0000 | 0.3100 ± 0.0100 | 0.0000 ± 0.0000 | 960 | 960 |" in text
    assert "| LOPD | 0.5250 ± 0.0250 | 0.7350 ± 0.0050 | 0.6300 ± 0.0100 | 0.4500 ± 0.0000 | - | " \
           "- | - | 5658 | - |" in text


def test_verdicts_need_more_than_the_two_spreads(reports, tmp_path):
    table = mt.write(*reports, tmp_path / "out")
    vs_base, vs_grpo = table["verdicts"]["base"], table["verdicts"]["grpo"]
    # GRPO 0.68 ± 0.02 vs base 0.60 ± 0: 0.08 > 0.02.
    assert vs_base["grpo"]["toolworld average"] == "above"
    # LOPD 0.63 ± 0.01 vs base: above; vs GRPO 0.68 ± 0.02: 0.05 > 0.03, below.
    assert vs_base["lopd"]["toolworld average"] == "above"
    assert vs_grpo["lopd"]["toolworld average"] == "below"
    # LOPD's domain b, 0.735 ± 0.005, vs GRPO's 0.76 ± 0.04: 0.025 < 0.045, within.
    assert vs_grpo["lopd"]["toolworld b"] == "within"
    # SDPO ends below the untrained model, and the page says so.
    assert vs_base["sdpo"]["toolworld average"] == "below"
    assert vs_base["grpo"]["humaneval pass@1"] == "within"
    assert "base" not in vs_grpo and "grpo" not in vs_grpo
    text = (tmp_path / "out" / "table.md").read_text()
    assert "- SDPO: below: toolworld a, toolworld b, toolworld average" in text
    assert mt.beats((0.7, 0.0), (0.6, 0.1)) is False and mt.beats((0.71, 0.0), (0.6, 0.1))


def test_a_folder_without_results_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not an lopd compare folder"):
        mt.write(tmp_path, None, tmp_path / "out")
    with pytest.raises(ValueError, match="give --toolworld, --codeworld or both"):
        mt.write(None, None, tmp_path / "out")


def test_a_toolworld_transfer_gets_its_own_column_and_verdicts(tmp_path):
    """BFCL scored on toolworld's students (``compare --transfer bfcl``) reads the mean reward."""
    tool = write(tmp_path / "tool", report({
        "base": row([0.6, 0.6], [0.4, 0.4], transfer={"bfcl": [0.1, 0.1]}),
        "grpo": row([0.7, 0.7], [0.5, 0.5], charged=960, transfer={"bfcl": [0.0, 0.0]}),
        "lopd": row([0.6, 0.6], [0.4, 0.4], charged=1544, transfer={"bfcl": [0.3, 0.2]})},
        transfer=["bfcl"]))
    table = mt.write(tool, None, tmp_path / "out")
    assert table["columns"] == ["toolworld average", "toolworld success", "bfcl mean reward"]
    assert table["cells"]["lopd"]["bfcl mean reward"] == pytest.approx((0.25, 0.05))
    # 0.25 ± 0.05 vs the base's 0.1 ± 0: 0.15 > 0.05; GRPO (0.0) is below the base.
    assert table["verdicts"]["base"]["lopd"]["bfcl mean reward"] == "above"
    assert table["verdicts"]["base"]["grpo"]["bfcl mean reward"] == "below"
