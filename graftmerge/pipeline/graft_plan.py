"""A graft config, resolved and validated before any tensor is loaded.

``GraftPlan`` is the pure description (paths and numbers); ``GraftInputs`` opens
it (safetensors headers, the Fisher cache manifest) and answers per-tensor
questions: which dtype, which Fisher representation, which tensors are ranked.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mergekit.common import dtype_from_name

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import (
    Checkpoint,
    FileIdentity,
    check_same_tensors,
    check_unchanged,
)
from graftmerge.formats.delta_folder import MANIFEST_NAME as DELTA_MANIFEST
from graftmerge.formats.delta_folder import DeltaFolder, open_delta
from graftmerge.formats.fisher_cache import FisherCache, open_fisher_cache, side_rank
from graftmerge.formats.lora_adapter import is_lora_adapter
from graftmerge.formats.lora_sources import open_lora_delta, open_lora_fine_tune
from graftmerge.hub.kinds import FISHER
from graftmerge.hub.models import resolve_model_folder
from graftmerge.hub.pull import resolve_artifact
from graftmerge.math.donor_delta import donor_delta
from graftmerge.math.projection import TensorFisher
from graftmerge.pipeline.graft_kernel import read_fisher
from graftmerge.pipeline.schedules import Schedule, TensorScales, check_setting, is_schedule
from graftmerge.pipeline.trusted_code import TRUST_PARAMETER, check_trusted_code

ROLES = ("donor", "donor_ft")
CONFIG_ROLES = (*ROLES, "delta")  # delta: a folder from `graftmerge delta extract`
MODEL_PARAMETERS = ("role", "weight")
GLOBAL_PARAMETERS = ("lambda", "rho", "fisher", "rho_scope", "mask", TRUST_PARAMETER)
RHO_SCOPES = ("global", "tensor")
MASK_KINDS = ("auto", "diagonal", "kfac")
BLOCK_ELEMENTS = 1 << 24  # the pre-pass reads tensors larger than this in row blocks


@dataclass(frozen=True)
class FineTune:
    """One weighted model term of a graft: a donor_ft folder, or a delta folder (``role: delta``).

    ``adapter``: a donor_ft written ``BASE+ADAPTER`` (mergekit's LoRA reference): ``path`` is
    the base, θft is the base with the PEFT LoRA folder ``adapter`` merged in. A ``role: delta``
    path may itself be a LoRA folder (Δ = the adapter's B·A·scaling).
    """

    path: str
    weight: float = 1.0
    adapter: str | None = None


@dataclass(frozen=True)
class GraftPlan:
    """θ = θpost + M_ρ(Σ_i lambda·weight_i (θft_i − θdonor) + Σ_j lambda·weight_j δ_j).

    ``deltas`` are precomputed δ folders (``role: delta``); ``donor`` is None
    when there are only deltas.
    """

    post: str
    donor: str | None
    fine_tunes: tuple[FineTune, ...]
    lam: float = 1.0
    rho: float = 0.0
    fisher: str | None = None
    rho_scope: str = "global"
    mask: str = "auto"
    dtype: str | None = None
    deltas: tuple[FineTune, ...] = ()

    scheduled: tuple[str, ...] = ()  # parameters written as schedules ("lambda", "rho", "weight of X")
    schedule: Schedule | None = None  # their values per tensor, once bound (``schedule_binding``)

    def scales(self, name: str) -> TensorScales:
        """λ, the weights and ρ of tensor ``name``: its schedule's entry, or the plan's single values."""
        if self.schedule is not None:
            found = self.schedule.get(name)
            if found is None:
                raise GraftError(f"tensor {name!r}: the graft's schedule has no value for it (mergekit planned no "
                                 "merge of this tensor)")
            return found
        if self.scheduled:
            raise GraftError(f"graft parameter {self.scheduled[0]} is a per-layer schedule, which this command does "
                             "not resolve (merge, mergekit-yaml, plan and sweep do); give it a single value here")
        return TensorScales(self.lam, tuple(f.weight for f in self.fine_tunes),
                            tuple(d.weight for d in self.deltas), self.rho)

    def lambdas_for(self, name: str) -> list[float]:
        """λ·weight of each fine-tune for tensor ``name``, in config order."""
        scales = self.scales(name)
        return [scales.lam * weight for weight in scales.weights]

    def delta_lambdas_for(self, name: str) -> list[float]:
        """λ·weight of each precomputed delta for tensor ``name``, in config order."""
        scales = self.scales(name)
        return [scales.lam * weight for weight in scales.delta_weights]

    def rho_for(self, name: str) -> float:
        """The ρ of tensor ``name`` (one ρ for every tensor unless ``rho_scope: tensor`` and a schedule)."""
        return self.scales(name).rho

    def at_point(self, lam: float, rho: float) -> GraftPlan:
        """This plan at one sweep point, unbound: ``lambda`` replaced by ``lam`` (a scheduled one stays scheduled,
        multiplied by ``lam`` where it is bound: ``schedules.point_settings``), ``rho`` replaced by ``rho``."""
        scheduled = tuple(label for label in self.scheduled if label != "rho")
        return dataclasses.replace(self, lam=lam, rho=rho, scheduled=scheduled, schedule=None)

    @property
    def masked(self) -> bool:
        """Whether a Fisher mask is applied (ρ > 0 for some tensor)."""
        if self.schedule is not None:
            return any(scales.rho > 0 for scales in self.schedule.values())
        return self.rho > 0 or "rho" in self.scheduled

    def check(self) -> None:
        """Parameter-level checks (no file access beyond existence)."""
        terms = (*self.fine_tunes, *self.deltas)
        for label, value in [("lambda", self.lam)] + [(f"weight of {f.path}", f.weight) for f in terms]:
            if not math.isfinite(value):
                raise GraftError(f"graft parameter {label} must be a finite number, got {value}")
        if not 0 <= self.rho < 1:
            raise GraftError(f"graft parameter rho must be in [0, 1), got {self.rho}")
        self._check_schedule()
        if self.rho_scope not in RHO_SCOPES:
            raise GraftError(
                f"graft parameter rho_scope must be one of {', '.join(RHO_SCOPES)}, got {self.rho_scope!r}"
            )
        if self.mask not in MASK_KINDS:
            raise GraftError(f"graft parameter mask must be one of {', '.join(MASK_KINDS)}, got {self.mask!r}")
        if self.masked and not self.fisher:
            raise GraftError(
                "graft parameter rho > 0 needs `fisher: <Fisher cache folder>` (see graftmerge fisher estimate)"
            )

    def _check_schedule(self) -> None:
        """A per-tensor ρ needs ``rho_scope: tensor``; every bound value is finite (ρ in [0, 1))."""
        per_tensor_rho = "rho" in self.scheduled or (
            self.schedule is not None and len({s.rho for s in self.schedule.values()}) > 1)
        if per_tensor_rho and self.rho_scope == "global":
            raise GraftError(
                "graft parameter rho: a per-layer or per-tensor rho (a gradient list, a filter, or PerGroupValues) "
                "needs `rho_scope: tensor`; rho_scope global ranks the whole model against one threshold at one ρ")
        for name, scales in self.schedule.entries if self.schedule is not None else ():
            if not all(math.isfinite(v) for v in (scales.lam, *scales.weights, *scales.delta_weights)):
                raise GraftError(f"graft parameter lambda or weight of tensor {name!r} is not finite: {scales}")
            if not 0 <= scales.rho < 1:
                raise GraftError(f"graft parameter rho of tensor {name!r} must be in [0, 1), got {scales.rho}")


def resolve_fisher_folder(fisher: str) -> str:
    """The folder of ``fisher:``: a local path as written, or ``org/name@rev`` from the Hub (HF cache offline)."""
    return resolve_artifact(FISHER, fisher)


def plan_inputs(plan: GraftPlan) -> list[tuple[str, str]]:
    """(label, folder) of everything ``plan`` reads: for ``OutputFolder(inputs=...)``, which refuses OUT among them.

    A Fisher cache that does not resolve is left out here: opening the inputs reports it.
    """
    found = [("post model (base_model)", plan.post), ("donor", plan.donor)]
    for fine_tune in plan.fine_tunes:
        found.append(("donor_ft", fine_tune.path))
        found.append(("adapter of donor_ft", fine_tune.adapter))
    found += [("delta", delta.path) for delta in plan.deltas]
    if plan.fisher:
        found.append(("Fisher cache", _fisher_folder_or_none(plan.fisher)))
    return [(label, path) for label, path in found if path is not None]


def _fisher_folder_or_none(fisher: str) -> str | None:
    """The Fisher cache's folder, or None if it does not resolve (opening the inputs says why)."""
    try:
        return resolve_fisher_folder(fisher)
    except GraftError:
        return None


@dataclass
class GraftInputs:
    """The opened inputs of a plan: checkpoints (headers only) and the Fisher cache."""

    plan: GraftPlan
    post: Checkpoint
    donor: Checkpoint | None  # None: the plan has only deltas
    fine_tunes: list[Checkpoint]
    fisher: FisherCache | None
    _fisher_kind: dict[str, str | None] = field(default_factory=dict)
    deltas: list[Checkpoint] = field(default_factory=list)  # role: delta folders, in plan order
    _pinned: tuple[dict, dict] | None = field(default=None, repr=False)  # (post's files, the others'), once

    @classmethod
    def open(cls, plan: GraftPlan) -> GraftInputs:
        """Open the plan's model folders (headers only) and its Fisher cache, all checked."""
        plan.check()
        check_distinct_inputs(plan_folders(plan))
        post = Checkpoint(plan.post, label=f"post model {plan.post}")
        donor = Checkpoint(plan.donor, label=f"donor {plan.donor}") if plan.donor is not None else None
        fine_tunes = [_open_fine_tune(ft) for ft in plan.fine_tunes]
        deltas = [_open_delta_input(d.path, post, donor, plan.post) for d in plan.deltas]
        inputs = cls.from_sources(plan, post, donor, fine_tunes, deltas=deltas)
        inputs.pinned()  # every file's identity, now that all are open
        return inputs

    @classmethod
    def from_sources(
        cls, plan: GraftPlan, post, donor, fine_tunes: list, *, partial: bool = False,
        deltas: list[DeltaFolder] = (),
    ) -> GraftInputs:
        """The same checks for any tensor sources with Checkpoint's interface (files or memory).

        ``partial``: the post sources may hold a subset of the cache's model (in-memory
        callers pass only floating tensors); each given tensor must still fit the cache.
        The caller has run ``plan.check()`` (before opening anything).
        """
        check_same_tensors(post, [c for c in (donor, *fine_tunes, *(d.checkpoint for d in deltas)) if c is not None])
        _check_delta_donors(deltas, donor)
        fisher = None
        if plan.masked:
            fisher = open_fisher_cache(resolve_fisher_folder(plan.fisher))
            fisher.check_fits(post, partial=partial)
            fisher.check_same_weights(post)  # by content: a fine-tune of the same shapes is refused
            _check_kfac_sizes(fisher, post)
            if plan.mask == "kfac" and not fisher.names("kfac"):
                raise GraftError(f"mask: kfac, but Fisher cache {plan.fisher} has no KFAC entries (kind {fisher.kind})")
        return cls(plan, post, donor, fine_tunes, fisher, deltas=[d.checkpoint for d in deltas])

    def pinned(self, with_post: bool = True) -> dict[Path, FileIdentity]:
        """Every input file (shards, shard indexes, adapter files, the Fisher cache's files) with the identity
        it had when it was opened; ``with_post=False`` leaves out the post model's own files.

        Taken once: later calls return the same identities, so ``check_unchanged`` compares
        with what was validated and scored, not with what is there now.
        """
        if self._pinned is None:
            others: dict[Path, FileIdentity] = {}
            for source in (self.donor, *self.fine_tunes, *self.deltas, self.fisher):
                if source is not None:
                    others.update(source.pinned())
            self._pinned = (self.post.pinned(), others)
        post, others = self._pinned
        return {**post, **others} if with_post else dict(others)

    def check_unchanged(self) -> None:
        """GraftError (one line, naming the file) when any input file changed since it was opened."""
        check_unchanged(self.pinned())

    def fisher_kind(self, name: str) -> str | None:
        """'diagonal', 'kfac' or None (not ranked, Δ applied unmasked) for tensor ``name``."""
        if name not in self._fisher_kind:
            self._fisher_kind[name] = self._choose_kind(name)
        return self._fisher_kind[name]

    def _choose_kind(self, name: str) -> str | None:
        if self.fisher is None or name not in self.post.tensors or not self.post.tensors[name].is_floating:
            return None
        has_kfac, has_diag = self.fisher.has(name, "kfac"), self.fisher.has(name, "diagonal")
        if self.plan.mask == "diagonal":
            return "diagonal" if has_diag else None
        if self.plan.mask == "kfac":
            return "kfac" if has_kfac else ("diagonal" if has_diag else None)
        return self.fisher.representation(name)

    def ranked_names(self) -> list[str]:
        """Tensors whose directions are scored, in the canonical (tie-breaking) order."""
        return [name for name in sorted(self.post.tensors) if self.fisher_kind(name)]

    def direction_count(self, name: str) -> int:
        """Directions of ``name`` that are scored (count in D): its coordinates, or its KFAC pairs.

        A truncated KFAC side (``fisher compress``) contributes only its kept eigenvectors.
        """
        if self.fisher_kind(name) == "kfac":
            return math.prod(side_rank(self.fisher.kfac_side(name, side)) for side in ("rows", "columns"))
        return self.post.tensors[name].numel

    def tensor_fisher(self, name: str, rows: tuple[int, int] | None = None) -> TensorFisher:
        """The Fisher a tensor is masked with (optionally for rows ``start:stop`` only)."""
        return read_fisher(self.fisher, name, self.fisher_kind(name), rows)

    def row_blocks(self, name: str) -> list[tuple[int, int] | None]:
        """Row ranges that can be scored independently: bounded memory for huge embeddings.

        Rows are independent unless a KFAC entry has a full row-side eigenbasis.
        """
        shape = self.post.tensors[name].shape
        if len(shape) == 0 or self.post.tensors[name].numel <= BLOCK_ELEMENTS:
            return [None]
        if self.fisher_kind(name) == "kfac" and "eigenvectors" in self.fisher.kfac_side(name, "rows"):
            return [None]
        step = max(1, BLOCK_ELEMENTS // (self.post.tensors[name].numel // shape[0]))
        return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]

    def working_dtype(self, name: str) -> torch.dtype:
        """The dtype mergekit hands the kernel: config dtype, else the inputs' promoted dtype."""
        if self.plan.dtype:
            return dtype_from_name(self.plan.dtype)
        dtype = self.post.tensors[name].torch_dtype
        for checkpoint in (self.donor, *self.fine_tunes, *self.deltas):
            if checkpoint is not None:
                dtype = torch.promote_types(dtype, checkpoint.tensors[name].torch_dtype)
        return dtype

    def read_delta(
        self, name: str, device: torch.device | str = "cpu", rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Δ for one tensor (or its rows), computed exactly as the merge kernel computes it."""
        dtype = self.working_dtype(name)
        read = lambda source: source.read(name, rows).to(device=device, dtype=dtype)  # noqa: E731
        donor = read(self.donor) if self.donor is not None else None
        fine_tunes = [read(ft) for ft in self.fine_tunes]
        deltas = [read(d) for d in self.deltas]
        return donor_delta(donor, fine_tunes, self.plan.lambdas_for(name), deltas, self.plan.delta_lambdas_for(name))


def open_inputs(plan: GraftPlan) -> GraftInputs:
    """``GraftInputs.open(plan)``: every input opened and checked, anew at each call (nothing is kept per process).

    A merge opens its inputs once, when it starts, and keeps them in its
    :class:`~graftmerge.pipeline.merge_run.MergeRun`.
    """
    return GraftInputs.open(plan)


def _open_fine_tune(fine_tune: FineTune):
    """A donor_ft: its folder, or (``BASE+ADAPTER``) the base with the LoRA adapter merged in, as PEFT merges it."""
    if fine_tune.adapter is None:
        return Checkpoint(fine_tune.path, label=f"donor_ft {fine_tune.path}")
    base = Checkpoint(fine_tune.path, label=f"base {fine_tune.path} of donor_ft {fine_tune.path}+{fine_tune.adapter}")
    return open_lora_fine_tune(
        fine_tune.adapter, base, fine_tune.path, f"donor_ft {fine_tune.path}+{fine_tune.adapter}"
    )


def _open_delta_input(path: str, post: Checkpoint, donor: Checkpoint | None, post_folder: str):
    """A ``role: delta`` input: a delta folder, or a PEFT LoRA folder bound to the post model's tensors."""
    if is_lora_adapter(path):
        return open_lora_delta(path, post, donor, post_folder, label=f"delta {path} (a LoRA adapter)")
    return open_delta(path, label=f"delta {path}")


def _check_delta_donors(deltas: list[DeltaFolder], donor) -> None:
    """Deltas must come from the config's donor (when it has one), and all from one donor.

    LoRA adapters record no donor fingerprint: they are checked against the post model's shapes instead.
    """
    deltas = [d for d in deltas if isinstance(d, DeltaFolder)]
    if isinstance(donor, Checkpoint):
        for delta in deltas:
            delta.check_donor(donor)
    elif len({d.donor["sampled_sha256"] for d in deltas}) > 1:
        origins = ", ".join(f"{d.path} (from {d.donor['path']})" for d in deltas)
        raise GraftError(
            f"the deltas were extracted from different donors: {origins}; deltas grafted together "
            "must share one donor"
        )


def _check_kfac_sizes(fisher: FisherCache, post: Checkpoint) -> None:
    for name in fisher.names("kfac"):
        if name not in post.tensors:
            continue  # a partial (in-memory) post: only the given tensors are grafted
        shape = post.tensors[name].shape
        if len(shape) != 2:
            raise GraftError(f"Fisher cache {fisher.path}: KFAC entry for {name!r}, which is not 2-D (shape {shape})")
        for side, dim in (("rows", 0), ("columns", 1)):
            size = fisher.kfac_side(name, side)["size"]
            if size != shape[dim]:
                raise GraftError(
                    f"Fisher cache {fisher.path}: KFAC {side} factor of {name!r} has size {size}, "
                    f"weight {shape} needs {shape[dim]}"
                )


def plan_folders(plan: GraftPlan) -> list[tuple[str, str, str]]:
    """(folder as the plan spells it, role, folder) of every input of a file-backed plan, post model first.

    A ``BASE+ADAPTER`` donor_ft is its adapter folder (its base is the donor, checked elsewhere).
    """
    named = [(plan.post, "base_model", plan.post)]
    named += [] if plan.donor is None else [(plan.donor, "donor", plan.donor)]
    for role, terms in (("donor_ft", plan.fine_tunes), ("delta", plan.deltas)):
        named += [(folder, role, folder) for folder in (term.adapter or term.path for term in terms)]
    return named


def _identities(folder: str) -> list[tuple]:
    """What makes two folders one input: the folder itself (device, inode), and, when it has any, the
    set of its files (device, inode, links followed): a copy made of hard links, or two snapshots
    linking the same HF blobs, is the same input; a copy with one file of its own (an adapter's
    edited config) is not."""
    try:
        found = os.stat(folder)
        files = frozenset((s.st_dev, s.st_ino) for s in (os.stat(p) for p in Path(folder).iterdir() if p.is_file()))
    except OSError as error:
        raise GraftError(f"input folder {folder}: cannot read ({error.strerror})") from error
    return [("folder", found.st_dev, found.st_ino)] + ([("files", files)] if files else [])


def check_distinct_inputs(named: Sequence[tuple[str, str, str]]) -> None:
    """No folder is two inputs, by real identity (not spelling): (label as written, role, folder) each.

    The one pair allowed is the base_model again as ``role: donor`` (Δ = θft − θpost). A donor_ft
    that is the donor (or the post model, or another donor_ft) would graft nothing, or the same Δ twice.
    """
    seen: dict[tuple, tuple[str, str, str]] = {}
    for label, role, folder in named:
        for key in _identities(folder):
            if key not in seen:
                seen[key] = (label, role, folder)
                continue
            other_label, other_role, other_folder = seen[key]
            if {role, other_role} == {"base_model", "donor"}:
                continue
            real = os.path.realpath(folder)
            what = (f"are the same folder {real}" if key[0] == "folder" else
                    f"hold the very same files (links to one copy: {real} and {os.path.realpath(other_folder)})")
            raise GraftError(
                f"model {label} ({role}) and model {other_label} ({other_role}) {what}; "
                "each input is a different folder (only the base_model may appear again, as role donor: that "
                "masks Δ = θft − θpost)"
            )


def check_role_counts(donors: int, fine_tunes: int, what: str = "model", deltas: int = 0) -> None:
    """At most one donor, at least one donor_ft or delta, a donor with every donor_ft: the same words for configs
    and state dicts."""
    if donors > 1:
        raise GraftError(f"duplicate role donor ({donors} {what}s); a graft has exactly one donor")
    if not fine_tunes and not deltas:
        raise GraftError(
            f"graft needs at least one {what} with role donor_ft (the fine-tuned donor) or role delta "
            "(a folder from `graftmerge delta extract`)"
        )
    if fine_tunes and not donors:
        raise GraftError("donor_ft given without a donor; add the checkpoint it was fine-tuned from with role donor")


def positional_roles(non_base_ids: Sequence[Hashable], given: Mapping[Hashable, str]) -> dict[Hashable, str]:
    """Roles of in-memory inputs (mergekit's ``merge_state_dicts``): as given, or by position.

    With no ``role`` at all, the first non-base input is the donor and the others are
    donor_ft (so ``[post, donor, ft]`` with ``base=0`` just works); once any input has a
    role, every one must.
    """
    unset = [key for key in non_base_ids if not given.get(key)]
    if len(unset) == len(non_base_ids):
        return {key: "donor" if index == 0 else "donor_ft" for index, key in enumerate(non_base_ids)}
    if unset:
        raise GraftError(
            f"graft input(s) {', '.join(map(repr, unset))} have no role while others do: give every "
            "non-base input a role (donor, donor_ft, delta), or none (then the first non-base input is the "
            "donor, the others donor_ft)"
        )
    for key in non_base_ids:
        if given[key] not in CONFIG_ROLES:
            raise GraftError(
                f"graft input {key!r} has unknown role {given[key]!r}; roles are {', '.join(CONFIG_ROLES)}"
            )
    roles = [given[key] for key in non_base_ids]
    check_role_counts(roles.count("donor"), roles.count("donor_ft"), what="input", deltas=roles.count("delta"))
    return {key: given[key] for key in non_base_ids}


def _scalar(value, label: str):
    if is_schedule(value):
        raise GraftError(f"graft parameter {label} must be a single value (per-layer schedules, gradient lists or "
                         "filters, are for lambda, the weight of a donor_ft or delta, and rho under rho_scope: tensor)")
    return value


def _number_or_schedule(value, label: str, scheduled: list[str], **bounds) -> float | None:
    """A single value as a number; a schedule checked (``check_setting``), noted in ``scheduled``, and None."""
    if not is_schedule(value):
        return _number(value, label)
    check_setting(value, label, **bounds)
    scheduled.append(label)
    return None


def _number(value, label: str) -> float:
    value = _scalar(value, label)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise GraftError(f"graft parameter {label} must be a number, got {value!r}") from None
    except OverflowError:  # an integer beyond float's range (YAML reads integers of up to 4300 digits)
        raise GraftError(f"graft parameter {label} must be a finite number, got an integer of "
                         f"{len(str(abs(value)))} digits") from None


def plan_from_merge_config(config) -> GraftPlan:
    """Validate a mergekit ``MergeConfiguration`` with ``merge_method: graft``; no tensor IO."""
    if config.slices or config.modules or not config.models:
        raise GraftError("graft configs list inputs under `models:` (slices and modules are not supported)")
    if config.base_model is None:
        raise GraftError("graft needs `base_model:` — the post-trained model that receives the graft")
    parameters = dict(config.parameters or {})
    unknown = sorted(set(parameters) - set(GLOBAL_PARAMETERS))
    if unknown:
        raise GraftError(f"unknown graft parameter(s) {', '.join(unknown)}; known: {', '.join(GLOBAL_PARAMETERS)}")
    donors, fine_tunes, deltas, seen = [], [], [], {str(config.base_model): "base_model"}
    scheduled: list[str] = []
    post = resolve_model_folder(config.base_model.model.path, config.base_model.model.revision)
    named = [(str(config.base_model), "base_model", post)]  # (as written, role, the folder that is the input)
    for entry in config.models:
        reference, label, model_parameters = entry.model, str(entry.model), dict(entry.parameters or {})
        role = _entry_role(label, model_parameters, seen)
        _check_lora_role(reference, label, role)
        folder = resolve_model_folder(reference.model.path, reference.model.revision)
        if role == "donor":
            if "weight" in model_parameters:
                raise GraftError(f"model {label}: `weight` belongs on donor_ft and delta inputs, not on the donor")
            donors.append(folder)
            named.append((label, role, folder))
        else:
            term = _weighted_input(reference, label, role, folder, model_parameters, scheduled)
            (deltas if role == "delta" else fine_tunes).append(term)
            named.append((label, role, term.adapter or term.path))
    check_distinct_inputs(named)
    donors = _with_implied_donor(donors, fine_tunes, config.base_model.model)
    check_role_counts(len(donors), len(fine_tunes), deltas=len(deltas))
    plan = build_plan(post, donors[0] if donors else None, fine_tunes, deltas, parameters, dtype=config.dtype,
                      scheduled=scheduled)
    return check_trusted_code(config, plan)


def build_plan(post: str, donor: str | None, fine_tunes: Sequence[FineTune], deltas: Sequence[FineTune],
               parameters: Mapping, dtype: str | None = None, scheduled: Sequence[str] = (),
               schedule: Schedule | None = None) -> GraftPlan:
    """The one place a GraftPlan is made: its inputs, and the graft's shared parameters (lambda, rho, fisher,
    rho_scope, mask) as a config writes them or mergekit binds them; checked (``plan.check``).

    lambda and rho may be schedules (a weight's is noted in ``scheduled`` by the caller): the plan
    then needs their values per tensor (``schedule``, or ``schedule_binding.bind_schedule`` later).
    """
    fisher = parameters.get("fisher")
    fisher = None if fisher is None else str(_scalar(fisher, "fisher"))
    scheduled = list(scheduled)
    lam = _number_or_schedule(parameters.get("lambda", 1.0), "lambda", scheduled)
    rho = _number_or_schedule(parameters.get("rho", 0.0), "rho", scheduled, low=0.0, high=1.0)
    plan = GraftPlan(
        post=post,
        donor=donor,
        fine_tunes=tuple(fine_tunes),
        deltas=tuple(deltas),
        lam=1.0 if lam is None else lam,
        rho=0.0 if rho is None else rho,
        fisher=fisher,
        rho_scope=str(_scalar(parameters.get("rho_scope", "global"), "rho_scope")),
        mask=str(_scalar(parameters.get("mask", "auto"), "mask")),
        dtype=dtype,
        scheduled=tuple(scheduled),
        schedule=schedule,
    )
    plan.check()
    return plan


def _entry_role(label: str, model_parameters: dict, seen: dict[str, str]) -> str:
    """The role of one ``models:`` entry, checked (and recorded in ``seen``, by the label as written)."""
    if label in seen and not (seen[label] == "base_model" and model_parameters.get("role") == "donor"):
        raise GraftError(f"model {label} is listed twice (as {seen[label]} and again); each input appears once "
                         "(only the base_model may appear again, as role donor: that masks Δ = θft − θpost)")
    unknown = sorted(set(model_parameters) - set(MODEL_PARAMETERS))
    if unknown:
        raise GraftError(f"model {label}: unknown parameter(s) {', '.join(unknown)}; known: role, weight")
    role = _scalar(model_parameters.get("role"), f"role of {label}")
    if role is None:
        raise GraftError(
            f"model {label} has no role; set `parameters: {{role: donor}}`, `{{role: donor_ft}}` or `{{role: delta}}`"
        )
    if role not in CONFIG_ROLES:
        raise GraftError(f"model {label} has unknown role {role!r}; roles are {', '.join(CONFIG_ROLES)}")
    seen[label] = f"role {role}"
    return role


def _check_lora_role(reference, label: str, role: str) -> None:
    """mergekit's ``BASE+ADAPTER`` reference is a fine-tune of BASE: role donor_ft only."""
    if reference.lora is not None and role != "donor_ft":
        raise GraftError(f"model {label}: a LoRA reference BASE+ADAPTER is a fine-tune of BASE, so its role is "
                         "donor_ft (or give the adapter folder alone role delta)")


def _weighted_input(reference, label: str, role: str, folder: str, model_parameters: dict,
                    scheduled: list[str]) -> FineTune:
    """A donor_ft or delta entry: its folder, weight and (``BASE+ADAPTER``) adapter folder, checked.

    A scheduled weight is noted in ``scheduled``; the entry's own weight is then 1 (unused).
    """
    weight = _number_or_schedule(model_parameters.get("weight", 1.0), f"weight of {label}", scheduled)
    weight = 1.0 if weight is None else weight
    if role == "delta" and not os.path.exists(os.path.join(folder, DELTA_MANIFEST)) and not is_lora_adapter(folder):
        raise GraftError(
            f"model {label} has role delta, but {folder} has no {DELTA_MANIFEST}: make a delta with "
            "`graftmerge delta extract DONOR DONOR_FT -o DELTA`, give a PEFT LoRA folder (adapter_config.json), "
            "or give this model role donor_ft"
        )
    if reference.lora is None:
        return FineTune(folder, weight)
    adapter = resolve_model_folder(reference.lora.path, reference.lora.revision)
    if not is_lora_adapter(adapter):
        raise GraftError(f"model {label}: the adapter {adapter} has no adapter_config.json (not a PEFT LoRA folder)")
    return FineTune(folder, weight, adapter=adapter)


def _with_implied_donor(donors: list[str], fine_tunes: list[FineTune], post) -> list[str]:
    """The donors, plus BASE when a ``BASE+ADAPTER`` donor_ft implies it: every such BASE must be the donor."""
    same = lambda a, b: os.path.realpath(a) == os.path.realpath(b)  # noqa: E731
    post = resolve_model_folder(post.path, post.revision)
    for fine_tune in (ft for ft in fine_tunes if ft.adapter is not None):
        reference = f"{fine_tune.path}+{fine_tune.adapter}"
        if same(fine_tune.path, post):
            raise GraftError(f"model {reference}: its base is the post model; to graft an adapter onto the model it "
                             "was trained on, give the adapter folder alone role delta (no donor needed)")
        if donors and not same(fine_tune.path, donors[0]):
            raise GraftError(f"model {reference}: the adapter was trained on {fine_tune.path}, but the donor is "
                             f"{donors[0]}; Δ = (base + adapter) − donor needs its own base as the donor (or omit "
                             "the donor: a LoRA reference implies it)")
        donors = donors or [fine_tune.path]
    return donors
