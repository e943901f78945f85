"""``graftmerge search``'s bridge to Optuna: the study in DIR's journal, trials claimed and told, points sampled.

Optuna is an optional extra (``pip install 'graftmerge[search]'``), so it is imported only here,
inside the functions that use it. The study lives in ``DIR/study.journal`` (Optuna's
``JournalStorage`` with its file backend: an append-only log every worker on the machine,
or on any machine sharing the folder, reads and appends to).

Sampling is a pure function of (seed, trial number, the finished trials' parameters and
scores): trial ``k`` is asked of a fresh in-memory study holding the journal's finished
trials, with a sampler seeded by ``seed`` and ``k``. So a search killed and resumed asks
the same points an uninterrupted one asks, and the journal never holds a half-sampled
trial: a claimed trial is written in one append, its parameters complete.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

from graftmerge.errors import GraftError

STUDY = "graftmerge-search"
JOURNAL = "study.journal"
INSTALL = "graftmerge search needs Optuna: pip install 'graftmerge[search]' (or pip install 'optuna>=4,<5')"


@dataclass(frozen=True)
class Dimension:
    """One searched parameter: a float in [low, high] (log-uniform when ``log``), a yes/no choice, or one of
    ``choices``."""

    name: str
    low: float = 0.0
    high: float = 1.0
    log: bool = False
    choice: bool = False
    choices: tuple = ()


@dataclass(frozen=True)
class Trial:
    """A trial as the journal holds it: number, parameters, state, its record (when finished), its owner."""

    number: int
    params: dict
    state: str  # "running", "complete" or "fail"
    record: dict | None
    owner: str | None
    values: tuple[float, float] | None


def optuna_module():
    """The optuna module; GraftError with the install line when it is missing."""
    try:
        # lazy: optuna is an optional extra, and only graftmerge search needs it
        import optuna
    except ImportError:
        raise GraftError(INSTALL) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _distributions(space: list[Dimension]) -> dict:
    """Optuna distributions of the space."""
    optuna = optuna_module()
    found = {}
    for dimension in space:
        if dimension.choice or dimension.choices:
            found[dimension.name] = optuna.distributions.CategoricalDistribution(list(dimension.choices or
                                                                                      (False, True)))
        else:
            found[dimension.name] = optuna.distributions.FloatDistribution(dimension.low, dimension.high,
                                                                           log=dimension.log)
    return found


def _storage(folder: Path):
    """The journal storage of DIR (its file created on first write)."""
    optuna = optuna_module()
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock  # lazy: the optional extra

    path = str(folder / JOURNAL)
    return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))


def stored_header(folder: Path) -> dict | None:
    """The header of the study in DIR's journal; None when DIR holds no journal (or no study in it)."""
    if not (folder / JOURNAL).is_file():
        return None
    optuna = optuna_module()
    try:
        study = optuna.load_study(study_name=STUDY, storage=_storage(folder))
    except KeyError:
        return None
    except Exception as error:  # noqa: BLE001 - any damage to the journal is one error line
        raise GraftError(f"{folder / JOURNAL} cannot be read as a search's study ({error}); choose another "
                         "output folder") from None
    return study.user_attrs.get("header")


class Study:
    """The search's study in DIR's journal, as graftmerge uses it."""

    def __init__(self, folder: Path, header: dict | None = None):
        optuna = optuna_module()
        self._optuna = optuna
        storage = _storage(folder)
        if header is not None:
            study = optuna.create_study(study_name=STUDY, storage=storage, load_if_exists=True,
                                        directions=["maximize", "maximize"])
            if "header" not in study.user_attrs:
                study.set_user_attr("header", header)
        else:
            study = optuna.load_study(study_name=STUDY, storage=storage)
        self._study, self._storage = study, storage

    @property
    def header(self) -> dict:
        """What the study was started for (config, tasks, inputs, settings, space)."""
        return self._study.user_attrs["header"]

    def attribute(self, name: str):
        """A study-level attribute (θpost's record, test records); None when unset."""
        return self._study.user_attrs.get(name)

    def set_attribute(self, name: str, value) -> None:
        """Store a study-level attribute (JSON-ready)."""
        self._study.set_user_attr(name, value)

    def trials(self) -> list[Trial]:
        """Every trial in the journal, by number."""
        states = {"RUNNING": "running", "COMPLETE": "complete", "FAIL": "fail", "WAITING": "running",
                  "PRUNED": "fail"}
        return [Trial(t.number, dict(t.params), states[t.state.name], t.user_attrs.get("record"),
                      t.user_attrs.get("owner"), tuple(t.values) if t.values else None)
                for t in sorted(self._study.get_trials(deepcopy=False), key=lambda t: t.number)]

    def claim(self, params: dict, space: list[Dimension], owner: str) -> int:
        """Write a running trial with ``params`` (one journal append); its number."""
        trial = self._optuna.trial.create_trial(
            state=self._optuna.trial.TrialState.RUNNING, params=params, distributions=_distributions(space),
            user_attrs={"owner": owner})
        self._study.add_trial(trial)
        return max(t.number for t in self._study.get_trials(deepcopy=False))

    def take_over(self, number: int, owner: str) -> None:
        """Mark a running trial as now evaluated by ``owner`` (its former owner is gone)."""
        self._storage.set_trial_user_attr(self._trial_id(number), "owner", owner)

    def finish(self, number: int, record: dict, values: tuple[float, float] | None) -> None:
        """Store a trial's record and tell its scores (None: a failed evaluation, told as FAIL)."""
        self._storage.set_trial_user_attr(self._trial_id(number), "record", record)
        if values is None:
            self._study.tell(number, state=self._optuna.trial.TrialState.FAIL)
        else:
            self._study.tell(number, list(values))

    def _trial_id(self, number: int) -> int:
        """The storage's id of trial ``number``."""
        return self._storage.get_trial_id_from_study_id_trial_number(self._study._study_id, number)


def sample(space: list[Dimension], finished: list[Trial], seed: int, number: int, startup: int) -> dict:
    """Trial ``number``'s parameters: asked of a fresh in-memory study holding ``finished`` (complete trials),
    with a multi-objective TPE sampler seeded by (``seed``, ``number``): the same inputs, the same point."""
    optuna = optuna_module()
    derived = int.from_bytes(hashlib.sha256(f"{seed}:{number}".encode()).digest()[:4], "big")
    with warnings.catch_warnings():  # multivariate and constant_liar are "experimental" in Optuna 4
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=derived, n_startup_trials=startup, multivariate=True,
                                             constant_liar=True)
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
    distributions = _distributions(space)
    study.add_trials([optuna.trial.create_trial(params=t.params, distributions=distributions, values=list(t.values),
                                                state=optuna.trial.TrialState.COMPLETE)
                      for t in finished if t.values is not None])
    return dict(study.ask(distributions).params)
