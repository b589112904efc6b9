"""Property tests at the CLI level: any `--set` text or config file either loads (exit 0,
YAML on stdout) or fails with exactly one `error:` line and exit 2. Never a traceback.
"""

from __future__ import annotations

import pytest
from conftest import error_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from minigpt.cli import app

pytestmark = pytest.mark.usefixtures("isolated")


_keys = st.sampled_from(["model.n_layer", "model.dropout", "model.pos_encoding", "train.lr",
                         "train.learning_rate", "train.sample_prompts", "train.compile",
                         "run.seed", "data.corpus", "tokenizer.vocab_size", "model", "x.y.z",
                         ""])
_values = st.one_of(st.text(max_size=20), st.integers().map(str),
                    st.floats(allow_nan=True).map(str),
                    st.sampled_from(["", "[", "{a: 1}", "- 1", "!!python/object:os.system",
                                     "&a [*a]", "1e999", "0x10", "yes", "~", "'x", "\x00"]))


def _loads_or_one_line(result) -> None:
    """The config printed, or one clean error line (conftest.error_line)."""
    if result.exit_code == 0 and result.exception is None:
        assert result.stdout.startswith("model:") and "Traceback" not in result.stderr
    else:
        error_line(result)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", _keys, _values),
                               st.text(max_size=30)), min_size=1, max_size=3))
def test_any_set_loads_or_fails_in_one_line(sets):
    args = ["train", "--print-config"]
    for s in sets:
        args += ["--set", s]
    _loads_or_one_line(CliRunner().invoke(app, args))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                           st.text(max_size=8)),
                 lambda kids: st.one_of(st.lists(kids, max_size=3),
                                        st.dictionaries(st.sampled_from(
                                            ["model", "train", "n_layer", "dropout", "x"]),
                                            kids, max_size=3)), max_leaves=12)
    .map(lambda v: __import__("yaml").safe_dump(v).encode())))
def test_any_config_file_loads_or_fails_in_one_line(tmp_path, body):
    p = tmp_path / "cfg.yaml"
    p.write_bytes(body)
    _loads_or_one_line(CliRunner().invoke(app, ["train", "--print-config", "--config", str(p)]))
