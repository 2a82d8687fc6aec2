"""A model folder's safetensors files checked from their headers alone, before any tensor is read.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range), then the tensors' bytes (https://github.com/huggingface/safetensors,
"Format"). A download stopped part way leaves a file whose header is whole but whose data is
short, or a header cut in two; loading it fails deep in a worker, after every process started,
with a traceback that names no file. Reading the headers costs one small read per file, so the
launcher and every rank check each file, the index against the files present, and each file's
size against the byte ranges its header gives (dtype × shape), and name the file at fault.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
#: the largest header safetensors itself accepts (its ``MAX_HEADER_SIZE``)
MAX_HEADER = 100_000_000
REDOWNLOAD = "re-download this file"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its header describes it."""

    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors ``path``'s header describes, after checking that the header parses and that
    the file holds every byte the header's ranges need (no more, no fewer, no overlaps): a
    one-line ``ValueError`` naming the file and what is wrong otherwise."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated: {size} bytes, not even a header; {REDOWNLOAD}")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise ValueError(
                f"{path} is truncated or not a safetensors file: its header claims {length} "
                f"bytes, the file has {size}; {REDOWNLOAD}"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ValueError(
            f"{path} is not a safetensors file: its header cannot be read ({e}); {REDOWNLOAD}"
        ) from None
    entries: dict[str, Entry] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry, begin, end = _entry(path, name, info)
        entries[name] = entry
        ranges.append((begin, end, name))
    ranges.sort()
    at = 0
    for begin, end, name in ranges:
        if begin != at:
            raise ValueError(
                f"{path}'s header places {name!r} at byte {begin}, expected {at} (overlapping or "
                f"gapped tensors); {REDOWNLOAD}"
            )
        at = end
    need = 8 + length + at
    if size != need:
        what = "truncated" if size < need else "longer than its header describes"
        raise ValueError(
            f"{path} is {what}: {size} bytes, its header's tensors need {need}; {REDOWNLOAD}"
        )
    return entries


def _entry(path: Path, name: str, info: object) -> tuple[Entry, int, int]:
    """One header entry checked: a known dtype, a shape, and a byte range of dtype × shape."""
    try:
        assert isinstance(info, dict)
        dtype, shape = str(info["dtype"]), tuple(int(n) for n in info["shape"])
        begin, end = (int(n) for n in info["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path}'s header entry for {name!r} is malformed ({info!r}); {REDOWNLOAD}"
        ) from None
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{path} stores {name!r} as {dtype!r}, a dtype safetensors does not name")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or begin < 0:
        raise ValueError(
            f"{path}'s header gives {name!r} ({dtype}, shape {shape}) {end - begin} bytes, not "
            f"{math.prod(shape) * DTYPE_BYTES[dtype]}; {REDOWNLOAD}"
        )
    return Entry(dtype, shape), begin, end


def folder_tensors(folder: Path) -> tuple[dict[str, str], dict[str, Entry]]:
    """``(tensor name → file, tensor name → entry)`` of a model folder, every safetensors file it
    uses checked (``read_header``) and the index, where there is one, checked against them: it
    parses, names only files that are there, and each tensor it names is in that file."""
    if (folder / INDEX).is_file():
        return _indexed(folder)
    if not (folder / SINGLE).is_file():
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise FileNotFoundError(
            f"{folder} has neither {INDEX} nor {SINGLE}"
            + (f" (it has {', '.join(found)})" if found else "")
            + "; pipetrain.hf reads safetensors files only (transformers' save_pretrained "
            "writes them)"
        )
    entries = read_header(folder / SINGLE)
    return dict.fromkeys(entries, SINGLE), entries


def _indexed(folder: Path) -> tuple[dict[str, str], dict[str, Entry]]:
    index = folder / INDEX
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{index} cannot be read ({e}); {REDOWNLOAD}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map (tensor name -> file); {REDOWNLOAD}")
    headers: dict[str, dict[str, Entry]] = {}
    for file in sorted(set(map(str, weight_map.values()))):
        path = folder / file
        if Path(file).name != file or not path.is_file():
            raise ValueError(
                f"{index} names {file!r}, which {folder} lacks; download it (the index lists "
                "every shard of the model)"
            )
        headers[file] = read_header(path)
    entries: dict[str, Entry] = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise ValueError(
                f"{index} places {name!r} in {file}, whose header has no such tensor (an index "
                "of another version of the model?); re-download the index and its shards"
            )
        entries[name] = headers[file][name]
    return {n: str(f) for n, f in weight_map.items()}, entries
