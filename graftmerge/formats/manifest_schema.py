"""The manifests of Fisher caches and delta folders, checked field by field before use.

A manifest may come from a stranger (the Hub) or be damaged: every field a reader
relies on is checked here for presence, type and allowed values, and every tensor
key an entry names must be filed in a shard, so a bad manifest gives one line
naming the file and the field instead of a KeyError or TypeError mid-merge. The
callers check ``format`` and ``format_version`` first (their messages say to
upgrade), then the tensors themselves against their shards' headers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import SAFETENSORS_DTYPES

FISHER_KINDS = ("diagonal", "kfac", "mixed", "empty")
REPRESENTATIONS = ("diagonal", "kfac")
FACTOR_FIELDS = ("eigenvalues", "eigenvectors", "size", "rank", "clamped")
DELTA_DTYPES = {"float32": "F32", "bfloat16": "BF16"}  # manifest dtype -> the shards' safetensors dtype
SOURCE_FIELDS = ("path", "source", "revision", "sampled_sha256", "tensors")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_count(value: Any, minimum: int = 0) -> bool:
    """An integer (not a bool, not 1.0) of at least ``minimum``."""
    return type(value) is int and value >= minimum


def field(record: Any, key: str, kind: type | tuple[type, ...], where: str, label: str) -> Any:
    """``record[key]``, which must exist and be a ``kind``; GraftError naming ``label`` otherwise."""
    if not isinstance(record, dict):
        raise GraftError(f"{where}: corrupt manifest ({label.rsplit('.', 1)[0] or 'it'} is not an object)")
    if key not in record:
        raise GraftError(f"{where}: corrupt manifest (no `{label}`)")
    value = record[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # JSON true is no number
        raise GraftError(f"{where}: corrupt manifest (`{label}` is {type(value).__name__} {_shown(value)})")
    return value


def _finite(value: int | float) -> bool:
    """A finite float; an integer only within float's range (a 400-digit integer is no weight)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: Any) -> str:
    """A short repr for messages (a stranger's value may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def safe_shard_name(name: Any) -> bool:
    """A ``.safetensors`` file inside the folder: no absolute path, ``..``, empty part, backslash or control
    character."""
    return (isinstance(name, str) and name.endswith(".safetensors") and "\\" not in name
            and not any(ord(c) < 32 or ord(c) == 127 for c in name)
            and all(part not in ("", ".", "..") for part in name.split("/")))


def check_tensor_records(tensors: Any, where: str, label: str) -> dict[str, tuple[int, ...]]:
    """A ``name -> {shape, dtype}`` map (a model fingerprint), checked; the shapes by name."""
    if not isinstance(tensors, dict):
        raise GraftError(f"{where}: corrupt manifest (`{label}` is not an object)")
    shapes = {}
    for name, record in tensors.items():
        shape = field(record, "shape", list, where, f"{label}[{name!r}].shape")
        dtype = field(record, "dtype", str, where, f"{label}[{name!r}].dtype")
        if not all(is_count(dim) for dim in shape) or dtype not in SAFETENSORS_DTYPES:
            raise GraftError(f"{where}: corrupt manifest (`{label}[{name!r}]` has shape {_shown(shape)}, dtype "
                             f"{_shown(dtype)})")
        shapes[name] = tuple(shape)
    return shapes


# -- Fisher caches ----------------------------------------------------------------------------


def check_fisher_manifest(manifest: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Every field a reader uses, checked; the expected shape of every tensor key an entry or factor names.

    ``where`` names the cache in messages. Entries must name weights of ``model.tensors``
    and a representation they hold; diagonal keys, factor keys and their tensors must
    exist; KFAC weights must be 2-D with factor sizes matching their dimensions.
    """
    kind = field(manifest, "kind", str, where, "kind")
    if kind not in FISHER_KINDS:
        raise GraftError(f"{where}: corrupt manifest (`kind` is {_shown(kind)}, not one of {', '.join(FISHER_KINDS)})")
    model = field(manifest, "model", dict, where, "model")
    model_shapes = check_tensor_records(field(model, "tensors", dict, where, "model.tensors"), where, "model.tensors")
    weights = model.get("weights_sha256")
    if weights is not None and not (isinstance(weights, str) and re.fullmatch(r"[0-9a-f]{64}", weights)):
        raise GraftError(f"{where}: corrupt manifest (`model.weights_sha256` is {_shown(weights)}, not a hex sha256)")
    entries = field(manifest, "entries", dict, where, "entries")
    factors = manifest.get("factors", {})
    if not isinstance(factors, dict):
        raise GraftError(f"{where}: corrupt manifest (`factors` is not an object)")
    files = field(manifest, "files", dict, where, "files")
    for key, name in files.items():
        if not safe_shard_name(name):
            raise GraftError(f"{where}: corrupt manifest (`files` puts {key!r} in {_shown(name)}, not a .safetensors "
                             "file inside the cache)")
    clamped = manifest.get("clamped_eigenvalues", 0)
    if not is_count(clamped):
        raise GraftError(f"{where}: corrupt manifest (`clamped_eigenvalues` is {_shown(clamped)})")
    records = {f"factor {key!r}": _factor_shapes(key, record, where) for key, record in factors.items()}
    records.update({f"weight {name!r}": _entry_shapes(name, entry, model_shapes, factors, where)
                    for name, entry in entries.items()})
    check_fisher_naming(entries, factors, model_shapes, where)  # the fields are checked: now their names
    expected: dict[str, tuple[int, ...]] = {}
    owners: dict[str, str] = {}
    for owner, shapes in records.items():
        _name_once(expected, owners, shapes, owner, where)
    unfiled = sorted(set(expected) - set(files))
    if unfiled:
        raise GraftError(f"{where}: corrupt manifest (tensor {unfiled[0]!r} is named but `files` has no shard for it)")
    return expected


