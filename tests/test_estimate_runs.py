"""Runs of the estimator as processes: torchrun (gloo) vs one process, interrupt and resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from graftmerge.errors import GraftError
from graftmerge.estimate.checkpointing import checkpoint_folder
from graftmerge.estimate.run import EstimateSettings, estimate_fisher
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.estimation import caches_close, make_model, random_rollouts, write_jsonl
from tests.helpers.runners import run_cli


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    post = make_model(root / "post", tied=False)
    data = write_jsonl(root / "rollouts.jsonl", random_rollouts(11, seed=5))
    return post, data


def settings(post: Path, data: Path, output: Path, **options) -> EstimateSettings:
    options = {
        "kind": "both",
        "batch_size": 2,
        "accumulator_dtype": "float64",
        "progress": False,
        **options,
    }
    return EstimateSettings(model=post, output=output, rollouts=data, **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_torchrun_equals_one_process(setup, tmp_path):
    post, data = setup
    estimate_fisher(settings(post, data, tmp_path / "single"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "graftmerge", "fisher", "estimate", str(post), "-o", str(tmp_path / "torchrun"),
        "--kind", "both", "--rollouts", str(data), "--batch-size", "2",
        "--accumulator-dtype", "float64", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = open_fisher_cache(tmp_path / "torchrun").manifest
    assert manifest["estimator"]["world_size"] == 2
    assert manifest["counts"] == open_fisher_cache(tmp_path / "single").manifest["counts"]
    caches_close(tmp_path / "single", tmp_path / "torchrun", rtol=1e-5)


class Interrupt(KeyboardInterrupt):
    pass


def test_interrupted_run_resumes_to_the_uninterrupted_result(setup, tmp_path):
    post, data = setup
    estimate_fisher(settings(post, data, tmp_path / "straight"))

    def stop_after_third(index: int) -> None:
        if index == 2:
            raise Interrupt

    output = tmp_path / "fisher" / "resumed"
    with pytest.raises(Interrupt):
        estimate_fisher(
            settings(post, data, output, checkpoint_every=2), after_batch=stop_after_third
        )
    assert not output.exists()  # nothing that looks like a cache
    assert [p.name for p in output.parent.iterdir()] == [checkpoint_folder(output).name]

    with pytest.raises(GraftError, match="belongs to a run with other settings"):
        estimate_fisher(settings(post, data, output, checkpoint_every=2, batch_size=3))

    seen: list[int] = []
    estimate_fisher(settings(post, data, output, checkpoint_every=2), after_batch=seen.append)
    assert seen[0] == 2  # batches 0-1 came from the checkpoint, batch 2 was redone
    caches_close(tmp_path / "straight", output, rtol=0)  # same sums in the same order: bit for bit
    assert not checkpoint_folder(output).exists()


def test_prompts_are_sampled_from_the_model_and_saved(setup, tmp_path):
    post, _ = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [4], [5, 6]))
    )
    saved = tmp_path / "sampled.jsonl"
    first = estimate_fisher(settings(
        post, None, tmp_path / "sampled", prompts=prompts, samples_per_prompt=2, max_new_tokens=4,
        seed=7, save_rollouts=saved,
    ))  # fmt: skip
    rollouts = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(rollouts) == 6 and all(1 <= len(r["completion_ids"]) <= 4 for r in rollouts)
    assert [r["prompt_ids"] for r in rollouts[::2]] == [[1, 2, 3], [4], [5, 6]]
    manifest = open_fisher_cache(first).manifest
    assert manifest["estimator"]["data"]["sampling"]["seed"] == 7
    assert manifest["estimator"]["data"]["sampling"]["temperature"] == 1.0
    # the same rollouts given as a file give the same cache; the same seed samples the same
    estimate_fisher(settings(post, saved, tmp_path / "from-file"))
    caches_close(first, tmp_path / "from-file", rtol=0)
    estimate_fisher(settings(
        post, None, tmp_path / "again", prompts=prompts, samples_per_prompt=2, max_new_tokens=4, seed=7,
    ))  # fmt: skip
    caches_close(first, tmp_path / "again", rtol=0)


def test_top_p_keeps_only_the_nucleus():
    import torch

    from graftmerge.estimate.sampling import sample_next_tokens

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]]).repeat(200, 1)  # probs ≈ .02 .49 .07 .43
    generator = torch.Generator().manual_seed(0)
    assert set(sample_next_tokens(logits, 1.0, 0.5, generator).tolist()) == {1, 3}
    assert set(sample_next_tokens(logits, 1.0, 0.3, generator).tolist()) == {1}
    assert len(set(sample_next_tokens(logits, 1.0, 1.0, generator).tolist())) == 4


def test_killed_process_leaves_no_cache_and_a_rerun_resumes(setup, tmp_path):
    """SIGKILL after the first checkpoint: no cache appears; the rerun (the same command, in this
    process) resumes to the same numbers."""
    import signal
    import time

    post, _ = setup
    data = write_jsonl(tmp_path / "long.jsonl", random_rollouts(120, seed=9))
    estimate_fisher(settings(post, data, tmp_path / "straight"))
    output = tmp_path / "fisher" / "killed"
    command = [
        str(Path(sys.executable).parent / "graftmerge"), "fisher", "estimate", str(post), "-o", str(output),
        "--kind", "both", "--rollouts", str(data), "--batch-size", "2", "--accumulator-dtype", "float64",
        "--checkpoint-every", "1", "--no-progress",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    folder = checkpoint_folder(output)
    deadline = time.monotonic() + 120
    while not (folder.exists() and any(".tmp" not in p.name for p in folder.iterdir())):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not output.exists()
    rerun = run_cli("graftmerge", *command[1:])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert open_fisher_cache(output).manifest["counts"] == open_fisher_cache(tmp_path / "straight").manifest["counts"]
    caches_close(tmp_path / "straight", output, rtol=0)
    assert not folder.exists()
