"""``graftmerge delta extract``: write Δ = weight·(θft − θdonor) as a shareable folder.

Streams one tensor at a time (at most one output shard is held in memory) and
writes into a hidden staging folder next to the output, manifest last, then
renames it into place (:mod:`graftmerge.formats.output_folder`, under a lock): an
interrupted extract leaves no folder that looks like a delta.

With ``--rank K`` (:func:`extract_lora`) the folder is a PEFT LoRA adapter instead: each
weight LoRA can adapt gets the rank-K truncated SVD of its Δ (:mod:`graftmerge.math.low_rank`,
written by :mod:`graftmerge.formats.lora_writer`); tensors LoRA has no form for (norms,
biases) are dropped, and the manifest says what every tensor kept or lost.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import (
    SAFETENSORS_DTYPES,
    Checkpoint,
    check_same_tensors,
    hf_cache_origin,
)
from graftmerge.formats.delta_folder import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    source_record,
)
from graftmerge.formats.lora_writer import (
    EMBEDDING,
    LORA_FORMAT_NAME,
    LORA_FORMAT_VERSION,
    LORA_MANIFEST_NAME,
    LoraFactors,
    ModelLayers,
    factors_of,
    model_layers,
    write_lora_adapter,
)
from graftmerge.formats.output_folder import NEW, OutputFolder, check_not_inputs, usual_modes
from graftmerge.hub.cache_layout import snapshot_origin
from graftmerge.hub.merge_cards import render_adapter_card
from graftmerge.hub.untrusted import read_json_bytes, without_remote_code
from graftmerge.math.delta_stats import l2_norm
from graftmerge.math.donor_delta import donor_delta
from graftmerge.math.low_rank import truncated_svd

ADAPTER_CARD = "README.md"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_SHARD_BYTES = 2 * 10**9
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"2GB"`` → 2·10⁹ bytes (K/M/G are powers of 1000, KiB/MiB/GiB of 1024, as in HF's max_shard_size)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise GraftError(f"shard size {text!r} is not a size like 500MB, 2GB or 1GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise GraftError(f"shard size must be positive, got {text!r}")
    return size


def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensors in name order, packed greedily into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    filled = 0
    for name in sorted(sizes):
        if not shards or (filled + sizes[name] > shard_bytes and filled > 0):
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    return shards


def extract_delta(
    donor: str | os.PathLike,
    donor_ft: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weight: float = 1.0,
    dtype: str = "float32",
    shard_bytes: int | str | None = None,
    progress: bool = True,
) -> Path:
    """Write the delta folder ``output`` (which must not exist); return its path.

    ``shard_bytes``: largest shard (``"500MB"`` or bytes); default ``DEFAULT_SHARD_BYTES``.
    """
    output = Path(output)
    check_not_inputs(output, [("donor", donor), ("donor_ft", donor_ft)])  # before anything else
    shard_bytes = _checked_options(output, weight, dtype, shard_bytes)
    donor_checkpoint, ft_checkpoint = _open_checkpoints(donor, donor_ft)
    manifest = _manifest(donor_checkpoint, ft_checkpoint, weight, dtype)
    itemsize = SAFETENSORS_DTYPES["F32" if dtype == "float32" else "BF16"][1]
    shards = plan_shards({n: i.numel * itemsize for n, i in donor_checkpoint.tensors.items()}, shard_bytes)
    folder = OutputFolder(output, replace=NEW, hint="choose a new folder (extract never overwrites)",
                          inputs=[("donor", donor), ("donor_ft", donor_ft)]).open()
    staging = folder.staging
    try:
        weight_map, total = _write_shards(donor_checkpoint, ft_checkpoint, shards, staging, weight,
                                          DTYPES[dtype], progress)
        (staging / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
        )
        if (donor_checkpoint.folder / "config.json").exists():
            _copy_config(donor_checkpoint.folder / "config.json", staging / "config.json")
        (staging / (MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(staging / (MANIFEST_NAME + ".tmp"), staging / MANIFEST_NAME)
        usual_modes(staging)  # a delta is for sharing
        folder.publish()
    finally:
        folder.close()
    return output


def _checked_options(output: Path, weight: float, dtype: str, shard_bytes: int | str | None) -> int:
    """GraftError for a bad option (existing output, weight, dtype, shard size); the shard size in bytes."""
    if output.exists():
        raise GraftError(f"output {output} already exists; choose a new folder (extract never overwrites)")
    if not math.isfinite(weight):
        raise GraftError(f"--weight must be a finite number, got {weight}")
    if dtype not in DTYPES:
        raise GraftError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return parse_size(DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes)


def _open_checkpoints(donor: str | os.PathLike, donor_ft: str | os.PathLike) -> tuple[Checkpoint, Checkpoint]:
    """The two checkpoints (headers only); GraftError if they are one folder or hold different tensors."""
    donor_checkpoint = Checkpoint(donor, label=f"donor {donor}")
    ft_checkpoint = Checkpoint(donor_ft, label=f"donor_ft {donor_ft}")
    if donor_checkpoint.folder.resolve() == ft_checkpoint.folder.resolve():
        raise GraftError(f"DONOR and DONOR_FT are the same folder ({donor}); the delta would be zero")
    check_same_tensors(donor_checkpoint, [ft_checkpoint])
    return donor_checkpoint, ft_checkpoint


def _manifest(donor: Checkpoint, donor_ft: Checkpoint, weight: float, dtype: str) -> dict:
    """The delta folder's manifest: format, formula, weight, dtype and both sources' identities."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "graftmerge_version": __version__,
        "formula": "weight * (donor_ft - donor)",
        "weight": weight,
        "dtype": dtype,
        "donor": source_record(donor),
        "donor_ft": source_record(donor_ft),
        "non_floating_zeroed": sorted(n for n, i in donor.tensors.items() if not i.is_floating),
    }