def _name_once(expected: dict[str, tuple[int, ...]], owners: dict[str, str], shapes: Mapping[str, tuple[int, ...]],
               owner: str, where: str) -> None:
    """Add ``owner``'s tensor keys to ``expected``; a key another record names already is refused.

    Each stored tensor belongs to one record (a weight's diagonal, or one factor side):
    two records naming one tensor would make one of them read data of another shape or
    of another weight (shared KFAC sides share the factor record, never its tensors).
    """
    for key, shape in shapes.items():
        if key in owners:
            raise GraftError(
                f"{where}: corrupt manifest ({owner} names tensor {key!r} with shape {list(shape)}, but that tensor "
                f"belongs to {owners[key]} (shape {list(expected[key])}); each stored tensor belongs to one entry)"
            )
        expected[key], owners[key] = shape, owner


def _factor_shapes(key: str, record: Any, where: str) -> dict[str, tuple[int, ...]]:
    """One KFAC side's record, checked; its tensors' expected shapes (eigenvalues: size; eigenvectors: size × rank)."""
    label = f"factors[{key!r}]"
    if not isinstance(record, dict) or set(record) - set(FACTOR_FIELDS):
        extra = sorted(set(record) - set(FACTOR_FIELDS)) if isinstance(record, dict) else []
        raise GraftError(f"{where}: corrupt manifest (`{label}` " + (f"has unknown field {extra[0]!r})" if extra else
                                                                    "is not an object)"))
    size = field(record, "size", int, where, f"{label}.size")
    values = field(record, "eigenvalues", str, where, f"{label}.eigenvalues")
    rank = record.get("rank", size)
    if (
        not is_count(size, 1)
        or not is_count(rank, 1)
        or rank > size
        or ("rank" in record and "eigenvectors" not in record)
    ):
        raise GraftError(f"{where}: corrupt manifest (`{label}` has size {_shown(size)}, rank {_shown(rank)})")
    if not is_count(record.get("clamped", 0)):
        raise GraftError(f"{where}: corrupt manifest (`{label}.clamped` is {_shown(record['clamped'])})")
    shapes = {values: (size,)}
    if "eigenvectors" in record:
        shapes[field(record, "eigenvectors", str, where, f"{label}.eigenvectors")] = (size, rank)
    return shapes


