"""Several ``--fsdp`` runs in one torchrun launch, so a test pays the process start-up once.

Run as ``torchrun --nproc-per-node N tests/helpers/fsdp_worker.py JOBS.json``: the process
group is made here and kept across jobs (each run uses it and leaves it, also when it
refuses its input). A job is either one ``EstimateSettings`` as JSON (paths as strings), or
``{"cli": ARGS, "result": PATH}``: ``graftmerge fisher estimate ARGS`` through the click
command (``ARGS`` may be a list per rank), whose exit status and stderr this rank writes to
``PATH.rankR.json``, so that refusals are checked without a launch of their own; or
``{"copy": [[SOURCE, TARGET], ...]}``: rank 0 copies files (a checkpoint swapped for an edited
one, and back) while the others wait.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from click.testing import CliRunner

from graftmerge.cli import main as graftmerge
from graftmerge.estimate.run import EstimateSettings
from graftmerge.estimate.sharded_run import estimate_fisher_sharded

PATHS = ("model", "output", "rollouts", "prompts", "save_rollouts")


def run_command(job: dict, rank: int) -> None:
    args = job["cli"][rank] if isinstance(job["cli"][0], list) else job["cli"]
    result = CliRunner().invoke(graftmerge, ["fisher", "estimate", *args], prog_name="graftmerge")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += f"Traceback (worker): {result.exception!r}"
    Path(f"{job['result']}.rank{rank}.json").write_text(
        json.dumps({"returncode": result.exit_code, "stdout": result.stdout, "stderr": stderr}))


def main(jobs_file: str) -> None:
    dist.init_process_group("gloo")
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            if "cli" in job:
                run_command(job, dist.get_rank())
                continue
            if "copy" in job:
                if dist.get_rank() == 0:
                    for source, target in job["copy"]:
                        shutil.copy(source, target)
                dist.barrier()
                continue
            options = {k: Path(v) if k in PATHS else v for k, v in job.items()}
            estimate_fisher_sharded(EstimateSettings(fsdp=True, progress=False, **options))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
