import json
from pathlib import Path

import pytest

from liandan.config import Config, ConfigError, describe, from_dict, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["tiny", "moe-tiny", "gpt2-124m", "llama-1b", "llama-8b"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    assert cfg.model.llama.dim % cfg.model.llama.n_heads == 0


def test_overrides_are_typed_and_applied(tmp_path):
    cfg = load_config(
        CONFIGS / "tiny.toml",
        ["--model.dim=96", "--optim.lr=1e-3", "--train.compile=true", '--data.paths=["a.txt", "b.jsonl"]'],
    )
    assert cfg.model.llama.dim == 96 and isinstance(cfg.model.llama.dim, int)
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.train.compile is True
    assert cfg.data.paths == ["a.txt", "b.jsonl"]
    # a bare word is a string; an int given for a float key becomes a float
    cfg = load_config(None, ["--train.mask=causal", "--optim.lr=1", "--data.paths=x.txt,y.txt"])
    assert cfg.train.mask == "causal"
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.data.paths == ["x.txt", "y.txt"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "llama-8b.toml", ["--train.steps=7000"])
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again == cfg
    assert again.train.steps == 7000


@pytest.mark.parametrize(
    "override, words",
    [
        ("--model.dimm=3", ["unknown key 'model.dimm'", "did you mean 'model.llama.dim'"]),
        ("--modle.dim=3", ["unknown section 'modle'", "did you mean 'model'"]),
        ("--model.dim=big", ["model.dim", "'big'", "must be an integer"]),
        ("--model.dim=2", ["model.dim", "2", "must be >= 8"]),
        ("--optim.beta2=1.5", ["optim.beta2", "1.5", "must be <= 1.0"]),
        ("--train.mask=sliding", ["train.mask", "'sliding'", "'causal'", "'document'"]),
        ("--train.compile=yes", ["train.compile", "'yes'", "true or false"]),
        ("--model.n_heads=5", ["model.dim = 256", "model.n_heads = 5"]),
        ("--model.n_kv_heads=3", ["model.n_kv_heads = 3", "must divide model.n_heads = 4"]),
        ("--train.seq_len=4096", ["train.seq_len = 4096", "model.max_seq_len = 2048"]),
        ("--parallel.dp_shard=0", ["parallel.dp_shard = 0"]),
        ("model.dim", ["must look like --section.key=value"]),
        # a list or table that does not parse is refused, not taken as the string typed
        ('--eval.samples=["hi",', ["--eval.samples=", "not a valid TOML list or table", "end of document"]),
        ('--data.paths=["a" "b"]', ["--data.paths=", "Unclosed array (at character 6)"]),
        ("--model.llama={dim=1", ["--model.llama=", "Unclosed inline table"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert "\n" not in message


def test_tensor_parallel_splits_are_left_to_the_model_family():
    # config.py knows no family: whether tp can split tied embeddings is Llama's spec's to say (test_model_spec)
    cfg = load_config(None, ["--parallel.tp=2", "--model.tie_embeddings=true"])
    assert cfg.parallel.tp == 2 and cfg.model.llama.tie_embeddings


def test_callback_modules_must_be_module_names():
    assert load_config(None, ['--train.callbacks=["mine.callbacks", "_x2"]']).train.callbacks == [
        "mine.callbacks",
        "_x2",
    ]
    for bad in ("mine/callbacks.py", "mine..callbacks", "2fast"):
        with pytest.raises(ConfigError, match=f"train.callbacks: '{bad}' is not a module name"):
            load_config(None, [f'--train.callbacks=["{bad}"]'])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("model = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_config(flat)


def test_defaults_are_valid_and_documented():
    assert from_dict({}) == Config()
    rows = describe()
    assert {key for key, _, _ in rows} >= {
        "model.llama.dim",
        "optim.adamw.beta2",
        "track.wandb.project",
        "train.steps",
        "parallel.tp",
        "data.paths",
    }
    assert all(help_text for _, _, help_text in rows)


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", ".", "..", "a/b", "a\\b", "nul\x00byte", "  "])
def test_run_name_is_one_directory_name(tmp_path, name):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--run.name={name}"])
    message = str(info.value)
    assert message.startswith("run.name = ") and "one directory name" in message and "\n" not in message
    config = tmp_path / "named.toml"
    config.write_text(f"[run]\nname = {json.dumps(name)}\n")  # a TOML basic string is a JSON string
    with pytest.raises(ConfigError, match="run.name"):
        load_config(config)


def test_ordinary_run_names_pass():
    for name in ("", "run", "my-run_2.1", "llama-8b-20250101-120000", "..hidden", "a..b", "运行"):
        assert load_config(None, [f"--run.name={name}"]).run.name == name


@pytest.mark.parametrize(
    "override",
    ["--optim.lr=nan", "--optim.lr=inf", "--optim.lr=-inf", "--model.norm_eps=nan", "--optim.beta1=nan",
     "--resilience.backoff_s=inf", "--forecast.reference_loss=+inf", "--data.weights=[1.0, nan]",
     "--data.weights=[inf]"],
)  # fmt: skip
def test_non_finite_numbers_are_refused(tmp_path, override):
    key = override[2:].split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert message.startswith(key) and "finite" in message and "\n" not in message, message
    section, name = key.split(".")
    value = override.split("=", 1)[1]
    config = tmp_path / "nonfinite.toml"
    config.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match="finite"):
        load_config(config)


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "nul\0", "esc\x1b[31m", "c1\x85"])
def test_a_run_name_with_a_control_character_is_refused(name):
    with pytest.raises(ConfigError, match=r"^run.name = .* must be one directory name: .*control characters"):
        load_config(None, [f"--run.name={name}"])


@pytest.mark.parametrize("name", ["炼丹-1", "my run", "a..b"])
def test_a_run_name_of_any_script_with_spaces_is_accepted(name):
    assert load_config(None, [f"--run.name={name}"]).run.name == name
