"""Model cards (README.md) for the models graftmerge writes: merges, sweep points, LoRA adapters.

Pure functions from what a merge was made of to markdown. The front matter puts the
model in its inputs' model tree on the Hub: ``base_model`` lists the inputs' Hub ids
(only those: a plain local folder has none) and ``base_model_relation: merge`` says
how it came from them. The body says what shaped it that the config alone does not
show: which Fisher (or Gram) cache was read, from where, and its fingerprint, and the
mask, ρ and λ it was made with. Generic over the merge method: the inputs' parameters
and the global settings are listed as the config gives them; a method adds sentences
(``notes``) and the caches it read (:class:`CacheFacts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from graftmerge.hub.cards import front_matter

HUB = "https://huggingface.co"
MERGEKIT_URL = "https://github.com/arcee-ai/mergekit"
SYMBOLS = {"lambda": "λ", "rho": "ρ", "alpha": "α"}  # how the docs write these parameters


@dataclass(frozen=True)
class CardInput:
    """One input model of a merge, as its card names it."""

    written: str  # the reference as the config writes it (a path, org/name, base+lora)
    hub_ids: tuple[str, ...] = ()  # the Hub ids it stands for (model, then its LoRA); () for a plain local folder
    parameters: Mapping[str, Any] = field(default_factory=dict)  # its own parameters, as written
    is_base: bool = False  # the config's base_model


@dataclass(frozen=True)
class CacheFacts:
    """A data cache (Fisher, Gram) named by a merge config: where it came from and what it is."""

    written: str  # the reference as the config writes it
    used_by: tuple[str, ...] = ()  # the inputs that name it; () for a global parameter
    folder: str | None = None  # the folder the merge read; None: named but not read
    hub_id: str | None = None  # its Hub repo, when the config names it by Hub id
    revision: str | None = None  # the revision the config asks for
    commit: str | None = None  # the commit of the cached snapshot that was read
    kind: str | None = None  # diagonal, kfac or mixed (the manifest's)
    model: str | None = None  # the model it was estimated on (the manifest's model.source)
    fingerprint: str | None = None  # sha256 of its manifest, which names every shard and the model's tensors
    data_sha256: str | None = None  # the retention data's hash, as the estimator recorded it
    layers: tuple[str, ...] = ()  # a cache pulled with --layers: only these weights


def unique(ids: Sequence[str]) -> list[str]:
    """``ids`` in order, each once."""
    return list(dict.fromkeys(ids))


def merge_metadata(inputs: Sequence[CardInput], method: str) -> dict[str, Any]:
    """The front matter: the Hub's model tree fields, then mergekit's library and tags."""
    metadata: dict[str, Any] = {}
    hub_ids = unique([hub_id for entry in inputs for hub_id in entry.hub_ids])
    if hub_ids:  # a relation with no base model would name nothing
        metadata["base_model"] = hub_ids
        metadata["base_model_relation"] = "merge"
    metadata["library_name"] = "transformers"
    metadata["tags"] = unique(["mergekit", "merge", "graftmerge", method])
    return metadata


def render_merge_card(*, name: str, method: str, method_link: str, inputs: Sequence[CardInput],
                      settings: Mapping[str, Any], caches: Sequence[CacheFacts], config_yaml: str,
                      notes: Sequence[str] = ()) -> str:
    """README.md of a merged model: front matter, what made it, its inputs, settings, caches, config."""
    intro = f"A merge made with graftmerge through [mergekit]({MERGEKIT_URL}), merge method {method_link}.\n\n"
    return (
        front_matter(merge_metadata(inputs, method))
        + f"\n# {_line(name)}\n\n"
        + intro
        + "".join(f"{_line(note)}\n\n" for note in notes)
        + "## Inputs\n\n" + _inputs_table(inputs)
        + "\n## Settings\n\n" + _settings_table(settings)
        + _caches_section(caches)
        + "\n## Configuration\n\nThe mergekit configuration that produced this model:\n\n"
        + _fenced(config_yaml, "yaml")
    )


def _inputs_table(inputs: Sequence[CardInput]) -> str:
    rows = ["| input | Hub id | parameters |", "|---|---|---|"]
    for entry in inputs:
        label = _code(entry.written) + (" (base_model)" if entry.is_base else "")
        hub = ", ".join(f"[{hub_id}]({HUB}/{hub_id})" for hub_id in entry.hub_ids) or "— (local folder)"
        parameters = ", ".join(f"{key}: {_value(value)}" for key, value in entry.parameters.items()) or "—"
        rows.append(f"| {label} | {hub} | {_cell(parameters)} |")
    return "\n".join(rows) + "\n"


def _settings_table(settings: Mapping[str, Any]) -> str:
    if not settings:
        return "_(none: the method's defaults)_\n"
    rows = ["| parameter | value |", "|---|---|"]
    for key, value in settings.items():
        symbol = f" ({SYMBOLS[key]})" if key in SYMBOLS else ""
        rows.append(f"| `{_cell(key)}`{symbol} | {_cell(_value(value))} |")
    return "\n".join(rows) + "\n"


def _caches_section(caches: Sequence[CacheFacts]) -> str:
    if not caches:
        return ""
    title = "Fisher cache" if len(caches) == 1 else "Fisher caches"
    return f"\n## {title}\n\n" + "\n".join(_cache_facts(cache) for cache in caches)


def _cache_facts(cache: CacheFacts) -> str:
    """One cache as a list of facts: whose it is, where it came from, what it is, its fingerprint."""
    who = f" (for {', '.join(_code(u) for u in cache.used_by)})" if cache.used_by else ""
    lines = [f"- {_code(cache.written)}{who}"]
    if cache.folder is None:
        return "\n".join([*lines, "  - named by the config but not read by this merge\n"])
    if cache.hub_id is not None:
        revision = f", revision `{cache.revision}`" if cache.revision else ""
        commit = f", commit `{cache.commit}`" if cache.commit else ""
        lines.append(f"  - Hub repo [{cache.hub_id}]({HUB}/{cache.hub_id}){revision}{commit}")
    else:
        lines.append(f"  - local folder {_code(cache.folder)}")
    if cache.kind:
        lines.append(f"  - kind: {_line(cache.kind)}")
    if cache.model:
        lines.append(f"  - estimated on: {_code(cache.model)}")
    if cache.layers:
        lines.append(f"  - holds only the weights matching: {', '.join(_code(layer) for layer in cache.layers)}")
    if cache.data_sha256:
        lines.append(f"  - retention data sha256: `{_line(cache.data_sha256)}`")
    if cache.fingerprint:
        lines.append(f"  - fingerprint (sha256 of `fisher_manifest.json`): `{cache.fingerprint}`")
    return "\n".join(lines) + "\n"


def render_adapter_card(manifest: Mapping[str, Any], base_model: str | None, fine_tune: str | None) -> str:
    """README.md of a LoRA adapter from ``delta extract --rank``: PEFT's metadata, the donor as base model."""
    metadata: dict[str, Any] = {}
    if base_model:
        metadata["base_model"] = base_model
    metadata["library_name"] = "peft"
    metadata["tags"] = ["graftmerge", "lora", "peft"]
    total = manifest.get("total", {}) if isinstance(manifest.get("total"), Mapping) else {}
    donor = base_model or "its donor (a local folder)"
    source = f" of [{fine_tune}]({HUB}/{fine_tune})" if fine_tune else ""
    rows = [("rank (at most)", manifest.get("rank")), ("weight", manifest.get("weight")),
            ("dtype", manifest.get("dtype")), ("LoRA modules", len(manifest.get("tensors", {}))),
            ("share of ‖Δ‖²_F kept", _share(total.get("kept_share"))),
            ("lost to truncation", _share(total.get("truncated_share"))),
            ("in tensors LoRA cannot express", _share(total.get("dropped_share")))]
    table = "\n".join(["| field | value |", "|---|---|",
                       *(f"| {key} | {_cell(_value(value))} |" for key, value in rows if value is not None)])
    return (
        front_matter(metadata)
        + "\n# LoRA adapter extracted by graftmerge\n\n"
        f"The fine-tuning delta{source}, weight·(θft − θdonor), as a PEFT LoRA adapter for {_code(donor)}: each "
        "weight's rank-K truncated SVD (`graftmerge delta extract --rank`). `lora_manifest.json` records, per "
        "tensor, what was kept and what was dropped.\n\n"
        + table + "\n\n"
        "```python\n"
        "from peft import PeftModel\n"
        "model = PeftModel.from_pretrained(donor_model, \"path/or/repo/of/this/adapter\")\n"
        "```\n"
    )


def _share(value: Any) -> str | None:
    return f"{100 * value:.3f}%" if isinstance(value, int | float) and not isinstance(value, bool) else None


def _value(value: Any) -> str:
    """A parameter's value in YAML flow style: ``0.01``, ``[0, 0.5, 1]``, ``{filter: mlp, value: 0.5}``."""
    if isinstance(value, str):
        return value
    text = yaml.safe_dump(_plain(value), default_flow_style=True, allow_unicode=True, width=10_000)
    return text.strip().removesuffix("\n...").strip()


def _plain(value: Any) -> Any:
    """``value`` as YAML's safe types: mergekit's conditional parameters (pydantic models) as mappings."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _line(text: Any) -> str:
    """``text`` on one line (a title or a list item cannot span lines)."""
    return " ".join(str(text).split())


def _cell(text: str) -> str:
    return _line(text).replace("|", "\\|")


def _code(text: Any) -> str:
    """``text`` as an inline code span, however many backticks it holds."""
    text = _line(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}".replace("|", "\\|")


def _fenced(text: str, language: str) -> str:
    """``text`` in a fenced block longer than any backtick run inside it (so it cannot end the block)."""
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"