def _write_shards(donor: Checkpoint, donor_ft: Checkpoint, shards: list[list[str]], staging: Path,
                  weight: float, target: torch.dtype, progress: bool) -> tuple[dict[str, str], int]:
    """Write each shard's deltas (one shard in memory at a time); (tensor → shard file, total bytes)."""
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(total=len(donor.tensors), desc="delta extract", unit="tensor", disable=not progress)
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _delta_tensor(donor, donor_ft, name, weight).to(target).contiguous()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = file
            bar.update()
        save_file(tensors, str(staging / file), metadata={"format": "pt", "graftmerge": "delta"})
        del tensors
    bar.close()
    return weight_map, total


def _copy_config(source: Path, target: Path) -> None:
    """The donor's config.json without the fields that name code to run (``auto_map``, ``custom_pipelines``).

    A delta is for sharing, and mergekit loads its config like any input's: it must never
    make ``--trust-remote-code`` run code. (It carries no code files anyway.)
    """
    where = f"donor config {source}"
    target.write_bytes(without_remote_code(read_json_bytes(source, where), where)[0])


def _delta_tensor(donor: Checkpoint, donor_ft: Checkpoint, name: str, weight: float) -> torch.Tensor:
    """weight·(ft − donor) in float32 (float64 for float64 inputs): the graft kernel's own op order.

    Non-floating tensors (none in usual LLM checkpoints) carry no delta: zeros.
    """
    if not donor.tensors[name].is_floating:
        return torch.zeros(donor.tensors[name].shape, dtype=torch.float32)
    return donor_delta(donor.read(name), [donor_ft.read(name)], [weight])


# -- --rank K: a PEFT LoRA adapter ----------------------------------------------------------------

SHARE_DEFINITION = ("kept_share = ‖Δ_K‖²_F / ‖Δ‖²_F (squared Frobenius norms; 1 − kept_share = "
                    "‖Δ − Δ_K‖²_F / ‖Δ‖²_F); totals over every tensor of Δ, dropped ones included")


