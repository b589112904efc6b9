"""metrics.jsonl read back, and the one meaning of "a number" in a run's JSON files. JSON has
no NaN or infinity: a number that is not finite is written as null and read back as missing
(`finite`). No torch here: `minigpt runs` and `minigpt curves` read runs through this module
and start without loading it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from minigpt.files import LARGE_CAP, ReadError, parse_json, read_file


def finite(x: Any) -> int | float | None:
    """`x` if it is a finite number (an int or a float, not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return x if math.isfinite(x) else None


def json_safe(record: dict) -> dict:
    """`record` with every float that is not finite replaced by None (JSON's null)."""
    return {k: finite(v) if isinstance(v, float) else v for k, v in record.items()}


# --------------------------------------------------------------------------------------------
# metrics.jsonl read back.


def _record(line: str | bytes) -> dict | None:
    """A metrics.jsonl line as a record: a JSON object with an integer `step`, else None (also
    for a line past `parse_json`'s limits: nested 100,000 deep, a 5,000-digit number)."""
    try:
        rec = parse_json(line.encode("utf-8") if isinstance(line, str) else line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def _metrics_bytes(path: Path) -> bytes | None:
    """metrics.jsonl's bytes through the file door (None: no file); ReadError otherwise."""
    try:
        return read_file(path, LARGE_CAP)
    except ReadError as e:
        if not os.path.lexists(path):
            return None
        raise e from None


def _metrics_text(path: Path) -> str | None:
    """metrics.jsonl's text (bytes that are not UTF-8 as U+FFFD), None: no file."""
    data = _metrics_bytes(path)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and the number of damaged lines skipped: a line that is
    not a JSON object with an integer `step` (a torn last line after kill -9, an edit, bit rot).
    Blank lines are neither. A missing file is ([], 0). Never raises on content; a file that
    is not a regular file or is larger than 1 GiB is a ReadError naming it."""
    text = _metrics_text(Path(path))
    out, bad = [], 0
    for line in (text or "").split("\n"):  # JSON Lines: a line ends at \n alone
        if not line.strip():
            continue
        rec = _record(line)
        if rec is not None:
            out.append(rec)
        else:
            bad += 1
    return out, bad


def metrics_upto(path: Path, step: int) -> tuple[list[bytes], list[dict], int]:
    """What a session resuming at `step` keeps of metrics.jsonl: its lines (verbatim bytes),
    their records, and how many of the lines are not records. Kept: every record up to `step`,
    and every line that is not a record, where it stands (a damaged line, a note someone
    wrote, bytes that are not UTF-8: the tool never drops or rewrites what it cannot read;
    readers skip such lines and say so). Left out: records after `step` (those of the session
    that was stopped, which this one replays) and blank lines."""
    lines, records, unread = [], [], 0
    for line in (_metrics_bytes(Path(path)) or b"").split(b"\n"):
        if not line.strip():
            continue
        rec = _record(line)
        if rec is None:
            lines.append(line)
            unread += 1
        elif rec["step"] <= step:
            lines.append(line)
            records.append(rec)
    return lines, records, unread
