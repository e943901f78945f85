"""``graftmerge search`` on tiny models with the weight judge (tests/helpers/weight_judge.py), in this process or
as a worker process: the search's bookkeeping without tokenizer or tasks."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from mergekit.options import MergeOptions

from graftmerge.adapter import import_hook
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.search import SearchRequest, Space, run_search
from graftmerge.pipeline.sweep_eval import Evaluation, Judge
from tests.helpers.runners import forget_process_state
from tests.helpers.weight_judge import WeightJudge, load_eval_model

SPACE = Space((0.25, 1.5), (0.01, 0.3), 0)


class KillingJudge(WeightJudge):
    """The weight judge, SIGKILLing its own process at call ``kill`` (a search killed mid-study)."""

    def __init__(self, models, kill: int | None = None):
        super().__init__(models)
        self.kill = kill

    def score(self, model, splits) -> dict:
        if self.calls + 1 == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().score(model, splits)


def search(models: dict, config: Path, tasks: Path, out: Path, *, trials: int = 8, space: Space = SPACE,
           seed: int = 0, tolerance: float = 0.3, judge: WeightJudge | None = None, warm_start: str = "corners",
           workers: int = 1, join: bool = False, worker_command=None, fingerprint: str = "tasks-1",
           more_configs: tuple = ()):
    """run_search in this process, θpost loaded as the evaluation model (float32)."""
    import_hook.install()
    forget_process_state()
    judge = judge or WeightJudge(models)
    loaded, source, plan = read_graft_config(str(config))
    evaluation = Evaluation((str(tasks),), fingerprint, {"dtype": "float32"})

    def make_judge() -> Judge:
        return Judge(lambda: load_eval_model(models["post"], torch.float32), judge.score, judge.roles)

    request = SearchRequest(trials, seed, tolerance, warm_start, workers, join)
    try:
        others = tuple(read_graft_config(str(path)) for path in more_configs)
        return run_search(loaded, source, plan, space, request, str(out), MergeOptions(quiet=True), evaluation,
                          make_judge, worker_command=worker_command, others=others)
    finally:
        forget_process_state()


def main(argv: list[str]) -> None:
    """python -m tests.helpers.search_runs POST DONOR DONOR_FT CONFIG TASKS OUT TRIALS PER_LAYER KILL WORKERS
    [--join]: one search (or worker) as a process."""
    post, donor, donor_ft, config, tasks, out, trials, per_layer, kill, workers = argv[:10]
    join = "--join" in argv
    models = {"post": Path(post), "donor": Path(donor), "donor_ft": Path(donor_ft)}
    space = Space(SPACE.lam, None, int(per_layer))  # unmasked: the cheapest trials
    command = [sys.executable, "-m", "tests.helpers.search_runs", *argv[:8], "0", "1", "--join"]
    search(models, Path(config), Path(tasks), Path(out), trials=int(trials), space=space,
           judge=KillingJudge(models, int(kill) or None), workers=int(workers), join=join, worker_command=command)


if __name__ == "__main__":
    main(sys.argv[1:])
