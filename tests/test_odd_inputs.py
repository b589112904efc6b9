"""Inputs that look odd but are not errors, through the CLI: an empty prompt, a prompt
longer than the context, special-token text in a prompt, an empty config file. Their
behaviour is part of the contract.
"""

from __future__ import annotations

import json

import pytest
from cli_world import BLOCK
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import Config, to_yaml

pytestmark = pytest.mark.usefixtures("isolated")


def test_empty_prompt_starts_from_endoftext(world):
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "-p", "", "-n", "3",
                                 "--seed", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["prompt"] == "" and doc["prompt_tokens"] == 1  # just <|endoftext|>


def test_huge_prompt_is_left_truncated_not_an_error(world, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("all the world's a stage " * 20000)  # ~480 KB
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "--prompt-file", str(big),
                                 "-n", "2", "--seed", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    assert "longer than the model's context" in r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == BLOCK


def test_special_token_text_in_prompt_is_ordinary_text(world):
    text = "<|endoftext|>"
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "-p", text, "-n", "1",
                                 "-t", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(text.encode())  # bytes, not 1 special
    r = CliRunner().invoke(app, ["inspect-heads", "--run", str(world.good), "--text", text,
                                 "--json"])
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == len(text.encode())


def test_empty_config_file_means_all_defaults(world, tmp_path):
    """A config file with nothing in it is valid (documented: missing keys keep defaults)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = CliRunner().invoke(app, ["train", "--print-config", "--config", str(empty)])
    assert r.exit_code == 0, r.stderr
    defaults = Config()
    defaults.run.name = "empty"  # the run name comes from the file name
    assert r.stdout == to_yaml(defaults)
