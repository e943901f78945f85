"""The artifact kinds graftmerge shares on the Hub: Fisher caches, and deltas; and PEFT LoRA adapters, pulled.

A kind is a manifest file name, a local check, a model card and (optionally) a way to
keep only some layers; everything else (resume, partial fetch, offline) is generic in
:mod:`graftmerge.hub.push` and :mod:`graftmerge.hub.pull`. A PEFT adapter repo is pulled as a kind whose manifest
is ``adapter_config.json`` (checked field by field before the weights are fetched) and
whose only data file is ``adapter_model.safetensors``: never base weights, pickles
(``adapter_model.bin``) or code, whatever else the repo holds.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

from graftmerge.errors import GraftError
from graftmerge.formats.delta_folder import FORMAT_VERSION as DELTA_VERSION
from graftmerge.formats.delta_folder import INDEX_NAME, open_delta
from graftmerge.formats.fisher_cache import FORMAT_VERSION as FISHER_VERSION
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.formats.lora_adapter import CONFIG_NAME as ADAPTER_CONFIG
from graftmerge.formats.lora_adapter import WEIGHTS_NAME as ADAPTER_WEIGHTS
from graftmerge.formats.lora_adapter import LoraAdapter, open_lora_adapter
from graftmerge.formats.manifest_schema import check_delta_manifest, check_fisher_manifest
from graftmerge.formats.peft_rules import check_adapter_config
from graftmerge.hub.artifact_kind import ArtifactKind
from graftmerge.hub.cards import render_delta_card, render_fisher_card
from graftmerge.math.finite import FLOAT32_MAX, largest_magnitude, product_bound

FISHER_MANIFEST = "fisher_manifest.json"
DELTA_MANIFEST = "delta_manifest.json"
PULLED_VALUE_LIMIT = FLOAT32_MAX / 2**8  # what a pulled delta's values, an adapter's products, may reach


def _open_fisher_folder(folder: Path) -> Mapping[str, Any]:
    """Every check a merge makes on open (format, version, shards present)."""
    return open_fisher_cache(folder).manifest


def _check_version(manifest: Mapping[str, Any], version: int, where: str) -> None:
    """The manifest's ``format_version`` is the one this graftmerge reads."""
    found = manifest.get("format_version")
    if found != version or isinstance(found, bool):
        raise GraftError(f"{where}: format version {found} is not supported (this graftmerge reads v{version}; "
                         "upgrade graftmerge)")


def _check_fisher_schema(manifest: Mapping[str, Any], where: str) -> None:
    """A downloaded Fisher manifest's fields, before its shards are fetched."""
    _check_version(manifest, FISHER_VERSION, where)
    check_fisher_manifest(dict(manifest), f"Fisher cache {where}")


def _validate_fisher_folder(folder: Path) -> None:
    """A pulled cache opened as a merge opens it (manifest, headers, dtypes, shapes), then every value read once."""
    open_fisher_cache(folder).check_all_values()


def select_fisher_layers(manifest: Mapping[str, Any], patterns: Sequence[str]) -> dict[str, Any]:
    """The manifest of a cache holding only the weights matching ``patterns`` (fnmatch globs).

    Keeps each chosen weight's diagonal tensor and both KFAC sides, including a side
    stored under another weight's key (shared q/k/v inputs); ``model.tensors`` stays
    whole, so the smaller cache still fits (and is checked against) the same post model.
    """
    entries: Mapping[str, Mapping[str, Any]] = manifest["entries"]
    unmatched = [p for p in patterns if not any(fnmatchcase(name, p) for name in entries)]
    if unmatched:
        examples = ", ".join(sorted(entries)[:3]) or "none"
        raise GraftError(
            f"--layers {' '.join(unmatched)} matches no weight with a Fisher entry "
            f"({len(entries)} weights have one, e.g. {examples})"
        )
    chosen = {
        name: copy.deepcopy(dict(e)) for name, e in entries.items() if any(fnmatchcase(name, p) for p in patterns)
    }
    factor_keys = sorted({e["kfac"][side] for e in chosen.values() if "kfac" in e for side in ("rows", "columns")})
    factors = {key: manifest["factors"][key] for key in factor_keys}
    tensor_keys = {e["diagonal"]["key"] for e in chosen.values() if "diagonal" in e}
    for record in factors.values():
        tensor_keys.update(record[field] for field in ("eigenvalues", "eigenvectors") if field in record)
    unfiled = sorted(tensor_keys - set(manifest["files"]))
    if unfiled:
        raise GraftError(f"the Fisher manifest names tensor {unfiled[0]!r} but no file holding it (corrupt cache)")
    kinds = {r for e in chosen.values() for r in ("diagonal", "kfac") if r in e}
    selected = copy.deepcopy(dict(manifest))
    selected.update(
        kind=kinds.pop() if len(kinds) == 1 else "mixed",
        entries=chosen,
        factors=factors,
        files={key: manifest["files"][key] for key in sorted(tensor_keys)},
        clamped_eigenvalues=sum(int(record.get("clamped", 0)) for record in factors.values()),
    )
    return selected


FISHER = ArtifactKind(
    name="fisher",
    label="Fisher cache",
    manifest_name=FISHER_MANIFEST,
    format_name="graftmerge.fisher",
    render_card=render_fisher_card,
    open_folder=_open_fisher_folder,
    select_layers=select_fisher_layers,
    check_schema=_check_fisher_schema,
    validate_folder=_validate_fisher_folder,
)

