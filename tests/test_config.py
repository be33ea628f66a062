from dataclasses import dataclass
from pathlib import Path

import pytest

from lopd.config import (
    Config,
    ConfigError,
    describe,
    knob,
    load_config,
    method_names,
    method_sections,
    register_method,
    unregister_method,
)


def test_the_tiny_preset_differs_from_the_defaults_only_where_it_says_so():
    tiny, defaults = load_config("tiny").to_dict(), Config().to_dict()
    differences = {f"{section}.{key}" for section in defaults for key in defaults[section]
                   if tiny[section][key] != defaults[section][key]}
    # Each of these carries a comment in tiny.yaml saying why it differs from the paper.
    assert differences == {"composer.num_latents", "train.learning_rate",
                           "lopd.composer_learning_rate", "base.reference_fraction",
                           "env.coded_fraction", "cold_start.epochs"}


def test_yaml_file_and_set_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 3.0e-4\n  max_steps: 7\nrollout:\n  top_k: 5\n")
    cfg = load_config(path, ["train.max_steps=9", "rollout.temperature=0", "run.device=cpu",
                             "train.max_grad_norm=5e-1"])
    assert cfg.train.max_grad_norm == 0.5    # "5e-1" is a string to YAML, a number to people
    assert cfg.train.learning_rate == pytest.approx(3e-4)
    assert cfg.train.max_steps == 9          # --set wins over the file
    assert cfg.rollout.top_k == 5
    assert cfg.rollout.temperature == 0.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.run.device == "cpu"
    assert cfg.train.weight_decay == 0.0     # untouched keys keep their defaults


@pytest.mark.parametrize("override, fragments", [
    (["train.lr=1e-3"], ["unknown key 'train.lr'", "learning_rate"]),
    (["trian.learning_rate=1e-3"], ["unknown key 'trian'", "did you mean 'train'"]),
    (["train.max_steps=ten"], ["train.max_steps", "'ten'", "an integer"]),
    (["train.max_steps=2.5"], ["train.max_steps", "an integer"]),
    (["rollout.max_turns=true"], ["rollout.max_turns", "an integer"]),
    (["train.learning_rate=-1"], ["train.learning_rate", "> 0.0"]),
    (["rollout.top_p=1.5"], ["rollout.top_p", "<= 1.0"]),
    (["run.device=tpu"], ["run.device", "'tpu'", "'cpu'", "'cuda'"]),
    (["model.architecture=huge"], ["model.architecture", "'qwen3-1m'", "'qwen3-4m'"]),
    (["rollout.vllm_gpu_memory_utilization=1.5"], ["rollout.vllm_gpu_memory_utilization",
                                                   "<= 1.0"]),
    (["rollout.vllm_gpu_memory_utilization=most"], ["rollout.vllm_gpu_memory_utilization",
                                                    "'auto' or a number"]),
    (["rollout.vllm_dtype=float16"], ["rollout.vllm_dtype", "'bfloat16'", "'float32'"]),
    (["learning_rate=1"], ["section and a field"]),
    (["train.learning_rate"], ["section.key=value"]),
])
def test_errors_name_the_key_and_what_is_allowed(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", override)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=1e999", "train.learning_rate: got '1e999' (read as inf); expected a "
                                  "finite number"),
    ("train.max_grad_norm=.inf", "train.max_grad_norm: got inf; expected a finite number"),
    ("lopd.margin=nan", "lopd.margin: got 'nan' (read as nan); expected a finite number"),
    ("lopd.margin=-.inf", "lopd.margin: got -inf; expected a finite number"),
    ("rollout.temperature=.nan", "rollout.temperature: got nan; expected a finite number"),
    ("train.weight_decay=" + "9" * 400, "train.weight_decay: got an integer of 400 digits; "
                                        "expected a finite number"),
])
def test_no_float_setting_takes_inf_or_nan(override, message):
    # lopd.margin has no bounds, so only the finiteness check stands between nan and a run.
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert str(err.value) == message


def test_inf_in_a_yaml_file_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cold_start:\n  learning_rate: 1.0e+400\n")
    with pytest.raises(ConfigError, match=r"^cold_start.learning_rate: got inf; expected a finite"):
        load_config(path)


