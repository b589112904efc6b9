"""Config loading: strict YAML, typing by field, validation messages, `--set` overrides."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import error_line, in_process
from hypothesis import given, settings
from hypothesis import strategies as st

from minigpt.config import (
    Config,
    ConfigError,
    apply_overrides,
    describe_fields,
    find_config,
    from_dict,
    load_config,
    model_hash,
    parse_override,
    parse_yaml,
    to_yaml,
)
from minigpt.paths import CONFIGS_DIR

BUNDLED = sorted(CONFIGS_DIR.glob("*.yaml"))


def write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_every_bundled_config_loads_and_round_trips(path):
    cfg = load_config(path)
    assert cfg.run.name == path.stem
    again = from_dict(parse_yaml(to_yaml(cfg)))
    assert again == cfg


def test_small_data_is_the_speedrun_recipe_for_twice_its_steps():
    """configs/small-data.yaml says so (and docs/config.md): a change to the speedrun's recipe
    that small-data does not follow fails here, not silently."""
    speedrun, small = (dataclasses.asdict(load_config(n)) for n in ("speedrun", "small-data"))
    assert small["train"].pop("max_steps") == 2 * speedrun["train"].pop("max_steps")
    for cfg in (speedrun, small):  # how often it evaluates, and the run's name, may differ
        cfg["train"].pop("eval_interval")
        cfg["run"].pop("name")
    assert small == speedrun


def test_bundled_set_is_what_the_readme_promises():
    assert {"default", "bytes", "induction"} <= {p.stem for p in BUNDLED}


def test_no_config_means_default_yaml():
    assert find_config(None) == CONFIGS_DIR / "default.yaml"
    assert load_config(None) == load_config(CONFIGS_DIR / "default.yaml")


def test_bare_name_finds_bundled_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # from any working directory
    assert load_config("bytes").tokenizer.vocab_size == 256
    assert load_config("configs/bytes.yaml").model.block_size == 64


def test_missing_keys_keep_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  n_layer: 2\n"))
    assert cfg.model.n_layer == 2
    assert cfg.model.n_embd == Config().model.n_embd
    assert cfg.train == Config().train


@pytest.mark.parametrize("text, field, value", [
    ("train:\n  learning_rate: 1e-3\n", "learning_rate", 1e-3),   # YAML 1.1 reads a string
    ("train:\n  learning_rate: 3\n", "learning_rate", 3.0),       # int accepted for float
    ("train:\n  max_steps: 0123\n", "max_steps", 123),            # not octal 83
    ("train:\n  max_steps: 1_000\n", "max_steps", 1000),
    ("train:\n  max_steps: 2.0e3\n", "max_steps", 2000),          # integral float for int
    ("train:\n  compile: true\n", "compile", "true"),              # bool to a str choice
])
def test_yaml_scalars_are_coerced_by_field_type(tmp_path, text, field, value):
    cfg = load_config(write(tmp_path, text))
    got = getattr(cfg.train, field)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text, needle", [
    ("model:\n  n_layer: 2\n  n_layer: 3\n", "duplicate key 'n_layer' at line 3"),
    ("model:\n  mlp: yes\n", "model.mlp: expected true or false"),       # YAML 1.1 'yes'
    ("model:\n  n_layer: two\n", "model.n_layer: expected an integer"),
    ("model:\n  n_layer: 1.5\n", "model.n_layer: expected an integer"),
    ("model:\n  n_layer: true\n", "model.n_layer: expected an integer"),
    ("model:\n  n_layer: -1\n", "model.n_layer: must be >= 1"),
    ("model:\n  n_embd: 0\n", "model.n_embd: must be >= 1"),
    ("model:\n  dropout: 1.0\n", "model.dropout: must be < 1.0"),
    ("model:\n  dropout: -0.1\n", "model.dropout: must be >= 0.0"),
    ("train:\n  learning_rate: 0\n", "train.learning_rate: must be > 0.0"),
    ("train:\n  learning_rate: .nan\n", "train.learning_rate: must be a finite number"),
    ("train:\n  learning_rate: .inf\n", "train.learning_rate: must be a finite number"),
    ("model:\n  n_head: 3\n", "model.n_head: 3 does not divide model.n_embd=128"),
    ("model:\n  n_embd: 12\n  n_head: 4\n", "head dimension must be even"),
    ("model:\n  nlayer: 2\n", "unknown key 'nlayer' in section 'model': did you mean 'n_layer'?"),
    ("modle:\n  n_layer: 2\n", "unknown section 'modle': did you mean 'model'?"),
    ("model:\n  pos_encoding: rotary\n", "model.pos_encoding: 'rotary' is not one of"),
    ("model: 3\n", "section 'model' must be a mapping"),
    ("- a\n- b\n", "a config must be a mapping"),
    ("model:\n  n_layer: [2\n", "invalid YAML at line"),
    ("train:\n  min_lr: 0.1\n  learning_rate: 0.01\n", "train.min_lr: 0.1 exceeds"),
    ("train:\n  batch_size: 12\n  micro_batch_size: 5\n", "train.micro_batch_size: 5 does not"),
    ("model:\n  head_init: zero\n", "model.head_init: zero needs model.tie_weights: false"),
    ("model:\n  head_init: zeros\n", "model.head_init: 'zeros' is not one of normal, zero"),
    ("model:\n  activation: tanh\n", "model.activation: 'tanh' is not one of"),
    ("model:\n  logit_softcap: -1\n", "model.logit_softcap: must be >= 0.0"),
    ("train:\n  optimizer: sgd\n", "train.optimizer: 'sgd' is not one of adamw, muon"),
    ("train:\n  schedule: linear\n", "train.schedule: 'linear' is not one of cosine, wsd"),
    ("train:\n  decay_fraction: 1.5\n", "train.decay_fraction: must be <= 1.0"),
    ("train:\n  muon_lr: 0\n", "train.muon_lr: must be > 0.0"),
    ("train:\n  muon_momentum: 1\n", "train.muon_momentum: must be < 1.0"),
    ("train:\n  muon_weight_decay: -0.1\n", "train.muon_weight_decay: must be >= 0.0"),
])
def test_validation_errors_are_one_line_and_name_the_field(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert needle in msg
    assert "\n" not in msg
    assert str(p) in msg  # names the file


def test_odd_head_dim_is_fine_without_rope(tmp_path):
    cfg = load_config(write(tmp_path,
                            "model:\n  n_embd: 12\n  n_head: 4\n  pos_encoding: learned\n"))
    assert cfg.model.head_dim == 3


@pytest.mark.parametrize("text", ["", "# only a comment\n", "model:\n"])
def test_empty_documents_and_sections_mean_defaults(tmp_path, text):
    cfg = load_config(write(tmp_path, text))
    assert cfg.model == Config().model


def test_binary_and_missing_files_are_clear(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\x00\xff\xfe garbage \x89PNG")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(p)
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path) + "/")


def test_set_overrides_are_typed_like_the_field():
    assert parse_override("model.n_layer=6") == ("model", "n_layer", 6)
    assert parse_override("train.learning_rate=3e-4") == ("train", "learning_rate", 3e-4)
    assert parse_override("model.mlp=false") == ("model", "mlp", False)
    assert parse_override("model.mlp=off") == ("model", "mlp", False)
    assert parse_override("run.name=a=b") == ("run", "name", "a=b")  # str kept verbatim
    assert parse_override("run.name=007") == ("run", "name", "007")
    assert parse_override("train.sample_prompts=ROMEO:,JULIET:") == (
        "train", "sample_prompts", ["ROMEO:", "JULIET:"])
    cfg = load_config(None, ["model.n_layer=6", "train.max_steps=5"])
    assert (cfg.model.n_layer, cfg.train.max_steps) == (6, 5)


@pytest.mark.parametrize("text, needle", [
    ("model.n_layer", "expected section.key=value"),
    ("n_layer=3", "the key must be section.key"),
    ("model.n_layers=3", "did you mean 'n_layer'?"),
    ("mdl.n_layer=3", "unknown section 'mdl'"),
    ("model.n_layer=", "expected an integer"),
    ("model.n_layer=3.5", "expected an integer"),
    ("train.learning_rate=abc", "expected a number"),
    ("model.pos_encoding=alibi", "'alibi' is not one of"),
])
def test_bad_set_overrides(text, needle):
    with pytest.raises(ConfigError) as exc:
        parse_override(text)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_overrides_are_validated_together_with_the_file(tmp_path):
    p = write(tmp_path, "model:\n  n_embd: 128\n")
    with pytest.raises(ConfigError, match="does not divide"):
        load_config(p, ["model.n_head=6"])


def test_model_hash_changes_with_shape_only():
    a = Config().model
    assert model_hash(a) == model_hash(dataclasses.replace(a))
    assert model_hash(a) != model_hash(dataclasses.replace(a, n_layer=a.n_layer + 1))
    later = ({"norm_eps": 1e-6}, {"activation": "gelu_tanh"}, {"activation": "relu2"},
             {"qk_norm": True}, {"head_init": "zero", "tie_weights": False},
             {"logit_softcap": 30.0}, {"attn_dropout": 0.1})
    hashes = {model_hash(dataclasses.replace(a, **change)) for change in later}
    assert len(hashes) == len(later) and model_hash(a) not in hashes


def test_every_field_is_documented():
    rows = describe_fields()
    assert len(rows) == sum(len(dataclasses.fields(type(getattr(Config(), s.name))))
                            for s in dataclasses.fields(Config))
    for path, _tp, _default, help_text in rows:
        assert help_text and "\n" not in help_text, path


# Property-based: any input either loads or fails with a one-line ConfigError, never a traceback.
yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                         st.text(max_size=20))
section_names = st.sampled_from(["model", "tokenizer", "data", "train", "run", "modl", "x"])
key_names = st.sampled_from(["n_layer", "n_head", "n_embd", "block_size", "dropout", "mlp",
                             "learning_rate", "max_steps", "seed", "name", "pos_encoding",
                             "vocab_size", "sample_prompts", "bogus"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(section_names, st.one_of(
    yaml_scalars, st.dictionaries(key_names, st.one_of(yaml_scalars, st.lists(yaml_scalars,
                                                                              max_size=3))))))
def test_from_dict_never_crashes(raw):
    try:
        cfg = from_dict(raw)
    except ConfigError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(cfg, Config)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_parse_override_never_crashes(text):
    try:
        apply_overrides({}, [text])
    except ConfigError as e:
        assert "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_parse_yaml_never_crashes(text):
    try:
        parse_yaml(text)
    except ConfigError as e:
        assert "\n" not in str(e)


@pytest.mark.slow
def test_wheel_ships_every_bundled_config_and_the_corpus(tmp_path):
    """A non-editable install finds configs/ and data/ under <prefix>/share/minigpt-lab/: the
    wheel must carry every configs/*.yaml and the bundled corpus there."""
    import subprocess
    import sys
    import zipfile

    from minigpt.paths import CONFIGS_DIR, PROJECT_ROOT

    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        pytest.skip("not a source checkout: no pyproject.toml to build from")
    import importlib.util

    # reuse the installed setuptools when there is one (fast, offline); else pip fetches it
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(tmp_path), str(PROJECT_ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shared = {n.split("/data/share/minigpt-lab/", 1)[1] for n in names
              if "/data/share/minigpt-lab/" in n}  # <dist>-<version>.data/data/share/...
    assert {f"configs/{c.name}" for c in CONFIGS_DIR.glob("*.yaml")} <= shared
    assert "data/tinyshakespeare.txt" in shared
    from minigpt.paths import PACKAGE_DIR  # every module, subpackages included

    modules = {p.relative_to(PACKAGE_DIR.parent).as_posix() for p in PACKAGE_DIR.rglob("*.py")}
    assert modules <= names


def test_one_parser_reads_every_comma_separated_list():
    """config.fields.comma_list: items stripped, in order, across repeated values; a blank item
    kept for its caller to refuse by name (a `--format png,` names '')."""
    from minigpt.config.fields import comma_list

    assert comma_list("a, b") == ["a", "b"] and comma_list(["a,b", " c "]) == ["a", "b", "c"]
    assert comma_list([]) == [] and comma_list("png,") == ["png", ""]


def test_a_config_name_typo_gets_a_did_you_mean(tmp_path):
    line = error_line(in_process(["train", "--config", "inductoin"], cwd=tmp_path))
    assert "did you mean" in line.lower() and "induction" in line, line