def _delta_files(manifest: Mapping[str, Any], read: Callable[[str], bytes]) -> list[str]:
    """A delta is loadable as a model: its index, the shards the index names, config.json if any."""
    files = {INDEX_NAME, *json.loads(read(INDEX_NAME))["weight_map"].values()}
    try:
        read("config.json")
        files.add("config.json")
    except RemoteEntryNotFoundError:
        pass  # extract copies the donor's config.json only when it has one
    except FileNotFoundError as error:
        if isinstance(error, EntryNotFoundError):  # not "absent": the Hub could not be asked
            raise
    return sorted(files)


def _check_delta_schema(manifest: Mapping[str, Any], where: str) -> None:
    """A downloaded delta manifest's fields, before its shards are fetched."""
    _check_version(manifest, DELTA_VERSION, where)
    check_delta_manifest(dict(manifest), where)


def _validate_delta_folder(folder: Path) -> None:
    """A pulled delta opened as a merge opens it (manifest, index, headers, dtypes, shapes), every tensor finite
    and below :data:`PULLED_VALUE_LIMIT` (θpost + λ·δ must not overflow float32 in a graft)."""
    checkpoint = open_delta(folder).checkpoint
    for name in sorted(checkpoint.tensors):
        largest = largest_magnitude(checkpoint.read(name))  # NaN or Inf: a GraftError naming file and tensor
        if not largest <= PULLED_VALUE_LIMIT:
            raise GraftError(f"{checkpoint.tensors[name].file}: delta tensor {name!r} holds |x| = {largest:.3g}, "
                             f"beyond {PULLED_VALUE_LIMIT:.3g}: θpost + Δ could overflow float32 in a graft; refused")


def _open_delta_folder(folder: Path) -> Mapping[str, Any]:
    """Every check a merge makes on open (format, version, files match the manifest)."""
    return open_delta(folder).manifest


DELTA = ArtifactKind(
    name="delta",
    label="delta",
    manifest_name=DELTA_MANIFEST,
    format_name="graftmerge.delta",
    render_card=render_delta_card,
    list_files=_delta_files,
    open_folder=_open_delta_folder,
    check_schema=_check_delta_schema,
    validate_folder=_validate_delta_folder,
)


def _adapter_files(manifest: Mapping[str, Any], read: Callable[[str], bytes]) -> list[str]:
    """An adapter's one data file: ``adapter_model.safetensors`` (its config is the manifest)."""
    return [ADAPTER_WEIGHTS]


def _check_adapter_schema(config: Mapping[str, Any], where: str) -> None:
    """A downloaded adapter_config.json: every field one graft reproduces, ignores safely, or is off."""
    check_adapter_config(dict(config), where)


def _open_adapter_folder(folder: Path) -> Mapping[str, Any]:
    """Every check a graft makes when it opens the folder (config, safetensors header, keys, ranks)."""
    return open_lora_adapter(folder).config


def _validate_adapter_folder(folder: Path) -> None:
    """A pulled adapter opened as a graft opens it, then every tensor read once (finite), its products bounded."""
    adapter = open_lora_adapter(folder)
    adapter.check_all_values()
    check_adapter_range(adapter)


def check_adapter_range(adapter: LoraAdapter) -> None:
    """GraftError unless nothing a graft computes from ``adapter`` in float32 can overflow (a sound bound).

    Every LoRA module's :func:`product_bound` (its product ``scaling·B·A``, that product
    rotated into any orthonormal KFAC eigenbasis, and the rotation before it is scaled)
    and every saved whole tensor's largest value stay below :data:`PULLED_VALUE_LIMIT`,
    float32's largest value over 2⁸: room for θpost + Δ', the masked part removed and a
    λ·weight of a few. Which model the adapter will be grafted onto (and so the dtype of
    its weights) is not known when it is pulled; a graft checks the values it computes.
    """
    where = adapter.file or adapter.label
    for module, lora in sorted(adapter.modules.items()):
        bound = product_bound(adapter.read(lora.b_key), adapter.read(lora.a_key), lora.scaling)
        if not bound <= PULLED_VALUE_LIMIT:
            beyond = ", a factor holding values beyond float32's range," if bound == math.inf else ""
            raise GraftError(f"{where}: module {module}: max(1, |scaling|)·‖B‖_F·‖A‖_F = {bound:.3g} "
                             f"(scaling {lora.scaling:.3g}{beyond}) exceeds {PULLED_VALUE_LIMIT:.3g}, so its Δ or "
                             "Δ's KFAC rotation could overflow float32 in a graft; refused")
    for key in sorted(adapter.full.values()):
        largest = largest_magnitude(adapter.read(key))
        if not largest <= PULLED_VALUE_LIMIT:
            raise GraftError(f"{where}: saved tensor {key!r} holds |x| = {largest:.3g}, beyond "
                             f"{PULLED_VALUE_LIMIT:.3g}: a graft's float32 Δ of it could overflow; refused")


LORA_ADAPTER = ArtifactKind(
    name="delta",
    label="PEFT LoRA adapter",
    manifest_name=ADAPTER_CONFIG,
    list_files=_adapter_files,
    open_folder=_open_adapter_folder,
    check_schema=_check_adapter_schema,
    validate_folder=_validate_adapter_folder,
    missing_hint="; graftmerge pulls safetensors only: re-save an adapter_model.bin with PEFT's "
                 "save_pretrained(safe_serialization=True)",
)
DELTA_KINDS = (DELTA, LORA_ADAPTER)  # what `graftmerge delta pull` takes, asked in this order
