"""The merges of one kind running in this process, each findable by an id for as long as it runs.

mergekit plans one task per tensor from a config's parameters and cannot hand a task an
object, so a merge registers its run under a fresh id, puts the id into the config mergekit
sees, and each task looks its run up by that id. Keyed by id, not "the current merge":
mergekit may run tasks in other threads (--multi-gpu), and two merges may run at once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Generic, TypeVar

Run = TypeVar("Run")


class ActiveRuns(dict[str, Run], Generic[Run]):
    """id → run, empty once every merge has returned (a plain dict to read, :meth:`registered` to add)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind  # the ids' prefix: which merges these are

    @contextlib.contextmanager
    def registered(self, run: Run, kind: str | None = None) -> Iterator[str]:
        """``run`` findable by the id this yields, until the block ends, however it ends."""
        run_id = f"{kind or self.kind}-run-{uuid.uuid4().hex}"
        self[run_id] = run
        try:
            yield run_id
        finally:
            del self[run_id]

    def run_merge(self, original, run: Run, parameter: str, config, out_path: str, options, config_source=None,
                  kind: str | None = None):
        """mergekit's own ``original`` run_merge on ``config`` for ``run``: registered meanwhile, its id in the
        config's parameter ``parameter``, where each task finds it.

        mergekit writes the config it is given into the model card unless given its source: the
        source is the config as the caller gave it, never with the id.
        """
        if not config_source:
            config_source = config.to_yaml()
        with self.registered(run, kind) as run_id:
            config = config.model_copy(update={"parameters": {**(config.parameters or {}), parameter: run_id}})
            return original(config, out_path, options=options, config_source=config_source)

    def find(self, run_id: str | None) -> Run | None:
        """The run registered under ``run_id``, None when there is none."""
        return self.get(run_id) if run_id is not None else None