def _entry_shapes(name: str, entry: Any, model_shapes: Mapping[str, tuple[int, ...]],
                  factors: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """One weight's entry, checked against ``model.tensors`` and ``factors``; its diagonal key's expected shape."""
    label = f"entries[{name!r}]"
    representation = field(entry, "representation", str, where, f"{label}.representation")
    extra = sorted(set(entry) - {"representation", *REPRESENTATIONS})
    if representation not in REPRESENTATIONS or representation not in entry or extra:
        problem = (
            f"unknown field {extra[0]!r}" if extra else f"representation {_shown(representation)} it does not hold"
        )
        raise GraftError(f"{where}: corrupt manifest (`{label}` has {problem})")
    if name not in model_shapes:
        raise GraftError(f"{where}: corrupt manifest (entry for {name!r}, which is not a tensor of `model.tensors`)")
    shape = model_shapes[name]
    shapes = {}
    if "diagonal" in entry:
        diagonal = field(entry, "diagonal", dict, where, f"{label}.diagonal")
        if set(diagonal) != {"key"}:
            raise GraftError(f"{where}: corrupt manifest (`{label}.diagonal` must hold exactly `key`)")
        key = field(diagonal, "key", str, where, f"{label}.diagonal.key")
        shapes[key] = shape  # the key must be the weight's own name: check_fisher_naming
    if "kfac" in entry:
        kfac = field(entry, "kfac", dict, where, f"{label}.kfac")
        if set(kfac) != {"rows", "columns"}:
            raise GraftError(f"{where}: corrupt manifest (`{label}.kfac` must hold exactly `rows` and `columns`)")
        if len(shape) != 2:
            raise GraftError(f"{where}: KFAC entry for {name!r}, which is not 2-D (shape {shape})")
        for side, dim in (("rows", 0), ("columns", 1)):
            key = field(kfac, side, str, where, f"{label}.kfac.{side}")
            if key not in factors:
                raise GraftError(f"{where}: corrupt manifest (`{label}.kfac.{side}` names factor {_shown(key)}, "
                                 "which `factors` does not have)")
            if factors[key]["size"] != shape[dim]:
                raise GraftError(f"{where}: KFAC {side} factor of {name!r} has size {factors[key]['size']}, weight "
                                 f"{shape} needs {shape[dim]}")
    return shapes


def check_fisher_naming(entries: Mapping[str, Any], factors: Mapping[str, Any],
                        model_shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Each tensor is the one the format names for its weight, and no tensor serves two records.

    The writer's naming rule (``FisherCacheWriter``): a diagonal of weight W is the tensor ``W``;
    a KFAC side is the factor ``kfac/W/rows`` or ``kfac/W/columns``, named after the first weight W
    that used it (W's own entry, when the manifest has one, names it on that side), and its tensors are
    ``<factor>/eigenvalues`` and ``<factor>/eigenvectors``. Other weights may name the same factor (a shared,
    bit-identical side, e.g. q/k/v's input side): that sharing is the format's, and what it vouches for cannot
    be checked from the manifest. Run after the records' fields are checked.
    """
    users: dict[str, str] = {}  # tensor key -> the record that names it
    for name, entry in entries.items():
        if "diagonal" in entry and entry["diagonal"]["key"] != name:
            raise GraftError(f"{where}: the diagonal entry of weight {name!r} names tensor "
                             f"{entry['diagonal']['key']!r}; a diagonal is stored under its weight's own name "
                             "(the manifest was edited or is corrupt: re-estimate or re-download the cache)")
        if "diagonal" in entry:
            _claim(users, name, f"the diagonal of weight {name!r}", where)
    for key, record in factors.items():
        weight, _, side = key[len("kfac/"):].rpartition("/") if key.startswith("kfac/") else ("", "", "")
        if weight not in model_shapes or side not in ("rows", "columns"):
            raise GraftError(f"{where}: factor {key!r} is not named kfac/<weight>/rows or kfac/<weight>/columns after "
                             "a weight of the model (the manifest was edited or is corrupt)")
        own = entries.get(weight, {}).get("kfac")  # None in a partial pull (`--layers`) that left W out
        if own is not None and own.get(side) != key:
            raise GraftError(f"{where}: factor {key!r} is not the {side} side of weight {weight!r}'s own KFAC entry "
                             "(a factor is named after the first weight that uses it; the manifest was edited or is "
                             "corrupt)")
        for field_name in ("eigenvalues", "eigenvectors"):
            if field_name in record and record[field_name] != f"{key}/{field_name}":
                raise GraftError(f"{where}: factor {key!r} of weight {weight!r} names tensor {record[field_name]!r} as "
                                 f"its {field_name}; the format stores them as {key + '/' + field_name!r}")
            if field_name in record:
                _claim(users, record[field_name], f"the {field_name} of factor {key!r}", where)


def _claim(users: dict[str, str], tensor: str, user: str, where: str) -> None:
    """Record that ``user`` reads ``tensor``; a tensor read by two records is refused."""
    if tensor in users:
        raise GraftError(f"{where}: tensor {tensor!r} is named by {users[tensor]} and by {user}; each stored tensor "
                         "belongs to one weight or factor (the manifest was edited or is corrupt)")
    users[tensor] = user


# -- delta folders ----------------------------------------------------------------------------


def check_delta_manifest(manifest: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Every field a reader uses, checked; the delta's tensors (the donor's names) with their shapes."""
    weight = field(manifest, "weight", (int, float), where, "weight")
    if not _finite(weight):
        raise GraftError(f"{where}: corrupt manifest (`weight` is {weight}, not a finite number)")
    dtype = field(manifest, "dtype", str, where, "dtype")
    if dtype not in DELTA_DTYPES:
        raise GraftError(
            f"{where}: corrupt manifest (`dtype` is {_shown(dtype)}, not one of {', '.join(DELTA_DTYPES)})"
        )
    shapes = {}
    for role in ("donor", "donor_ft"):
        record = field(manifest, role, dict, where, role)
        for key in ("path", "sampled_sha256"):
            field(record, key, str, where, f"{role}.{key}")
        for key in ("source", "revision"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise GraftError(f"{where}: corrupt manifest (`{role}.{key}` is {_shown(record[key])})")
        if not SHA256.fullmatch(record["sampled_sha256"]):
            raise GraftError(f"{where}: corrupt manifest (`{role}.sampled_sha256` is not a sha256)")
        shapes[role] = check_tensor_records(field(record, "tensors", dict, where, f"{role}.tensors"), where,
                                            f"{role}.tensors")
    if shapes["donor"] != shapes["donor_ft"]:
        raise GraftError(
            f"{where}: corrupt manifest (`donor.tensors` and `donor_ft.tensors` differ in names or shapes)"
        )
    zeroed = manifest.get("non_floating_zeroed", [])
    if not isinstance(zeroed, list) or not all(isinstance(n, str) and n in shapes["donor"] for n in zeroed):
        raise GraftError(f"{where}: corrupt manifest (`non_floating_zeroed` is not a list of the donor's tensors)")
    return shapes["donor"]
