"""Lazy safetensors access: every tensor of a (sharded) checkpoint as a memory-mapped numpy view.

The format is an 8-byte little-endian header length, a JSON header mapping names to dtype, shape and
byte offsets, then raw data. Mapping the file (rather than `safetensors.numpy.load_file`) lets the loader
slice just the part of a tensor that a device needs, and handles bfloat16 through ml_dtypes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsDir:
    """All tensors of the `*.safetensors` files in one directory, by name, memory-mapped on demand."""

    def __init__(self, path: str | Path, files: list[Path] | None = None):
        self.path = Path(path)
        files = files if files is not None else sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for file in files:
            header, data_start = _read_header(file)
            for name, info in header.items():
                self._where[name] = (file, info, data_start)
        self._maps: dict[Path, np.memmap] = {}

    @classmethod
    def single(cls, file: str | Path) -> SafetensorsDir:
        """The tensors of one safetensors file."""
        return cls(Path(file).parent, [Path(file)])

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def _entry(self, name: str) -> tuple[Path, dict, int]:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not found in the safetensors files of {self.path}")
        return self._where[name]

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the whole tensor; slicing it reads only the touched pages."""
        file, info, data_start = self._entry(name)
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[file][data_start + begin : data_start + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (any dtype in the table, bfloat16 included) as one safetensors file."""
    arrays = {name: np.asarray(arr) for name, arr in tensors.items()}
    layout = [(name, arr.dtype, arr.shape) for name, arr in arrays.items()]
    write_streaming(path, layout, arrays.items(), metadata)


def write_streaming(
    path: str | Path,
    layout: list[tuple[str, np.dtype, tuple[int, ...]]],
    blocks: Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file whose tensors (`layout`: name, dtype, shape, in file order) arrive as
    `blocks`: (name, array) pieces in that order, each tensor's pieces concatenating (C order) to its
    bytes, e.g. row ranges. Only one piece is in memory at a time, so a file can be larger than RAM."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    sizes = []
    for name, dtype, shape in layout:
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written to safetensors")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        sizes.append((name, dtype, nbytes))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    pending = iter(sizes)
    current, left = None, 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, arr in blocks:
            arr = np.ascontiguousarray(arr)
            while left == 0 and name != current:  # the previous tensor is complete: on to the next
                current, dtype, left = next(pending, (None, None, 0))
                if current is None:
                    raise ValueError(f"{path}: block of {name!r} is not in the layout (or comes after its tensor)")
            if name != current or arr.dtype != dtype or arr.nbytes > left:
                raise ValueError(f"{path}: got a block of {name!r} ({arr.dtype}, {arr.nbytes} bytes) while "
                                 f"writing {current!r} ({dtype}, {left} bytes left)")
            f.write(arr.reshape(-1).view(np.uint8).data)
            left -= arr.nbytes
            del arr  # not held while the next block is produced
        rest = [n for n, _, size in pending if size] + ([current] if left else [])
        if rest:
            raise ValueError(f"{path}: no data given for tensors {rest[:3]}")
