"""A strict reader of a GGUF file's header: every count and length is checked against the file first.

gguf-py's ``GGUFReader`` (and transformers' own GGUF reader) trust the counts a header
claims: a 98-byte file that says "this array has 2⁶⁰ elements" makes them allocate
gigabytes before anything notices the file is far too short. This reader walks the
same header without allocating from it: before a string of length L is read, L bytes
must be left in the file; before an array of N elements of type T is walked, N·size(T)
bytes (at least 8 per string) must be left; nested arrays are refused (transformers
cannot read them); tensor infos (name, at most 4 dimensions, a ggml type whose block
size divides the first dimension, an aligned offset) must describe data that lies
inside the file, with no two tensors overlapping. Totals are capped (header bytes,
array elements, keys, tensors), so even a well-formed hostile header cannot make the
readers run after it use much memory. Only a file that passes is handed to
gguf-py/transformers.

What the header says about the model is checked by :func:`check_model_tensors`: the
tensors a causal LM needs (the token embedding and every transformer block the
metadata declares).
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from graftmerge.errors import GraftError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf-py and transformers read; v1 counted in 32 bits
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 65_536  # real models: a few thousand at most
MAX_KEYS = 65_536  # real models: a few dozen
MAX_ARRAY_ELEMENTS = 4 * 2**20  # all metadata arrays together; a 262k vocabulary with scores and types is 0.8M
MAX_HEADER_BYTES = 256 * 2**20  # metadata and tensor infos; a large vocabulary is ~10 MB
# Reading a header costs gguf-py ~1.6 KB per string of a metadata array (two numpy views
# each) and transformers ~60 B per number, so arrays may only be as large as the model
# justifies: 2 KB per 512 tensor values is about what the values cost in float32 anyway.
# Real models sit far inside (SmolLM2-135M: 98k strings, 134M values; Llama-3-8B: 408k, 8B).
STRINGS_FREE, VALUES_PER_STRING = 65_536, 512
ARRAY_ELEMENTS_FREE, VALUES_PER_ARRAY_ELEMENT = 262_144, 64
MAX_KEY_BYTES = 65_535
MAX_TENSOR_NAME_BYTES = 255  # llama.cpp stops at 63
MAX_BLOCKS = 1024  # transformer blocks (the largest public models have under 200)
MAX_ALIGNMENT = 2**20
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# metadata value type -> (struct code, bytes); STRING and ARRAY are variable-length
FIXED_TYPES = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
               7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, n_dims, one dim, type, offset
MIN_KEY_VALUE_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")
HOSTILE = "truncated, corrupt or hostile; refused before reading it"


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info of a GGUF: where its data lies and what it holds."""

    name: str
    dims: tuple[int, ...]  # ggml order: the fastest-moving dimension first
    type_name: str  # a GGMLQuantizationType name (F32, Q4_1, ...)
    start: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def elements(self) -> int:
        """How many values the tensor holds."""
        return prod(self.dims)