def parse_rank(value: Any) -> int:
    """``--rank``: a positive integer (``"16"`` or 16); GraftError otherwise."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[+]?\d+", text) or int(text) <= 0:
        raise GraftError(f"--rank must be a positive integer (the LoRA rank K), got {value!r}")
    return int(text)


@dataclass(frozen=True)
class LoraExtraction:
    """An extracted adapter: where it is, and its manifest (what every tensor kept or lost)."""

    path: Path
    manifest: dict[str, Any]


def extract_lora(
    donor: str | os.PathLike,
    donor_ft: str | os.PathLike,
    output: str | os.PathLike,
    *,
    rank: int | str,
    weight: float = 1.0,
    dtype: str = "float32",
    embeddings: bool = True,
    progress: bool = True,
) -> LoraExtraction:
    """Write Δ = weight·(θft − θdonor) as the PEFT LoRA adapter ``output`` (which must not exist), rank ≤ ``rank``.

    One tensor of Δ is read and factored at a time; only the factors are kept until the
    adapter file is written. The folder appears whole (manifest last) or not at all.
    ``embeddings=False`` leaves embedding layers out (their Δ is reported as dropped).
    """
    output = Path(output)
    check_not_inputs(output, [("donor", donor), ("donor_ft", donor_ft)])  # before anything else
    rank = parse_rank(rank)
    _checked_options(output, weight, dtype, None)
    donor_checkpoint, ft_checkpoint = _open_checkpoints(donor, donor_ft)
    layers = model_layers(donor_checkpoint.folder, f"donor {donor}")
    manifest = {**_manifest(donor_checkpoint, ft_checkpoint, weight, dtype), "format": LORA_FORMAT_NAME,
                "format_version": LORA_FORMAT_VERSION, "formula": "weight * (donor_ft - donor) ~ B @ A per weight "
                "(rank-K truncated SVD)", "rank": rank, "share": SHARE_DEFINITION}
    folder = OutputFolder(output, replace=NEW, hint="choose a new folder (extract never overwrites)",
                          inputs=[("donor", donor), ("donor_ft", donor_ft)]).open()
    try:
        factors, table = _factor_tensors(donor_checkpoint, ft_checkpoint, layers, rank, weight, embeddings,
                                         progress)
        repo, revision = hf_cache_origin(donor_checkpoint.folder)
        config = write_lora_adapter(folder.staging, factors, layers, base_model=repo or str(
            donor_checkpoint.folder.resolve()), revision=revision, dtype=DTYPES[dtype])
        manifest.update(table, target_modules=config["target_modules"], tied_embedding_adapted=sorted(
            f.module for f in factors if f.module == layers.embedding and layers.tied))
        _write_adapter_card(folder.staging, manifest, donor_checkpoint.folder, ft_checkpoint.folder)
        (folder.staging / (LORA_MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(folder.staging / (LORA_MANIFEST_NAME + ".tmp"), folder.staging / LORA_MANIFEST_NAME)
        usual_modes(folder.staging)  # an adapter is for sharing
        folder.publish()
    finally:
        folder.close()
    return LoraExtraction(path=output, manifest=manifest)


def _write_adapter_card(staging: Path, manifest: dict, donor: Path, donor_ft: Path) -> None:
    """README.md: PEFT's library and the donor's Hub id (a cached snapshot's) as base_model, for the model tree."""
    base_model, fine_tune = (origin[0] if origin else None for origin in map(snapshot_origin, (donor, donor_ft)))
    card = render_adapter_card(manifest, base_model, fine_tune)
    (staging / ADAPTER_CARD).write_text(card, encoding="utf-8")


def _factor_tensors(donor: Checkpoint, donor_ft: Checkpoint, layers: ModelLayers, rank: int, weight: float,
                    embeddings: bool, progress: bool) -> tuple[list[LoraFactors], dict[str, Any]]:
    """Each tensor's Δ, factored (a LoRA module) or dropped; the factors and the manifest's tables."""
    factors: list[LoraFactors] = []
    tensors: dict[str, dict] = {}
    dropped: dict[str, dict] = {}
    unchanged: list[str] = []
    for name in tqdm(sorted(donor.tensors), desc="delta extract --rank", unit="tensor", disable=not progress):
        delta = _delta_tensor(donor, donor_ft, name, weight)
        if not bool(torch.isfinite(delta).all()):
            raise GraftError(f"tensor {name!r}: Δ contains NaN or Inf (check {donor.label} and {donor_ft.label})")
        found = layers.module_of(name) if delta.dim() == 2 else None
        if found is None or (found[1] == EMBEDDING and not embeddings):
            dropped[name] = {"shape": list(delta.shape), "norm_sq": l2_norm(delta) ** 2,
                             "reason": _drop_reason(name, delta, donor, layers, found)}
        elif not bool(delta.any()):
            unchanged.append(name)
        else:
            svd = truncated_svd(delta, rank)
            factors.append(factors_of(*found, svd.left, svd.right))
            tensors[name] = {"module": found[0], "kind": found[1], "shape": list(delta.shape),
                             "rank": factors[-1].rank, "norm_sq": svd.norm_sq, "kept_norm_sq": svd.kept_norm_sq,
                             "kept_share": svd.kept_share}
    return factors, {"tensors": tensors, "dropped": dropped, "unchanged": unchanged,
                     "total": _totals(tensors, dropped)}


def _drop_reason(name: str, delta: torch.Tensor, donor: Checkpoint, layers: ModelLayers,
                 found: tuple[str, str] | None) -> str:
    """Why tensor ``name`` has no LoRA form (the manifest says it beside its share of Δ)."""
    if found is not None:
        return "an embedding, left out by --no-embeddings"
    if not donor.tensors[name].is_floating:
        return "not floating point (no delta)"
    if layers.is_tied(name):
        return "tied to the input embedding (the embedding's adapter changes it when merged)"
    if delta.dim() == 1:
        return "1-D (a norm or a bias): LoRA has no form for it"
    return "not the weight of a Linear, Conv1D or Embedding layer"


def _totals(tensors: dict[str, dict], dropped: dict[str, dict]) -> dict[str, float]:
    """Whole-delta sums of squared Frobenius norms, and the shares kept, truncated and dropped."""
    adapted = sum(t["norm_sq"] for t in tensors.values())
    kept = sum(t["kept_norm_sq"] for t in tensors.values())
    lost = sum(t["norm_sq"] for t in dropped.values())
    total = adapted + lost

    def share(part: float) -> float:
        """``part`` as a share of all of Δ (0 when Δ is 0)."""
        return part / total if total > 0 else 0.0

    return {"norm_sq": total, "kept_norm_sq": kept, "kept_share": share(kept),
            "truncated_share": share(adapted - kept), "dropped_share": share(lost)}


def extraction_summary(extraction: LoraExtraction, shown: int = 5) -> list[str]:
    """What the CLI prints: the share of Δ kept, and what was dropped, largest first."""
    manifest = extraction.manifest
    total, dropped = manifest["total"], manifest["dropped"]
    lines = [f"kept {100 * total['kept_share']:.3f}% of ‖Δ‖²_F in {len(manifest['tensors'])} LoRA modules at rank "
             f"≤ {manifest['rank']} (truncation lost {100 * total['truncated_share']:.3f}%)"]
    if dropped:
        largest = sorted(dropped, key=lambda n: -dropped[n]["norm_sq"])
        share = [f"{n} {100 * dropped[n]['norm_sq'] / total['norm_sq']:.3f}%" if total["norm_sq"] else n
                 for n in largest[:shown]]
        more = f", and {len(largest) - shown} more" if len(largest) > shown else ""
        lines.append(f"dropped {len(dropped)} tensors LoRA cannot express ({100 * total['dropped_share']:.3f}% of "
                     f"‖Δ‖²_F; why: lora_manifest.json): {', '.join(share)}{more}")
    if manifest["unchanged"]:
        lines.append(f"{len(manifest['unchanged'])} weights have Δ = 0 and no adapter")
    if manifest["tied_embedding_adapted"]:
        lines.append(f"note: {', '.join(manifest['tied_embedding_adapted'])} is tied to the output head, which takes "
                     "its Δ only when merged (merge_and_unload); PEFT may warn on load (--no-embeddings leaves it out)")
    return lines