def test_unknown_key_in_yaml_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature' \(did you mean 'temperature'\?\)"):
        load_config(path)


def test_section_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        load_config(path)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="presets: .*tiny"):
        load_config("no-such-preset")


def test_every_field_is_documented():
    rows = describe()
    assert {key for key, _, _ in rows} >= {"train.learning_rate", "train.max_grad_norm",
                                           "grpo.num_generations", "rollout.temperature",
                                           "rollout.max_completion_length", "grpo.beta",
                                           "grpo.epsilon", "grpo.epsilon_high", "run.seed"}
    assert all(help_text for _, _, help_text in rows)


# ----------------------------------------------------------------------------------------------
# The registry of method sections that config owns


def test_config_imports_nothing_else_of_lopd():
    """Config is the bottom layer: no import of another lopd module, top-level or in a function
    (methods are loaded by module name, as plugins)."""
    import ast

    import lopd.config

    tree = ast.parse(Path(lopd.config.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [("." * node.level) + (node.module or "") for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith((".", "lopd"))]


def test_the_methods_shipped_with_lopd_are_registered():
    names = method_names()
    assert names == sorted(names)
    assert {"lopd", "grpo", "sdft", "opsd", "sdpo", "skill_sd"} <= set(names)
    sections = method_sections()
    assert list(sections) == sorted(sections) and set(sections) <= set(names)
    assert {"lopd", "grpo"} <= set(sections)
    assert set(Config().methods) == set(sections)


@dataclass
class _ToySection:
    width: int = knob(3, "How wide.", ge=1)


@dataclass
class _OtherSection:
    width: int = knob(3, "How wide.", ge=1)


@pytest.fixture
def toy_method():
    register_method("toy_method", _ToySection)
    yield "toy_method"
    unregister_method("toy_method")


def test_a_registered_method_is_a_section_and_an_algorithm_value(toy_method):
    assert "toy_method" in method_names() and method_sections()["toy_method"] is _ToySection
    cfg = load_config("tiny", ["train.algorithm=toy_method", "toy_method.width=5"])
    assert cfg.train.algorithm == "toy_method" and cfg.toy_method.width == 5
    assert "toy_method.width" in {key for key, _, _ in describe()}
    with pytest.raises(ConfigError, match="toy_method.width"):
        load_config("tiny", ["toy_method.width=0"])
    register_method("toy_method", _ToySection)      # the same class again is fine
    unregister_method("toy_method")
    assert "toy_method" not in method_names() and "toy_method" not in method_sections()
    with pytest.raises(ConfigError, match="unknown key 'toy_method'"):
        load_config("tiny", ["toy_method.width=2"])


def test_a_method_without_a_section_is_only_an_algorithm_value():
    register_method("toy_bare", None)
    try:
        assert "toy_bare" in method_names() and "toy_bare" not in method_sections()
        assert load_config("tiny", ["train.algorithm=toy_bare"]).train.algorithm == "toy_bare"
    finally:
        unregister_method("toy_bare")


def test_another_section_under_a_taken_name_is_refused_naming_both(toy_method):
    with pytest.raises(ConfigError, match=r"two config sections for method 'toy_method': "
                       r".*test_config\._ToySection and .*test_config\._OtherSection"):
        register_method("toy_method", _OtherSection)
    with pytest.raises(ConfigError, match="_ToySection and no config section"):
        register_method("toy_method", None)
    assert method_sections()["toy_method"] is _ToySection


@pytest.mark.parametrize("name, message", [
    ("", "method: name must be a lower-case identifier, got ''"),
    ("Toy", "method: name must be a lower-case identifier, got 'Toy'"),
    ("toy-method", "method: name must be a lower-case identifier, got 'toy-method'"),
    ("train", "algorithm name 'train' is taken by a config section or 'base'"),
    ("cold_start", "algorithm name 'cold_start' is taken by a config section or 'base'"),
    ("base", "algorithm name 'base' is taken by a config section or 'base'"),
])
def test_a_bad_method_name_is_refused(name, message):
    with pytest.raises(ConfigError) as info:
        register_method(name, _ToySection)
    assert str(info.value) == message
    assert name not in method_names()
