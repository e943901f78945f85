"""The README.md card of every model folder graftmerge writes, gathered and written.

:func:`write_merge_card` is the one call: given the folder a merge has just finished
(still its staging folder, so the card is published with the model or not at all),
the mergekit config as the user wrote it, and what the merge read beyond the config
(:class:`DataInputs`: the caches as opened, sentences of its own), it names every input
by Hub id where it has one (:func:`graftmerge.hub.models.model_hub_id`), describes each
cache it read (Hub repo and commit or local folder, kind, model, fingerprint), and
writes the card :mod:`graftmerge.hub.merge_cards` renders. It knows no merge method:
graft passes :func:`graft_card_data`; any other method passes its own caches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit.merge_methods import registry as mergekit_registry

from graftmerge.errors import GraftError
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.fisher_cache import MANIFEST_NAME as FISHER_MANIFEST
from graftmerge.formats.json_file import load_json_file
from graftmerge.hub.cache_layout import snapshot_origin
from graftmerge.hub.merge_cards import CacheFacts, CardInput, render_merge_card
from graftmerge.hub.models import model_hub_id
from graftmerge.hub.references import hub_reference_or_none
from graftmerge.pipeline.merge_run import MergeRun

CARD_NAME = "README.md"
CACHE_PARAMETERS = ("fisher",)  # parameters (global or per input) that name a data cache


@dataclass(frozen=True)
class DataInputs:
    """What a data-aware merge read beyond its config, for its card.

    ``caches``: each cache reference as the config writes it → the folder the merge read
    (a cache the config names but the merge did not read is listed as such).
    ``notes``: sentences on how the method used them (graft: the formula, ρ's scope).
    """

    caches: Mapping[str, str | os.PathLike] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def write_merge_card(folder: str | os.PathLike, config, config_source: str | None,
                     data: DataInputs | None = None) -> Path:
    """Write ``folder``/README.md for the merge of ``config`` (as written), replacing mergekit's card."""
    folder = Path(folder)
    card = merge_card(config, config_source or config.to_yaml(), folder.name, data or DataInputs())
    path = folder / CARD_NAME
    path.write_text(card, encoding="utf-8")
    return path


def merge_card(config, config_source: str, name: str, data: DataInputs) -> str:
    """The card's markdown: inputs and settings from ``config``, caches and notes from ``data``."""
    return render_merge_card(
        name=name, method=config.merge_method, method_link=method_link(config.merge_method),
        inputs=card_inputs(config), settings=effective_settings(config), caches=named_caches(config, data),
        config_yaml=config_source, notes=data.notes,
    )


def _hub_ids(reference) -> tuple[str, ...]:
    """The Hub ids of a mergekit ModelReference: its model's, then its LoRA's, where they have one."""
    found = [model_hub_id(reference.model.path)]
    if reference.lora is not None:
        found.append(model_hub_id(reference.lora.path))
    return tuple(hub_id for hub_id in found if hub_id is not None)


def card_inputs(config) -> list[CardInput]:
    """Every model the config reads: base_model first, then ``models:`` with their parameters, then the rest."""
    inputs, seen = [], set()
    if config.base_model is not None:
        inputs.append(CardInput(str(config.base_model), _hub_ids(config.base_model), {}, is_base=True))
        seen.add(config.base_model)
    for entry in config.models or []:
        inputs.append(CardInput(str(entry.model), _hub_ids(entry.model), dict(entry.parameters or {})))
        seen.add(entry.model)
    for reference in config.referenced_models():  # slices and modules: no per-input parameters to show
        if reference not in seen:
            inputs.append(CardInput(str(reference), _hub_ids(reference)))
            seen.add(reference)
    return inputs


def _method_spec(method: str):
    """mergekit's spec of ``method`` (name, pretty name, paper, parameters); None for one it cannot describe."""
    try:
        return mergekit_registry.get(method).spec
    except (RuntimeError, AttributeError):
        return None


def method_link(method: str) -> str:
    """The method's name, linked to its paper where mergekit knows one (as mergekit's own card shows it).

    Not ``mergekit.card.method_md``: mergekit.card imports the registry whose import hook loads this module.
    """
    spec = _method_spec(method)
    if spec is None:
        return f"`{method}`"
    name = spec.pretty_name or spec.name
    return f"[{name}]({spec.reference_url})" if spec.reference_url and spec.reference_url.strip() else name


def effective_settings(config) -> dict[str, Any]:
    """The global parameters the merge ran with: the config's, and the method's defaults for the rest
    (those without a value, like graft's internal run id, are left out)."""
    written = dict(config.parameters or {})
    settings: dict[str, Any] = {}
    spec = _method_spec(config.merge_method)  # None: the config's values only
    for parameter in spec.shared_parameters if spec is not None else ():
        if parameter.name in written:
            settings[parameter.name] = written.pop(parameter.name)
        elif not parameter.required and parameter.default is not None:
            settings[parameter.name] = parameter.default
    return {**settings, **written}


def named_caches(config, data: DataInputs) -> list[CacheFacts]:
    """Each cache the config names (global ``fisher:``, or per input), described where the merge read it."""
    users: dict[str, list[str]] = {}
    for key in CACHE_PARAMETERS:
        value = (config.parameters or {}).get(key)
        if isinstance(value, str):
            users.setdefault(value, [])
        for entry in config.models or []:
            value = (entry.parameters or {}).get(key)
            if isinstance(value, str):
                users.setdefault(value, []).append(str(entry.model))
    read = {str(written): folder for written, folder in data.caches.items()}
    return [describe_cache(written, read.get(written), tuple(used_by)) for written, used_by in users.items()]


def describe_cache(written: str, folder: str | os.PathLike | None, used_by: tuple[str, ...] = ()) -> CacheFacts:
    """What a cache's card entry says: its origin (Hub repo and commit, or local folder) and its manifest's facts."""
    if folder is None:
        return CacheFacts(written, used_by)
    try:
        reference = hub_reference_or_none(written)
    except GraftError:
        reference = None
    origin = snapshot_origin(folder)
    manifest_file = Path(folder) / FISHER_MANIFEST
    manifest = load_json_file(manifest_file, "Fisher manifest") if manifest_file.is_file() else {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    estimator = manifest.get("estimator") if isinstance(manifest.get("estimator"), dict) else {}
    data = estimator.get("data") if isinstance(estimator.get("data"), dict) else {}
    pulled = manifest.get("pulled") if isinstance(manifest.get("pulled"), dict) else {}
    return CacheFacts(
        written, used_by, folder=os.path.abspath(folder),
        hub_id=reference.repo_id if reference is not None else None,
        revision=reference.revision if reference is not None else None,
        commit=origin[1] if origin is not None and reference is not None else None,
        kind=_text(manifest.get("kind")), model=_text(model.get("source")),
        fingerprint=file_sha256(manifest_file) if manifest_file.is_file() else None,
        data_sha256=_text(data.get("token_sha256") or data.get("sha256")),
        layers=tuple(str(layer) for layer in pulled.get("layers") or () if isinstance(layer, str)),
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _setting(plan, name: str, value: float) -> str:
    """``name = value`` for a single value; a schedule is named as one (its numbers are in the config block)."""
    return f"{name} per layer (the schedule in the config below)" if name in _scheduled(plan) else f"{name} = {value!r}"


def _scheduled(plan) -> set[str]:
    return {{"lambda": "λ", "rho": "ρ"}.get(label, label) for label in plan.scheduled}


def graft_card_data(run: MergeRun) -> DataInputs:
    """A graft merge's cache (only when its mask read one) and how it was used: the formula with its numbers."""
    plan = run.plan
    fisher = run.inputs.fisher if plan.masked else None
    caches = {plan.fisher: fisher.path} if fisher is not None and plan.fisher else {}
    lam, rho = _setting(plan, "λ", plan.lam), _setting(plan, "ρ", plan.rho)
    scheduled_weights = any(label.startswith("weight") for label in plan.scheduled)
    weights = " (weights per layer: see the config below)" if scheduled_weights else ""
    if plan.lam == 0 and "λ" not in _scheduled(plan):
        notes = ("λ = 0: no update was grafted; this is the base model (θpost) as a merge writes it.",)
    elif not plan.masked:
        notes = (f"θ = θpost + λ·Σᵢ wᵢ Δᵢ with {lam}{weights} and no mask (ρ = 0: no Fisher cache shaped it).",)
    else:
        scope = ("one threshold over the whole model" if plan.rho_scope == "global"
                 else "the same share in every tensor")
        notes = (f"θ = θpost + M_ρ(λ·Σᵢ wᵢ Δᵢ) with {lam}{weights}, {rho}: the share ρ of the "
                 f"update's ranked directions that the Fisher cache below scores highest was removed "
                 f"({scope}, rho_scope: {plan.rho_scope}; mask: {plan.mask}).",)
    return DataInputs(caches, notes)