@dataclass(frozen=True)
class GgufLayout:
    """A GGUF header that passed every check: scalar metadata, array sizes, tensors in file order."""

    path: Path
    size: int  # bytes of the file
    metadata: dict[str, Any]  # scalar values (strings decoded)
    arrays: dict[str, tuple[int, int]]  # key -> (element type, element count)
    tensors: tuple[GgufTensor, ...]

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` if it is a string."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def tensor(self, name: str) -> GgufTensor | None:
        """The tensor called ``name``, or None."""
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    """Reads a memory-mapped header front to back; nothing is read before its size is checked."""

    def __init__(self, path: Path, data: mmap.mmap, size: int):
        self.path, self.data, self.size = path, data, size
        self.limit = min(size, MAX_HEADER_BYTES)
        self.position = 0

    def need(self, count: int, what: str) -> None:
        """GraftError unless ``count`` more bytes lie inside the file (and the header cap)."""
        left = self.limit - self.position
        if count > left:
            where = (f"only {left} remain in the {self.size}-byte file" if self.limit == self.size
                     else f"graftmerge reads at most {MAX_HEADER_BYTES // 2**20} MiB of GGUF header")
            raise GraftError(f"{self.path}: {what} would take {count} bytes from offset {self.position}, but {where} "
                             f"({HOSTILE})")

    def unpack(self, code: str, width: int, what: str) -> Any:
        """One little-endian value of struct ``code``."""
        self.need(width, what)
        (value,) = struct.unpack_from("<" + code, self.data, self.position)
        self.position += width
        return value

    def skip(self, count: int, what: str) -> None:
        """Step over ``count`` bytes (checked) without reading them."""
        self.need(count, what)
        self.position += count

    def string(self, what: str, max_bytes: int | None = None) -> str:
        """A GGUF string (u64 length, UTF-8 bytes), decoded; GraftError when too long or not UTF-8."""
        length = self.unpack("Q", 8, f"the length of {what}")
        if max_bytes is not None and length > max_bytes:
            raise GraftError(f"{self.path}: {what} at offset {self.position} is {length} bytes long, more than "
                             f"the {max_bytes} graftmerge reads ({HOSTILE})")
        self.need(length, what)
        raw = self.data[self.position : self.position + length]
        self.position += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise GraftError(f"{self.path}: {what} is not UTF-8 text ({HOSTILE})") from error


def open_gguf(file: str | Path) -> GgufLayout:
    """The checked header of the GGUF ``file`` (which must exist, be a file, and name its architecture).

    Needs nothing heavier than numpy, so ``import-gguf`` refuses a bad file before it loads torch.
    """
    path = Path(file)
    if not path.exists():
        raise GraftError(f"{path} does not exist")
    if not path.is_file():
        raise GraftError(f"{path} is not a file (expected a .gguf file)")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise GraftError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    layout = read_gguf_layout(path)
    if layout.architecture is None:
        raise GraftError(f"{path} has no general.architecture in its metadata; cannot tell what model it is")
    return layout


def read_gguf_layout(file: str | Path) -> GgufLayout:
    """Parse and check a GGUF's header (see the module docstring); GraftError naming the file otherwise.

    The caller has checked that ``file`` is a regular file starting with ``GGUF``.
    """
    path = Path(file)
    with open(path, "rb") as handle:
        size = _file_size(handle, path)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(path, data, size)
            cursor.skip(4, "the magic")
            tensor_count, key_count = _counts(cursor)
            metadata, arrays = _read_metadata(cursor, key_count)
            alignment = _alignment(path, metadata)
            infos = [_tensor_info(cursor, index) for index in range(tensor_count)]
            data_start = -(-cursor.position // alignment) * alignment
    tensors = tuple(_checked_tensor(path, size, data_start, alignment, *info) for info in infos)
    _check_no_overlap(path, tensors)
    _check_arrays_fit_the_model(path, arrays, tensors)
    return GgufLayout(path, size, metadata, arrays, tensors)


def _file_size(handle, path: Path) -> int:
    """The open file's size; GraftError when it cannot even hold the fixed part of a header."""
    size = handle.seek(0, 2)
    if size < 24:
        raise GraftError(f"{path}: {size} bytes, too short for a GGUF header (24 bytes) ({HOSTILE})")
    handle.seek(0)
    return size


def _counts(cursor: _Cursor) -> tuple[int, int]:
    """(tensor count, key count) after the version; each checked against the file's size and the caps."""
    path = cursor.path
    version = cursor.unpack("I", 4, "the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        kind = ("a big-endian GGUF; transformers reads little-endian ones" if swapped in VERSIONS
                else f"GGUF version {version}; gguf-py and transformers read versions 2 and 3")
        raise GraftError(f"{path}: {kind}")
    tensor_count = cursor.unpack("Q", 8, "the tensor count")
    key_count = cursor.unpack("Q", 8, "the metadata key count")
    for count, what, cap, least in ((tensor_count, "tensors", MAX_TENSORS, MIN_TENSOR_INFO_BYTES),
                                    (key_count, "metadata keys", MAX_KEYS, MIN_KEY_VALUE_BYTES)):
        if count > cap:
            raise GraftError(f"{path}: its header claims {count} {what}; graftmerge accepts at most {cap} ({HOSTILE})")
        cursor.need(count * least, f"the header's {count} {what} (at least {least} bytes each)")
    return tensor_count, key_count


def _read_metadata(cursor: _Cursor, key_count: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """Every key/value: scalars kept, arrays walked (lengths checked) and kept as (element type, count)."""
    metadata: dict[str, Any] = {}
    arrays: dict[str, tuple[int, int]] = {}
    elements = 0
    for index in range(key_count):
        key = cursor.string(f"metadata key {index}", MAX_KEY_BYTES)
        if key in metadata or key in arrays:
            raise GraftError(f"{cursor.path}: metadata key {key!r} appears twice ({HOSTILE})")
        value_type = cursor.unpack("I", 4, f"the type of {key!r}")
        if value_type == ARRAY:
            arrays[key] = _walk_array(cursor, key, MAX_ARRAY_ELEMENTS - elements)
            elements += arrays[key][1]
        else:
            metadata[key] = _scalar(cursor, key, value_type)
    return metadata, arrays


def _scalar(cursor: _Cursor, key: str, value_type: int) -> Any:
    """One non-array metadata value."""
    if value_type == STRING:
        return cursor.string(f"the value of {key!r}")
    if value_type not in FIXED_TYPES:
        raise GraftError(f"{cursor.path}: metadata {key!r} has value type {value_type}, which GGUF does not define "
                         f"({HOSTILE})")
    code, width = FIXED_TYPES[value_type]
    return cursor.unpack(code, width, f"the value of {key!r}")


def _walk_array(cursor: _Cursor, key: str, allowed: int) -> tuple[int, int]:
    """Step over an array value; (element type, count). Its bytes are checked before it is walked."""
    path = cursor.path
    element_type = cursor.unpack("I", 4, f"the element type of {key!r}")
    count = cursor.unpack("Q", 8, f"the element count of {key!r}")
    if element_type == ARRAY:
        raise GraftError(f"{path}: metadata {key!r} is an array of arrays, which transformers cannot read ({HOSTILE})")
    if element_type != STRING and element_type not in FIXED_TYPES:
        raise GraftError(f"{path}: metadata {key!r} is an array of value type {element_type}, which GGUF does not "
                         f"define ({HOSTILE})")
    if count > allowed:
        raise GraftError(f"{path}: metadata {key!r} claims {count} elements; graftmerge reads at most "
                         f"{MAX_ARRAY_ELEMENTS} array elements in all ({HOSTILE})")
    if element_type != STRING:
        cursor.skip(count * FIXED_TYPES[element_type][1], f"the {count} elements of {key!r}")
        return element_type, count
    cursor.need(count * 8, f"the {count} strings of {key!r}")
    for index in range(count):
        length = cursor.unpack("Q", 8, f"the length of element {index} of {key!r}")
        cursor.skip(length, f"element {index} of {key!r}")
    return element_type, count


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    """``general.alignment`` (default 32): a power of two."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise GraftError(f"{path}: general.alignment is {alignment!r}, not a power of two up to {MAX_ALIGNMENT} "
                         f"({HOSTILE})")
    return alignment


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """(name, dims, ggml type id, offset) of tensor info ``index``; dims checked against GGML_MAX_DIMS."""
    name = cursor.string(f"the name of tensor {index}", MAX_TENSOR_NAME_BYTES)
    dim_count = cursor.unpack("I", 4, f"the dimension count of tensor {name!r}")
    if not 1 <= dim_count <= MAX_DIMS:
        raise GraftError(f"{cursor.path}: tensor {name!r} has {dim_count} dimensions; ggml tensors have 1 to "
                         f"{MAX_DIMS} ({HOSTILE})")
    cursor.need(8 * dim_count + 12, f"the dimensions, type and offset of tensor {name!r}")
    dims = struct.unpack_from(f"<{dim_count}Q", cursor.data, cursor.position)
    cursor.position += 8 * dim_count
    type_id = cursor.unpack("I", 4, f"the type of tensor {name!r}")
    offset = cursor.unpack("Q", 8, f"the offset of tensor {name!r}")
    return name, dims, type_id, offset


def _checked_tensor(path: Path, size: int, data_start: int, alignment: int, name: str, dims: tuple[int, ...],
                    type_id: int, offset: int) -> GgufTensor:
    """The tensor, once its type, shape and data (aligned, inside the file) check out."""
    try:
        qtype = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GraftError(f"{path}: tensor {name!r} has ggml type {type_id}, which gguf-py does not know ({HOSTILE})") \
            from None
    if min(dims) < 1:
        raise GraftError(f"{path}: tensor {name!r} has shape {list(dims)}, with an empty dimension ({HOSTILE})")
    if dims[0] % block:
        raise GraftError(f"{path}: tensor {name!r} of type {qtype.name} has a first dimension of {dims[0]}, not a "
                         f"multiple of its block of {block} values ({HOSTILE})")
    nbytes = prod(dims) // block * block_bytes
    if offset % alignment:
        raise GraftError(f"{path}: tensor {name!r} starts at data offset {offset}, not a multiple of the file's "
                         f"alignment {alignment} ({HOSTILE})")
    if data_start + offset + nbytes > size:
        raise GraftError(f"{path}: tensor {name!r} ({qtype.name}, shape {list(dims)}: {nbytes} bytes at data offset "
                         f"{offset}) ends past the end of the {size}-byte file ({HOSTILE})")
    return GgufTensor(name, tuple(dims), qtype.name, data_start + offset, nbytes)


def _check_no_overlap(path: Path, tensors: tuple[GgufTensor, ...]) -> None:
    """GraftError when two tensors share a name or a byte of data."""
    names = set()
    for tensor in tensors:
        if tensor.name in names:
            raise GraftError(f"{path}: tensor {tensor.name!r} appears twice ({HOSTILE})")
        names.add(tensor.name)
    ordered = sorted(tensors, key=lambda t: (t.start, t.nbytes))
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.start + before.nbytes:
            raise GraftError(f"{path}: the data of tensors {before.name!r} and {after.name!r} overlap ({HOSTILE})")


def _check_arrays_fit_the_model(
    path: Path, arrays: dict[str, tuple[int, int]], tensors: tuple[GgufTensor, ...]
) -> None:
    """GraftError when the metadata arrays are larger than the model's tensors justify (see STRINGS_FREE)."""
    values = sum(tensor.elements for tensor in tensors)
    strings = sum(count for element_type, count in arrays.values() if element_type == STRING)
    elements = sum(count for _, count in arrays.values())
    for count, what, allowed in (
        (strings, "strings", STRINGS_FREE + values // VALUES_PER_STRING),
        (elements, "elements", ARRAY_ELEMENTS_FREE + values // VALUES_PER_ARRAY_ELEMENT),
    ):
        if count > allowed:
            raise GraftError(f"{path}: its metadata arrays hold {count:,} {what}, more than its tensors' {values:,} "
                             f"values justify (at most {allowed:,}); a vocabulary that size comes with a far larger "
                             f"model ({HOSTILE})")


def block_count(layout: GgufLayout) -> int:
    """How many transformer blocks (``blk.N.*``) hold tensors: N from 0 up, each present; GraftError otherwise."""
    blocks = {int(match.group(1)) for t in layout.tensors if (match := BLOCK_TENSOR.match(t.name))}
    if not blocks:
        raise GraftError(f"{layout.path}: it holds no transformer block (no blk.N.* tensor among its "
                         f"{len(layout.tensors)} tensors); not a complete model")
    count = max(blocks) + 1
    if count > MAX_BLOCKS:
        raise GraftError(f"{layout.path}: it has a tensor for block {count - 1}; graftmerge imports models of at "
                         f"most {MAX_BLOCKS} blocks ({HOSTILE})")
    missing = sorted(set(range(count)) - blocks)
    if missing:
        raise GraftError(f"{layout.path}: it has tensors for block {count - 1} but none for block(s) "
                         f"{', '.join(map(str, missing[:5]))}{'...' if len(missing) > 5 else ''}; not a complete model")
    return count


def check_model_tensors(layout: GgufLayout) -> int:
    """The token embedding (one row per token of the tokenizer) and every block the metadata declares hold
    tensors; returns the block count."""
    embedding = layout.tensor("token_embd.weight")
    if embedding is None:
        raise GraftError(f"{layout.path}: it has no token embedding (token_embd.weight) among its "
                         f"{len(layout.tensors)} tensors; not a complete model")
    rows = embedding.dims[1] if len(embedding.dims) > 1 else 1
    tokens = layout.arrays.get("tokenizer.ggml.tokens", (STRING, 0))[1]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        count = layout.arrays.get(key, (STRING, 0))[1]
        if count > rows or (key != "tokenizer.ggml.tokens" and count not in (0, tokens)):  # indexed by token id
            raise GraftError(f"{layout.path}: its metadata {key} has {count:,} entries, but its tokenizer has "
                             f"{tokens:,} tokens and token_embd.weight {rows:,} rows; not a consistent model")
    count = block_count(layout)
    declared = layout.metadata.get(f"{layout.architecture}.block_count")
    if declared is not None and declared != count:
        raise GraftError(f"{layout.path}: its metadata says {layout.architecture}.block_count = {declared}, but it "
                         f"holds tensors for {count} block(s); not a complete model")
    return count
