"""Several ``--fsdp`` estimates in one torchrun launch, so a test pays the process start-up once.

Run as ``torchrun --nproc-per-node N tests/helpers/fsdp_worker.py JOBS.json``: the process
group is made here and kept across jobs (each job's ``estimate_fisher_sharded`` uses it
and leaves it); every job is one ``EstimateSettings`` as JSON (paths as strings).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from graftmerge.estimate.run import EstimateSettings
from graftmerge.estimate.sharded_run import estimate_fisher_sharded

PATHS = ("model", "output", "rollouts", "prompts", "save_rollouts")


def main(jobs_file: str) -> None:
    dist.init_process_group("gloo")
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            options = {k: Path(v) if k in PATHS else v for k, v in job.items()}
            estimate_fisher_sharded(EstimateSettings(fsdp=True, progress=False, **options))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
