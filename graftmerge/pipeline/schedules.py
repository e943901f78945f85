"""Per-layer schedules of a graft: mergekit's gradient lists and ``filter:`` conditionals, checked and bound per tensor.

A schedule is written as mergekit writes one (``lambda: [0.2, 1.0]``, ``weight: [{filter: mlp, value: 0.5},
{value: 1.0}]``) and means what mergekit makes of it: each tensor's value is the one mergekit's planner resolves for
that tensor. ``check_setting`` refuses what mergekit cannot interpolate before anything is read; ``TensorScales``
are the resolved numbers of one tensor, and a ``Schedule`` holds them for every tensor of a merge.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mergekit.config import ConditionalParameter

from graftmerge.errors import GraftError

SCHEDULABLE = ("lambda", "rho", "weight")  # the parameters a schedule may set; the others are one value


@dataclass(frozen=True)
class TensorScales:
    """One tensor's graft parameters: λ, each donor_ft's and each delta's weight (plan order), ρ."""

    lam: float
    weights: tuple[float, ...]
    delta_weights: tuple[float, ...]
    rho: float


@dataclass(frozen=True)
class Schedule:
    """``TensorScales`` per tensor name, as mergekit resolved them (or as ``merge_state_dicts`` bound them)."""

    entries: tuple[tuple[str, TensorScales], ...]

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorScales]:
        return dict(self.entries)

    def get(self, name: str) -> TensorScales | None:
        """The scales of ``name``; None when the schedule has no entry for it."""
        return self._by_name.get(name)

    def values(self) -> list[TensorScales]:
        """Every tensor's scales, in entry order."""
        return [scales for _, scales in self.entries]


def is_schedule(setting) -> bool:
    """Whether a config setting is a gradient list or a conditional (anything but a single value)."""
    return isinstance(setting, (list, tuple, dict, ConditionalParameter))


def _number(value, label: str) -> float:
    """One number of a schedule, as mergekit reads it for a float parameter; GraftError naming ``label`` else."""
    if isinstance(value, (bool, list, dict)):
        raise GraftError(f"graft parameter {label}: {value!r} in a schedule is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise GraftError(f"graft parameter {label}: {value!r} in a schedule is not a number") from None
    if not math.isfinite(number):
        raise GraftError(f"graft parameter {label}: {value!r} in a schedule is not a finite number")
    return number


def check_setting(setting, label: str, low: float | None = None, high: float | None = None) -> list[str]:
    """Check a scheduled setting: every gradient has at least one number, every number is finite (and in
    [low, high) when given). Returns the filters it names (``*`` and none left out)."""
    if isinstance(setting, dict):
        setting = ConditionalParameter.model_validate(setting)
    if isinstance(setting, ConditionalParameter):
        setting = [setting]
    if not isinstance(setting, (list, tuple)):
        numbers, filters = [setting], []
    elif setting and all(isinstance(c, (ConditionalParameter, dict)) for c in setting):
        filters = []
        for condition in setting:
            condition = ConditionalParameter.model_validate(condition) if isinstance(condition, dict) else condition
            if condition.filter not in (None, "*"):
                filters.append(condition.filter)
            check_setting(condition.value, label, low, high)
        return filters
    elif not setting:
        raise GraftError(f"graft parameter {label}: an empty gradient list; mergekit interpolates a list of one or "
                         "more numbers over the layers (e.g. [0.5, 1.0])")
    else:
        numbers, filters = list(setting), []
    for value in numbers:
        number = _number(value, label)
        if (low is not None and number < low) or (high is not None and number >= high):
            raise GraftError(f"graft parameter {label}: {value!r} in a schedule is outside [{low:g}, {high:g})")
    return filters


def filter_matches(pattern: str, names) -> bool:
    """Whether mergekit's ``filter:`` test (a substring of the tensor's name) holds for any of ``names``."""
    return any(pattern in name for name in names)


def scaled_schedule(setting, factor: float):
    """A schedule with every number multiplied by ``factor`` (each gradient endpoint, each filter's value), as
    plain data (YAML-ready): what a sweep's λ does to a scheduled ``lambda``."""
    if isinstance(setting, ConditionalParameter):
        setting = setting.model_dump(exclude_none=True)
    if isinstance(setting, dict):
        return {**setting, "value": scaled_schedule(setting["value"], factor)}
    if isinstance(setting, (list, tuple)):
        return [scaled_schedule(item, factor) for item in setting]
    return factor * float(setting)


def point_settings(parameters, lam: float, rho: float) -> dict:
    """A config's global parameters at one sweep point: ``lambda`` replaced by ``lam`` (a scheduled one
    multiplied by it, ``scaled_schedule``), ``rho`` replaced by ``rho`` (a schedule too); plain data."""
    found = dict(parameters or {})
    setting = found.get("lambda")
    found["lambda"] = scaled_schedule(setting, lam) if is_schedule(setting) else lam
    found["rho"] = rho
    return found
