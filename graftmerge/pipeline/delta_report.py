"""``graftmerge delta stats``: where a delta writes, per tensor and per transformer block.

Streams the delta (and the Fisher cache) one tensor at a time. With a cache,
the model-wide top coordinates by Fisher value are fixed first by an exact
streaming radix select over the Fisher values alone (the same selection code
as the global mask, ties to earlier tensors then earlier coordinates), so the
second pass can attribute every tensor's Fisher-weighted mass exactly.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.delta_folder import DeltaFolder, open_delta
from graftmerge.formats.fisher_cache import FisherCache, open_fisher_cache
from graftmerge.formats.lora_adapter import is_lora_adapter
from graftmerge.formats.lora_sources import LoraDelta, open_lora_delta
from graftmerge.math.delta_stats import block_of, kfac_diagonal, l2_norm, natural_key, weighted_mass
from graftmerge.math.global_threshold import ThresholdSearch
from graftmerge.math.selection import mask_from_threshold, masked_count, top_k_mask


@dataclass(frozen=True)
class Row:
    """One tensor, or one block of tensors: sizes and Fisher-weighted mass (None without a Fisher)."""

    name: str
    numel: int
    l2: float
    fisher: str | None = None  # "diagonal", "kfac-diagonal" (diag of Q⊗P), None: no entry
    weighted: float | None = None  # Σ F Δ²
    in_tensor_top: float | None = None  # part inside the tensor's own top coordinates by F
    in_global_top: float | None = None  # part inside the model-wide top coordinates by F

    @property
    def tensor_top_share(self) -> float | None:
        """Share of F·Δ² inside the tensor's own top coordinates by F (None without a Fisher)."""
        return _share(self.in_tensor_top, self.weighted)

    @property
    def global_top_share(self) -> float | None:
        """Share of F·Δ² inside the model-wide top coordinates by F (None without a Fisher)."""
        return _share(self.in_global_top, self.weighted)


