"""Reading and writing safetensors files defensively: nothing here unpickles, and a file's
header is checked (magic bytes, header length, dtypes, shapes, offsets) before any tensor is
read, so a pickle, a zip, a truncated file or a crafted header claiming a huge tensor is a
one-line MinigptError, never an allocation or a crash inside the safetensors library.

The header is read without torch (`minigpt runs` checks weights' headers and starts without
loading it); torch and the library's torch bindings are imported where tensors are made.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.errors import MinigptError
from minigpt.files import open_regular, parse_json, read_problem, read_regular

if TYPE_CHECKING:
    import torch

# safetensors dtype codes and their sizes in bytes.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
# torch dtypes by name (str(torch.float32) == "torch.float32") and their safetensors codes.
TORCH_TO_ST = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16",
               "torch.bfloat16": "BF16", "torch.int64": "I64", "torch.int32": "I32",
               "torch.int16": "I16", "torch.int8": "I8", "torch.uint8": "U8", "torch.bool": "BOOL"}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def tensors_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialise CPU-contiguous copies of `tensors` (shared storage is not allowed), with the
    metadata keys in sorted order: equal tensors and metadata give equal bytes."""
    from safetensors.torch import save as st_save

    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return _sorted_metadata(st_save(flat, metadata=metadata))


def _sorted_metadata(data: bytes) -> bytes:
    """The safetensors library writes `__metadata__` from a hash map whose order changes from
    process to process; rewrite the header (JSON, padded with spaces to a multiple of 8 bytes)
    with the metadata sorted by key. The tensors' entries keep their order, and their offsets
    count from the end of the header, so the data bytes are reused as they are."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def sniff(path: Path, what: str) -> None:
    """Reject files that are clearly not safetensors by their first bytes, before parsing.

    A PyTorch `.pt`/`.pth` file is a zip ('PK\\x03\\x04') or a raw pickle (protocol byte 0x80);
    minigpt never loads either, because unpickling runs arbitrary code. A safetensors file
    whose header length's low bytes read 0x80 0x02-0x05 (a header of 640-1535 bytes, or any
    other multiple of 256 away) starts like a pickle: its JSON header's '{' at byte 8 tells it
    apart (a pickle has no '{' opcode)."""
    try:
        with open_regular(path) as fh:  # never a FIFO or a device
            head = fh.read(9)
    except OSError as e:
        raise MinigptError(f"cannot read {path}: {read_problem(e)}") from None
    if head.startswith(b"PK\x03\x04"):
        raise MinigptError(f"{path} is a zip archive (a PyTorch .pt/.pth?), not safetensors; "
                           f"{what} are loaded only from safetensors, never from pickles")
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5 and head[8:9] != b"{":
        raise MinigptError(f"{path} is a Python pickle, not safetensors; minigpt never loads "
                           f"pickles (they can run code); {what} must be a .safetensors file")


def read_header(path: Path, what: str) -> tuple[dict[str, dict], dict[str, str]]:
    """Parse and validate a safetensors header: returns ({name: {dtype, shape, data_offsets}},
    metadata). Checks the 8-byte little-endian header length against the file size, that the
    header is a JSON object, every dtype is known, shapes are non-negative ints, every byte
    range matches its dtype x shape and lies inside the file (a truncated file fails here)."""
    sniff(path, what)
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    with open_regular(path) as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise MinigptError(f"{bad} ({size} bytes: truncated or empty); {what} are damaged")
        n = int.from_bytes(head, "little")
        if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
            raise MinigptError(f"{bad} (header length {n} does not fit the file size {size}: "
                               f"truncated or not safetensors); {what} are damaged")
        raw = fh.read(n)
    try:
        header = parse_json(raw)
    except ValueError:  # not UTF-8, not JSON, nested too deeply, a huge integer
        raise MinigptError(f"{bad} (header is not JSON); {what} are damaged") from None
    if not isinstance(header, dict):
        raise MinigptError(f"{bad} (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise MinigptError(f"{bad} (__metadata__ is not an object)")
    data_size = size - 8 - n
    for name, info in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_SIZES:
            raise MinigptError(f"{where} has an unknown dtype; {what} are damaged")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offs)):
            raise MinigptError(f"{where} has a malformed shape or offsets; {what} are damaged")
        nbytes = math.prod(shape) * DTYPE_SIZES[info["dtype"]]
        if offs[1] - offs[0] != nbytes or offs[1] > data_size:
            raise MinigptError(f"{where}: its bytes do not fit in the file (truncated?); "
                               f"{what} are damaged")
    return header, {str(k): str(v) for k, v in metadata.items()}


def check_against(header: dict[str, dict], expected: dict[str, torch.Tensor], path: Path,
                  hint: str) -> None:
    """Every expected tensor present with the same dtype and shape, and nothing extra; the
    error names the first mismatching tensor. Runs before any tensor data is read."""
    for name, ref in expected.items():
        info = header.get(name)
        if info is None:
            raise MinigptError(f"{path}: tensor '{name}' is missing; {hint}")
        want_dtype = TORCH_TO_ST.get(str(ref.dtype))
        if info["dtype"] != want_dtype or list(info["shape"]) != list(ref.shape):
            raise MinigptError(
                f"{path}: tensor '{name}' is {info['dtype']}{list(info['shape'])} but the config "
                f"needs {want_dtype}{list(ref.shape)}; {hint}")
    extra = sorted(set(header) - set(expected))
    if extra:
        raise MinigptError(f"{path}: unexpected tensor '{extra[0]}'; {hint}")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Read the tensors of a file whose header was already validated (CPU tensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    try:
        return st_load(read_regular(path, os.stat(path).st_size))
    except (OSError, SafetensorError) as e:  # unreadable, or what the library refuses
        raise MinigptError(f"{path}: cannot read tensors ({e})") from None
