"""Where a `--model` comes from: a local Hugging Face model directory, or `hf:REPO_ID[@REVISION]`
downloaded through `huggingface_hub` (the optional extra `minigpt-lab[hf]`) into its standard
cache (`$HF_HOME/hub`; `HF_HUB_OFFLINE=1` uses only what is cached).

Only what minigpt reads is downloaded (config, safetensors weights and their index, tokenizer
files): never pickled weights.

What a model directory may hand minigpt (`model_file`, the one place the rule lives): a file
that is, after following symlinks, a regular file inside the directory itself -- or, for a
snapshot in a Hugging Face cache (`.../models--ORG--NAME/snapshots/REV/`, whose files are
links to `../../blobs/SHA`), inside that repository's cache folder `models--ORG--NAME/`. A
link out of there (to /etc/passwd, a FIFO, /dev/zero, another user's model) is refused before
it is opened, and so is anything that is not a regular file. docs/security.md has the rule.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import parse_json, read_problem, read_regular

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
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            os.listdir(path)  # minigpt looks for files in it: it must be readable
    except FileNotFoundError:
        hint = f" (a Hub model? write {PREFIX}{text})" if _REPO_ID.match(text) else ""
        raise ArgumentError("model", f"no such directory{hint}; give a Hugging Face model "
                            f"directory or {PREFIX}REPO_ID[@REVISION]", subject=path) from None
    except OSError as e:
        raise ArgumentError("model", f"cannot read the directory ({read_problem(e)})",
                            subject=path) from None
    if not stat.S_ISDIR(mode):
        what = "is a file" if stat.S_ISREG(mode) else "is not a directory"
        raise ArgumentError("model", f"{what}; give the model's directory (config.json, "
                            "model.safetensors, tokenizer files)", subject=path)
    return path


def files_root(directory: Path) -> Path:
    """Where the files of a model directory may resolve to: the directory itself (symlinks in
    its own path resolved), or the repository folder of a Hugging Face cache snapshot."""
    real = Path(os.path.realpath(directory))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def model_file(directory: Path, name: str) -> Path | None:
    """`directory / name` when the model directory has it, None when it does not. MinigptError
    naming the file when it is a symlink resolving outside `files_root(directory)`, a dangling
    or looping link, not a regular file (a FIFO, a device, a directory) or not accessible."""
    path = directory / name
    try:
        real = Path(os.path.realpath(path, strict=True))
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        if not path.is_symlink():
            return None
        raise MinigptError(f"{path}: a symlink to {os.readlink(path)}, which does not exist; "
                           "download the model again") from None
    except OSError as e:
        raise MinigptError(f"{path}: cannot read it ({read_problem(e)})") from None
    root = files_root(directory)
    if not real.is_relative_to(root):
        raise MinigptError(f"{path}: a symlink to {real}, outside the model directory {root}; "
                           "minigpt reads a model's files only from inside its directory (or "
                           "its Hugging Face cache folder): copy the file in instead")
    if not stat.S_ISREG(mode):
        raise MinigptError(f"{path}: not a regular file; a model directory holds files")
    return path


def read_model_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a file `model_file` returned, at most `max_bytes`; MinigptError naming it."""
    try:
        return read_regular(path, max_bytes)
    except OSError as e:
        raise MinigptError(f"{path}: cannot read it ({read_problem(e)})") from None


def read_model_json(path: Path, max_bytes: int) -> object:
    """The parsed JSON of a file `model_file` returned; MinigptError naming it when it cannot be
    read or is not JSON (nested more than a few dozen levels deep included)."""
    data = read_model_file(path, max_bytes)
    try:
        return parse_json(data)
    except ValueError as e:
        raise MinigptError(f"{path}: {e}") from None


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
    except _hub_errors() as e:  # offline, unknown repo or revision, HTTP and network errors
        if _offline() and isinstance(e, FileNotFoundError):  # the cache miss
            raise ArgumentError("model", "download failed: not in huggingface_hub's cache, and "
                                "HF_HUB_OFFLINE is set, so nothing was downloaded; run once with "
                                "the network and HF_HUB_OFFLINE unset to fetch it, or give a "
                                "local model directory", subject=name) from None
        raise ArgumentError("model", f"download failed ({type(e).__name__}: {_gist(str(e))}); "
                            "check the repository id and the network, or give a local model "
                            "directory (HF_HUB_OFFLINE=1 uses only huggingface_hub's cache)",
                            subject=name) from None


def _offline() -> bool:
    """huggingface_hub's offline mode (HF_HUB_OFFLINE, read when it was imported)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _gist(message: str, limit: int = 300) -> str:
    """An error message on one line, whole sentences only: cut after the last sentence that
    ends within `limit` characters (else at the last word, marked with ...)."""
    text = " ".join(message.split())
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    if end > 0:
        return text[:end + 1]
    return text[:text.rfind(" ", 0, limit)] + " ..."


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What `snapshot_download` raises for a download that cannot be made: OSError (HTTP
    errors, the offline cache miss, a full disk), the hub's validation and not-found errors, and
    the HTTP client's network errors (httpx for huggingface_hub >= 1, requests before; both
    optional here). Anything else is a bug and keeps its traceback."""
    import importlib

    found: list[type[BaseException]] = [OSError]
    for module, name in (("huggingface_hub.errors", "HFValidationError"),
                         ("huggingface_hub.errors", "EntryNotFoundError"),
                         ("huggingface_hub.errors", "XetDownloadError"),
                         ("huggingface_hub.utils", "HFValidationError"),
                         ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            kind = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(kind, type) and issubclass(kind, BaseException):
            found.append(kind)
    return tuple(found)
