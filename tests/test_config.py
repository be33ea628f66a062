import pytest

from lopd.config import Config, ConfigError, describe, load_config


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
