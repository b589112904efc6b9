"""Where a `--model` comes from: a local Hugging Face model directory, or `hf:REPO_ID[@REVISION]`
downloaded through `huggingface_hub` (the optional extra `minigpt-lab[hf]`) into its standard
cache (`$HF_HOME/hub`; `HF_HUB_OFFLINE=1` uses only what is cached).

Only what minigpt reads is downloaded (config, safetensors weights and their index, tokenizer
files): never pickled weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from minigpt.errors import ArgumentError

PREFIX = "hf:"
FILES = ["config.json", "generation_config.json", "*.safetensors",
         "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
         "vocab.json", "merges.txt", "special_tokens_map.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def parse_hub_spec(spec: str) -> tuple[str, str | None]:
    """'hf:org/name@rev' -> ('org/name', 'rev'); ArgumentError (`model`) for a malformed one."""
    repo, _, revision = spec[len(PREFIX):].partition("@")
    if not _REPO_ID.match(repo) or ".." in repo or (revision == "" and "@" in spec):
        raise ArgumentError("model", "is not hf:REPO_ID[@REVISION] (e.g. hf:gpt2, "
                            "hf:openai-community/gpt2@main)", subject=spec)
    return repo, revision or None


def model_directory(spec: str | Path) -> Path:
    """The local directory of a `--model` spec (downloading an `hf:` one)."""
    text = str(spec)
    if text.startswith(PREFIX):
        return download(*parse_hub_spec(text))
    path = Path(text).expanduser()
    if not path.exists():
        hint = f" (a Hub model? write {PREFIX}{text})" if _REPO_ID.match(text) else ""
        raise ArgumentError("model", f"no such directory{hint}; give a Hugging Face model "
                            f"directory or {PREFIX}REPO_ID[@REVISION]", subject=path)
    if not path.is_dir():
        raise ArgumentError("model", "is a file; give the model's directory (config.json, "
                            "model.safetensors, tokenizer files)", subject=path)
    return path


def download(repo: str, revision: str | None) -> Path:
    """The snapshot directory of `repo` at `revision` in huggingface_hub's cache."""
    name = f"{PREFIX}{repo}" + (f"@{revision}" if revision else "")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ArgumentError("model", "needs huggingface_hub, the optional extra: pip install "
                            "'minigpt-lab[hf]'; or give a local model directory",
                            subject=name) from None
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=FILES))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, HTTP errors: all one line
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__
        raise ArgumentError("model", f"download failed ({why}); check the repository id and the "
                            "network, or give a local model directory (HF_HUB_OFFLINE=1 uses "
                            "only huggingface_hub's cache)", subject=name) from None
