"""Where things are found: the bundled configs and corpus, user paths, the cache directory.

The project root holds configs/ and data/ next to the package; an editable install
(`pip install -e .`) keeps `minigpt/` inside that root. A wheel install puts copies under
<prefix>/share/minigpt-lab/ (pyproject's data-files). Either way both are found from any
working directory. Standard library only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from minigpt.errors import MinigptError

PACKAGE_DIR = Path(__file__).resolve().parent
_SHARE_DIR = Path(sys.prefix) / "share" / "minigpt-lab"
PROJECT_ROOT = (PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "configs").is_dir()
                or not (_SHARE_DIR / "configs").is_dir() else _SHARE_DIR)
CONFIGS_DIR = PROJECT_ROOT / "configs"
DATA_DIR = PROJECT_ROOT / "data"


def is_glob(s: str) -> bool:
    return any(ch in s for ch in "*?[")


def resolve_path(value: str | Path) -> Path:
    """Resolve a user path (file, directory or glob): relative to the working directory when
    that matches something, else relative to the project root, so the bundled
    `data/tinyshakespeare.txt` and `configs/*.yaml` are found from any directory. When neither
    matches, the working-directory path is returned so errors name what the user typed."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p
    for base in (Path.cwd(), PROJECT_ROOT):
        candidate = base / p
        if candidate.exists() or (is_glob(str(p)) and any(base.glob(str(p)))):
            return candidate
    return Path.cwd() / p


def cache_root(cache_dir: str) -> Path:
    """`data.cache_dir`, else $MINIGPT_CACHE, else $XDG_CACHE_HOME/minigpt, else
    ~/.cache/minigpt. A relative $XDG_CACHE_HOME is ignored (the XDG rule), and so is an empty
    or relative $HOME: with neither usable, MinigptError asks for MINIGPT_CACHE rather than
    guessing (an empty HOME would otherwise put the cache at /.cache/minigpt)."""
    if cache_dir:
        return Path(cache_dir).expanduser().absolute()
    env = os.environ.get("MINIGPT_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "minigpt"
    home = os.environ["HOME"] if "HOME" in os.environ else os.path.expanduser("~")
    if not os.path.isabs(home):
        raise MinigptError(f"no cache directory: HOME is {home!r}, not an absolute path, and "
                           "neither MINIGPT_CACHE nor XDG_CACHE_HOME is set; set MINIGPT_CACHE "
                           "(or data.cache_dir) to a directory for minigpt's cache")
    return Path(home) / ".cache" / "minigpt"