def _share(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


@dataclass
class DeltaStats:
    """Everything ``delta stats`` prints and plots."""

    delta: str
    fisher: str | None
    top: float
    tensors: list[Row] = field(default_factory=list)

    def blocks(self) -> list[Row]:
        """Tensors aggregated per transformer block: norms in quadrature, masses summed."""
        groups: dict[str, list[Row]] = {}
        for row in self.tensors:
            groups.setdefault(block_of(row.name), []).append(row)
        return [_aggregate(name, rows) for name, rows in sorted(groups.items(), key=lambda g: natural_key(g[0]))]

    def total(self) -> Row:
        """The whole delta; its ``global_top_share`` is the paper's Fig. 8 (right) number."""
        return _aggregate("(whole delta)", self.tensors)

    def to_json(self) -> dict:
        """The report as JSON-ready values: per tensor, per block and whole-delta rows, shares included."""

        def row(r: Row) -> dict:
            """One row's fields and its two shares."""
            return {**asdict(r), "tensor_top_share": r.tensor_top_share, "global_top_share": r.global_top_share}

        return {
            "delta": self.delta,
            "fisher": self.fisher,
            "top": self.top,
            "tensors": [row(r) for r in self.tensors],
            "blocks": [row(r) for r in self.blocks()],
            "total": row(self.total()),
        }


def _aggregate(name: str, rows: list[Row]) -> Row:
    ranked = [r for r in rows if r.fisher]
    kinds = sorted({r.fisher for r in ranked})
    return Row(
        name=name,
        numel=sum(r.numel for r in rows),
        l2=math.sqrt(sum(r.l2**2 for r in rows)),
        fisher="+".join(kinds) if kinds else None,
        weighted=sum(r.weighted for r in ranked) if ranked else None,
        in_tensor_top=sum(r.in_tensor_top for r in ranked) if ranked else None,
        in_global_top=sum(r.in_global_top for r in ranked) if ranked else None,
    )


def _fisher_source(cache: FisherCache, name: str) -> str | None:
    if cache.has(name, "diagonal"):
        return "diagonal"
    if cache.has(name, "kfac"):
        return "kfac-diagonal"
    return None


def _fisher_values(cache: FisherCache, name: str, source: str) -> torch.Tensor:
    """The per-coordinate Fisher of one tensor: the stored diagonal, else diag(Q ⊗ P)."""
    if source == "diagonal":
        return cache.diagonal(name)
    return kfac_diagonal(cache.kfac(name))


def compute_stats(
    delta_path: str | os.PathLike,
    fisher_path: str | os.PathLike | None = None,
    top: float = 0.01,
    progress: bool = True,
    base: str | os.PathLike | None = None,
) -> DeltaStats:
    """Per-tensor L2 norms of a delta folder (or LoRA adapter), and with a Fisher cache its sensitivity shares.

    A PEFT LoRA folder needs ``base``, the model it was trained on: the tensor names and
    shapes its modules write into, and the donor of any whole tensor it saves.
    """
    if not 0 < top <= 1:
        raise GraftError(f"--top must be a fraction in (0, 1], got {top}")
    delta: DeltaFolder | LoraDelta = open_delta_or_adapter(delta_path, base)
    names = sorted(delta.checkpoint.tensors, key=natural_key)
    cache = sources = threshold = None
    if fisher_path is not None:
        cache = open_fisher_cache(fisher_path)
        cache.check_fits(delta.checkpoint)
        sources = {name: _fisher_source(cache, name) for name in names}
        threshold = _global_threshold(cache, sources, top, progress)
    stats = DeltaStats(delta=str(delta.path), fisher=None if cache is None else str(cache.path), top=top)
    for name in tqdm(names, desc="delta stats", unit="tensor", disable=not progress):
        values = delta.checkpoint.read(name)
        row = Row(name=name, numel=values.numel(), l2=l2_norm(values) if values.is_floating_point() else 0.0)
        source = sources.get(name) if sources else None
        if source:
            fisher = _fisher_values(cache, name, source)
            mass = weighted_mass(
                fisher,
                values,
                top_k_mask(fisher, masked_count(top, fisher.numel())),
                mask_from_threshold(fisher, threshold.threshold, threshold.tie_quota.get(name, 0)),
            )
            row = Row(row.name, row.numel, row.l2, source, mass.total, mass.in_tensor_top, mass.in_global_top)
        stats.tensors.append(row)
    return stats


def open_delta_or_adapter(path: str | os.PathLike, base: str | os.PathLike | None) -> DeltaFolder | LoraDelta:
    """A delta folder, or a LoRA adapter bound to ``base`` (its Δ, keyed by the base's tensor names)."""
    if not is_lora_adapter(path):
        return open_delta(path)
    if base is None:
        raise GraftError(f"{path} is a LoRA adapter, which names modules, not tensors: pass --base MODEL, the model "
                         "it was trained on (tensor names, shapes, and the donor of any tensor it saves whole)")
    model = Checkpoint(base, label=f"base {base}")
    return open_lora_delta(path, model, model, base, label=f"adapter {path}")


def _global_threshold(cache: FisherCache, sources: dict[str, str | None], top: float, progress: bool):
    """The model-wide top ⌈top·D⌉ coordinates by Fisher value (D: coordinates with a Fisher entry)."""
    ranked = sorted(name for name, source in sources.items() if source)  # name order breaks ties
    total = sum(math.prod(cache.model_tensors[name]["shape"]) for name in ranked)
    search = ThresholdSearch(k=masked_count(top, total), total=total)
    for name in tqdm(ranked, desc="delta stats: Fisher threshold", unit="tensor", disable=not progress):
        search.add_coarse(name, _fisher_values(cache, name, sources[name]))
    for name in search.fine_pass_names():
        search.add_fine(name, _fisher_values(cache, name, sources[name]))
    return search.result()


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_table(stats: DeltaStats, tensors: bool = True) -> str:
    """The printed report: per-tensor rows (optional), per-block rows, the whole delta."""
    top = f"{100 * stats.top:g}%"
    header = ["name", "numel", "L2 norm", "F·Δ²", f"in own top {top}", f"in model top {top}"]
    lines = []

    def table(title: str, rows: list[Row]) -> None:
        """Append one titled, column-aligned table of ``rows`` to ``lines``."""
        body = [
            [r.name, str(r.numel), _number(r.l2), _number(r.weighted), _percent(r.tensor_top_share),
             _percent(r.global_top_share)]
            for r in rows
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        lines.append(title)
        for line in [header, *body]:
            lines.append(
                "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            )
        lines.append("")

    if tensors:
        table("per tensor", stats.tensors)
    table("per block", stats.blocks())
    table("whole delta", [stats.total()])
    if stats.fisher:
        share = stats.total().global_top_share
        lines.append(
            f"{_percent(share)} of the delta's Fisher-weighted size Σ F·Δ² lies in the {top} of coordinates "
            f"with the largest Fisher (cache {stats.fisher}; paper Fig. 8 right)."
        )
    else:
        lines.append("Pass --fisher CACHE for the Fisher-weighted columns.")
    return "\n".join(lines)


def plot_stats(stats: DeltaStats, file: str | os.PathLike) -> Path:
    """A PNG: L2 norm per block, and (with a Fisher) the share of F·Δ² in the top coordinates per block."""
    matplotlib.use("Agg")  # no display needed: the figure only goes to a file
    file = Path(file)
    blocks = stats.blocks()
    labels = [".".join(b.name.split(".")[-2:]) for b in blocks]  # layers.3, model.norm, lm_head
    panels = 2 if stats.fisher else 1
    figure, axes = plt.subplots(panels, 1, figsize=(max(7.0, 0.3 * len(blocks) + 3), 3.0 * panels + 1.2),
                                squeeze=False, sharex=True)
    positions = list(range(len(blocks)))
    axes[0][0].bar(positions, [b.l2 for b in blocks], color="#2a7ab9")
    axes[0][0].set_ylabel("‖Δ‖₂")
    axes[0][0].set_title(f"delta {Path(stats.delta).name}: L2 norm per block")
    if stats.fisher:
        top = f"{100 * stats.top:g}%"
        own = [100 * (b.tensor_top_share or 0) for b in blocks]
        model = [100 * (b.global_top_share or 0) for b in blocks]
        axis = axes[1][0]
        axis.bar([p - 0.2 for p in positions], own, width=0.4, label=f"each tensor's top {top} by F", color="#27ae60")
        axis.bar([p + 0.2 for p in positions], model, width=0.4, label=f"model-wide top {top} by F", color="#8e44ad")
        whole = stats.total().global_top_share
        if whole is not None:
            axis.axhline(100 * whole, color="#444444", linestyle="--", linewidth=1,
                         label=f"whole delta, model-wide: {100 * whole:.1f}%")
        axis.set_ylabel("% of Σ F·Δ²")
        axis.set_ylim(0, 100)
        axis.set_title(f"share of Σ F·Δ² in the top {top} of coordinates by Fisher value")
        axis.legend(fontsize="small")
    axes[-1][0].set_xticks(positions, labels, rotation=90, fontsize="small")
    figure.tight_layout()
    file.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(file, format="png", dpi=100)
    plt.close(figure)
    return file
