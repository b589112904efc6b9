"""The files inspect-heads writes: which formats (`parse_formats`, in flags.py: `table` is the
terminal, the rest are files), where (`out_dir`: `--out`, else <run>/heads/, created and
proven writable before any work, every destination checked then too: `check_destinations`),
and writing them (`write_files`: PNG heatmaps from
`attention_png.py`, the HTML viewer from `viewer.py`, the raw tensor and the scores JSON from here).
Every file is written durably (`minigpt.files`: temp file, fsync, rename)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from minigpt.errors import ArgumentError, WriteError
from minigpt.files import atomic_write_bytes, not_replaceable, read_only_dir
from minigpt.heads.attention_png import write_pngs
from minigpt.heads.flags import FORMATS, parse_formats  # noqa: F401 - re-exported
from minigpt.heads.head_circuits_png import write_circuit_pngs
from minigpt.heads.inspection import Inspection
from minigpt.heads.lens_png import write_lens_png
from minigpt.heads.qk_png import write_qk_pngs
from minigpt.heads.viewer import write_html


def out_dir(formats: Sequence[str], out: Path | None, run_dir: Path | None,
            names: Sequence[str] = ()) -> Path | None:
    """The directory for the files of `formats` (None: only the table was asked for): `out`,
    else <run_dir>/heads/; made now, before any work (`make_out_dir`), and the place of every
    file of `names` (`file_names`) checked (`check_destinations`). An imported model has no
    run directory: ArgumentError (`out`) unless `out` is given."""
    files = [f for f in formats if f != "table"]
    if not files:
        return None
    if out is None and run_dir is None:
        raise ArgumentError("out", f"an imported model has no run directory to write the "
                            f"{', '.join(files)} files into; give {{name}} DIR")
    path = make_out_dir(Path(out) if out is not None else Path(run_dir) / "heads")
    check_destinations(path, names)
    return path


def make_out_dir(path: Path) -> Path:
    """Create `path` if needed and check that it is writable (files.read_only_dir: nothing is
    written to find out); ArgumentError (`out`) if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        why = read_only_dir(path)  # asked, not probed: no test file to leave behind
    except OSError as e:
        why = f"cannot write there ({e.strerror or e})"
    if why is not None:
        raise ArgumentError("out", f"{why}; give a writable directory with {{name}}",
                            subject=path)
    return path


def file_names(formats: Sequence[str], layers: Sequence[int], heads: Sequence[int],
               ablation: object = None, composition: object = None,
               circuits: object = None, lens: object = None,
               qk: Sequence[str] = ()) -> list[str]:
    """The names of the files `write_files` writes for `formats`, the selected `layers` and
    `heads`, and what is measured (each true when it is: `ablation` the mode, `composition`,
    `circuits` dla or the text patched from, `lens` the logit lens; `qk` the names of the
    heads whose scores are split, L1.H2)."""
    pairs = [(layer, head) for layer in layers for head in heads]
    names = []
    if "png" in formats:
        names += ["attention_grid.png", *(["ablation.png"] if ablation else []),
                  *(f"attention_L{la}_H{h}.png" for la, h in pairs),
                  *(["composition.png"] if composition else []),
                  *(["circuits.png"] if circuits else []),
                  *(["lens.png"] if lens else []),
                  *(f"qk_{name.replace('.', '_')}.png" for name in qk)]
    if "safetensors" in formats and qk:
        names.append("qk.safetensors")
    for fmt, name in (("html", "attention.html"), ("safetensors", "attention.safetensors"),
                      ("json", "scores.json")):
        if fmt in formats:
            names.append(name)
    return names


def check_destinations(out: Path, names: Sequence[str]) -> None:
    """Every file of `names` may be written in `out`: one that is a FIFO, a device, a socket
    or a directory is refused now, before any work (ArgumentError `out`), not after the
    other files are written."""
    for name in names:
        why = not_replaceable(out / name)
        if why is not None:
            raise ArgumentError("out", f"{name} there: {why}", subject=out)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextmanager
def saying_what_was_written(out: Path, names: Sequence[str]) -> Iterator[None]:
    """A WriteError (a full disk) while the files `names` are written into `out` says, in its
    one line, which of them this command wrote, complete (each write is atomic: a new file
    replaces the old whole), and which it did not: an old file of that name is left as it was."""
    before = {n: _stamp(out / n) for n in names}
    try:
        yield
    except WriteError as e:
        done = [n for n in names if _stamp(out / n) not in (None, before[n])]
        left = [n for n in names if n not in done]
        raise WriteError(f"{e}; written in {out} (complete): {', '.join(done) or 'none'}; not "
                         f"written: {', '.join(left) or 'none'}", e.path, e.errno) from None


def write_files(insp: Inspection, out: Path, formats: Sequence[str], layers: Sequence[int],
                heads: Sequence[int]) -> list[Path]:
    """Write the files of `formats` into `out` for the selected heads; the paths written."""
    pairs = [(layer, head) for layer in layers for head in heads]
    written: list[Path] = []
    if "png" in formats:
        written += write_pngs(insp, out, pairs)
        written += write_circuit_pngs(insp, out)
        written += write_lens_png(insp, out)
        written += write_qk_pngs(insp.qk, out, insp.qk_pairs)
    if "html" in formats:
        written.append(write_html(insp, out / "attention.html", pairs))
    if "safetensors" in formats:
        written.append(write_safetensors(insp, out / "attention.safetensors"))
        if insp.qk is not None:
            written.append(write_qk_safetensors(insp, out / "qk.safetensors"))
    if "json" in formats:
        written.append(write_json(insp, out / "scores.json", layers, heads))
    return written


def write_json(insp: Inspection, path: Path, layers: Sequence[int] | None = None,
               heads: Sequence[int] | None = None) -> Path:
    """`Inspection.to_json` of the selected heads, indented."""
    text = json.dumps(insp.to_json(layers, heads), indent=2, ensure_ascii=False,
                      allow_nan=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def write_safetensors(insp: Inspection, path: Path) -> Path:
    """The raw attention `attention` (n_layer, n_head, T, T) float32 and `tokens` (T,) int64;
    metadata (strings): tokens / token_strs as JSON, run, step, source, layout."""
    from safetensors.torch import save

    meta = {"tokens": json.dumps(insp.tokens), "token_strs": json.dumps(insp.token_strs),
            "run": insp.run, "step": str(insp.step), "source": insp.source,
            "layout": "attention[layer, head, query, key]", "format": "minigpt-attention/1"}
    blob = save({"attention": insp.attention.contiguous(),
                 "tokens": torch.tensor(insp.tokens, dtype=torch.int64)}, metadata=meta)
    return atomic_write_bytes(path, blob)


def write_qk_safetensors(insp: Inspection, path: Path) -> Path:
    """Each split head's per-pair grids (interp.qk), float64: `L1.H2.score` and `L1.H2.margin`
    [pair, query writer, key writer], `L1.H2.pairs` [pair, (batch, query, key)] int64,
    `L1.H2.scores` and `L1.H2.margins` [pair] (the model's own); metadata (strings): each
    head's writers as JSON (`L1.H2.writers`), tokens, run, step, source, layout."""
    from safetensors.torch import save

    tensors, meta = {}, {"tokens": json.dumps(insp.tokens), "run": insp.run,
                         "step": str(insp.step), "source": insp.source, "pairs": insp.qk_pairs,
                         "layout": "score/margin[pair, query writer, key writer]",
                         "format": "minigpt-qk/1"}
    for h in insp.qk:
        tensors[f"{h.name}.score"] = h.grid.contiguous()
        tensors[f"{h.name}.margin"] = h.margin_grid.contiguous()
        tensors[f"{h.name}.scores"] = h.scores.contiguous()
        tensors[f"{h.name}.margins"] = h.margins.contiguous()
        tensors[f"{h.name}.pairs"] = torch.tensor(h.pairs, dtype=torch.int64)
        meta[f"{h.name}.writers"] = json.dumps(h.writers)
    return atomic_write_bytes(path, save(tensors, metadata=meta))
