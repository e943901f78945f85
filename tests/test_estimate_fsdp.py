"""``fisher estimate --fsdp``: real torchrun (gloo) processes against one process, and how runs fail.

Equality: one torchrun launch per world size (2, and 3 for uneven shards) runs every
(model, kind) job in one process group; each cache must equal the one-process estimate
on the same rollouts. Accumulators are float64 here and caches store float32, so the
two agree to float32 rounding of the stored values (relative 1e-6 on every diagonal and
reconstructed factor; docs/fisher-estimation.md states the float32-accumulator bound).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.estimate.checkpointing import checkpoint_folder
from graftmerge.estimate.run import EstimateSettings, estimate_fisher
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.estimation import TINY, caches_close, make_model, random_rollouts, write_jsonl
from tests.helpers.runners import cli, error_line, refused

MODELS = {"qwen3-tied": {"tied": True}, "qwen3-untied": {"tied": False}, "gpt2": {"architecture": "gpt2"}}
KINDS = ("diagonal", "kfac", "both")
WORKER = Path(__file__).parent / "helpers" / "fsdp_worker.py"
TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}:{path}" if path else root}


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=environment())


def launch_ranks(world: int, args_of_rank, extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """``graftmerge fisher estimate`` as ``world`` processes joined the way torchrun joins them (env://)."""
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = {**environment(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               **(extra_env or {})}
        command = [sys.executable, "-m", "graftmerge", "fisher", "estimate", *args_of_rank(rank)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
    return processes


def finished(processes: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    results = []
    for process in processes:
        out, err = process.communicate(timeout=TIMEOUT)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def one_process(model: Path, data: Path, output: Path, kind: str) -> Path:
    return estimate_fisher(EstimateSettings(model=model, output=output, rollouts=data, kind=kind, batch_size=2,
                                            accumulator_dtype="float64", progress=False))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The one-process estimates here run on one thread, as each rank does (OMP_NUM_THREADS=1) and as an xdist
    worker of the suite does: on tiny models more threads only wait on each other (in a ``-n 0`` run on a busy
    machine the fixture's estimates took about 40 times as long)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    models = {}
    for name, options in MODELS.items():
        if "architecture" in options:
            save_tiny_model(root / name, seed=1, max_shard_size="40KB", **TINY, **options)
            models[name] = root / name
        else:
            models[name] = make_model(root / name, **options)
    data = write_jsonl(root / "rollouts.jsonl", random_rollouts(9, seed=5))  # 5 batches of 2: uneven over 2 and 3
    return root, models, data


# every (model, kind) at both world sizes (3 ranks: uneven shards of 9 rollouts in batches of 2)
JOBS = {world: [(model, kind) for model in ("qwen3-tied", "qwen3-untied", "gpt2")
                for kind in ("diagonal", "kfac", "both")] for world in (3, 2)}
CASES = [(world, model, kind) for world, jobs in JOBS.items() for model, kind in jobs]


def _stop_both(processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not all(_stopped(p.pid) for p in processes):
        assert all(p.poll() is None for p in processes), [p.stderr.read() for p in processes]
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Both ranks of a real two-process run stop themselves after step 2 (checkpointed); rank 1 is killed, rank 0
    let go. The rerun of the same command (3 ranks, then 2) happens in the launches of ``caches``."""
    root = tmp_path_factory.mktemp("killed")
    model = make_model(root / "model", tied=False)
    data = write_jsonl(root / "long.jsonl", random_rollouts(10, seed=9))  # 5 batches: 3 steps on 2 ranks
    output = root / "fisher" / "killed"
    args = [str(model), "-o", str(output), "--kind", "both", "--rollouts", str(data), "--batch-size", "2",
            "--accumulator-dtype", "float64", "--checkpoint-every", "1", "--fsdp", "--no-progress",
            "--collective-timeout", "60"]
    processes = launch_ranks(2, lambda rank: args, {"GRAFTMERGE_TEST_STOP_AT": "fisher-step:2"})
    _stop_both(processes)
    processes[1].send_signal(signal.SIGKILL)
    processes[0].send_signal(signal.SIGCONT)
    survivor = finished(processes[:1])[0]
    processes[1].wait()
    left = sorted(p.name for p in checkpoint_folder(output).iterdir()) if checkpoint_folder(output).exists() else []
    return {"root": root, "model": model, "data": data, "output": output, "args": args, "survivor": survivor,
            "cache_after_kill": output.exists(), "checkpoints_after_kill": left}


def _cli_job(root: Path, name: str, args) -> dict:
    """A worker job: ``graftmerge fisher estimate ARGS`` in every rank (ARGS: one list, or a list per rank)."""
    return {"cli": args, "result": str(root / f"result-{name}")}


def _cli_results(root: Path, name: str, world: int) -> list[subprocess.CompletedProcess]:
    found = [json.loads(Path(f"{root / f'result-{name}'}.rank{rank}.json").read_text()) for rank in range(world)]
    return [subprocess.CompletedProcess(name, r["returncode"], r["stdout"], r["stderr"]) for r in found]


def _refusal_jobs(root: Path, models: dict[str, Path], data: Path, killed: dict) -> dict[int, list[dict]]:
    """Refusals that need every rank but no launch of their own, first in each launch (in this order: the
    killed run is refused by 3 ranks before 2 ranks resume it, after 2 ranks refused it with rank 1's checkpoint
    holding a sum of the wrong shape, then rank 0's being a foreign file)."""
    (root / "exists").mkdir()
    common = [str(models["qwen3-tied"]), "--rollouts", str(data), "--fsdp", "--no-progress"]
    kept, edited = checkpoint_folder(killed["output"]), _edited_checkpoints(root, killed)
    return {
        3: [_cli_job(root, "three-ranks", killed["args"])],
        2: [_cli_job(root, "bad-input", [*common, "-o", str(root / "exists")]),
            _cli_job(root, "disagree", [[*common, "-o", str(root / "disagree"), "--batch-size", str(2 + rank)]
                                        for rank in range(2)]),
            {"copy": [[str(kept / "rank00001.pt"), str(edited / "kept1.pt")],
                      [str(edited / "wrong-shape.pt"), str(kept / "rank00001.pt")]]},
            _cli_job(root, "wrong-shape", killed["args"]),
            {"copy": [[str(edited / "kept1.pt"), str(kept / "rank00001.pt")],
                      [str(kept / "rank00000.pt"), str(edited / "kept0.pt")],
                      [str(edited / "foreign.pt"), str(kept / "rank00000.pt")]]},
            _cli_job(root, "foreign", killed["args"]),
            {"copy": [[str(edited / "kept0.pt"), str(kept / "rank00000.pt")]]},
            _cli_job(root, "resumed", killed["args"])],
    }


def _edited_checkpoints(root: Path, killed: dict) -> Path:
    """Rank 1's checkpoint with a diagonal sum one row longer (sealed again), and a file that is no checkpoint."""
    import torch

    from graftmerge.estimate.checkpointing import seal

    edited = root / "edited-checkpoints"
    edited.mkdir()
    payload = torch.load(checkpoint_folder(killed["output"]) / "rank00001.pt", weights_only=True)
    key = next(k for k in sorted(payload["state"]) if k.startswith("diagonal/"))
    payload["state"][key] = torch.zeros(payload["state"][key].shape[0] + 1, *payload["state"][key].shape[1:],
                                        dtype=payload["state"][key].dtype)
    payload["seal"] = seal(payload)
    torch.save(payload, edited / "wrong-shape.pt")
    torch.save({"weights": [1, 2, 3]}, edited / "foreign.pt")
    return edited


@pytest.fixture(scope="module")
def caches(inputs, killed):
    """{(world, model, kind): (one-process cache, torchrun cache)}: one torchrun launch per world size, which
    also runs the refusals of ``_refusal_jobs`` and the rerun of the killed run."""
    root, models, data = inputs
    found = {}
    before = _refusal_jobs(root, models, data, killed)
    for world, jobs in JOBS.items():
        specs = list(before[world])
        for name, kind in jobs:
            output = root / f"fsdp{world}-{name}-{kind}"
            specs.append({"model": str(models[name]), "output": str(output), "rollouts": str(data), "kind": kind,
                          "batch_size": 2, "accumulator_dtype": "float64"})
            single = root / f"single-{name}-{kind}"
            if not single.exists():  # one single-process reference per (model, kind), for both world sizes
                one_process(models[name], data, single, kind)
            found[world, name, kind] = (single, output)
        if world == 2:  # --prompts: sampled with sharded weights, 3 prompts on rank 0 and 2 on rank 1
            specs.append({**SAMPLING, "model": str(models["qwen3-untied"]), "output": str(root / "fsdp-sampled"),
                          "prompts": str(prompts(root)), "save_rollouts": str(root / "fsdp-sampled.jsonl")})
        (root / f"jobs{world}.json").write_text(json.dumps(specs))
        done = torchrun(world, str(WORKER), str(root / f"jobs{world}.json"))
        assert done.returncode == 0, done.stderr[-4000:]
    return found


SAMPLING = {"kind": "both", "batch_size": 2, "accumulator_dtype": "float64", "samples_per_prompt": 2,
            "max_new_tokens": 5, "seed": 7, "sample_batch_size": 1}


def prompts(root: Path) -> Path:
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [4], [5, 6], [7, 8], [9])))
    return path


def test_prompts_sampled_with_sharded_weights_equal_one_process(inputs, caches):
    """Each rank samples its own prompts in step with the others: the same samples (one generator per prompt)
    and the same cache as one process."""
    root, models, _ = inputs
    settings = EstimateSettings(model=models["qwen3-untied"], output=root / "single-sampled", prompts=prompts(root),
                                save_rollouts=root / "single-sampled.jsonl", progress=False, **SAMPLING)
    estimate_fisher(settings)
    assert (root / "fsdp-sampled.jsonl").read_text() == (root / "single-sampled.jsonl").read_text()
    assert len((root / "single-sampled.jsonl").read_text().splitlines()) == 10
    caches_close(root / "single-sampled", root / "fsdp-sampled", rtol=1e-6)


@pytest.mark.parametrize(("world", "model", "kind"), CASES)
def test_sharded_cache_equals_one_process(caches, world, model, kind):
    single, sharded = caches[world, model, kind]
    a, b = open_fisher_cache(single).manifest, open_fisher_cache(sharded).manifest
    assert b["estimator"]["world_size"] == world and b["estimator"]["fsdp"]["world_size"] == world
    assert a["counts"] == b["counts"]
    assert a["entries"] == b["entries"]  # the same weights, kinds and (shared) factor keys
    assert {k: {f: v for f, v in r.items() if f != "clamped"} for k, r in a["factors"].items()} == {
        k: {f: v for f, v in r.items() if f != "clamped"} for k, r in b["factors"].items()}
    assert a["model"] == b["model"]
    files = set(b["files"].values())
    assert all(f.startswith("fisher-rank") for f in files)
    assert sorted(p.name for p in sharded.iterdir()) == sorted([*files, "fisher_manifest.json"])
    caches_close(single, sharded, rtol=1e-6)


def test_fsdp_outside_torchrun_is_one_line(inputs, tmp_path, monkeypatch):
    _, models, data = inputs
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    result = cli("fisher", "estimate", models["qwen3-tied"], "-o", tmp_path / "out", "--rollouts", data, "--fsdp")
    assert "torchrun" in refused(result)
    assert not (tmp_path / "out").exists()


def test_bad_input_seen_by_one_rank_stops_every_rank_with_the_same_line(inputs, caches):
    """OUT exists (only rank 0 opens it): every rank prints rank 0's line and exits 2, nobody waits (the launch
    goes on to its next job)."""
    root = inputs[0]
    lines = {error_line(result) for result in _cli_results(root, "bad-input", 2)}
    assert len(lines) == 1 and "already exists" in lines.pop()
    assert list((root / "exists").iterdir()) == []


def test_ranks_that_disagree_on_arguments_are_refused(inputs, caches):
    root = inputs[0]
    lines = {error_line(result) for result in _cli_results(root, "disagree", 2)}
    assert len(lines) == 1 and "ranks disagree on the arguments" in lines.pop()
    assert not (root / "disagree").exists()


def test_killed_rank_leaves_no_cache_and_the_rerun_resumes(inputs, killed, caches):
    """Rank 1 killed after step 2: rank 0 fails at its next collective with one line, no cache, both checkpoints
    kept. The same command is refused by 3 ranks (another run), by 2 while rank 1's checkpoint holds a sum of
    the wrong shape or rank 0's is a foreign file (the same line on both ranks, exit 2), and resumed by 2 to the
    one-process cache once the checkpoints are the ones the run wrote."""
    assert "lost contact with the other ranks" in error_line(killed["survivor"])
    assert not killed["cache_after_kill"]
    assert killed["checkpoints_after_kill"] == ["rank00000.pt", "rank00001.pt"]

    root, output = killed["root"], killed["output"]
    refused_three = _cli_results(inputs[0], "three-ranks", 3)
    assert {"belongs to a run with other settings" in error_line(r) for r in refused_three} == {True}

    folder = str(checkpoint_folder(output))
    for job, expected in (("wrong-shape", "this run's is"), ("foreign", "not a graftmerge estimate checkpoint")):
        lines = {error_line(result) for result in _cli_results(inputs[0], job, 2)}  # every rank: exit 2, one line
        assert len(lines) == 1, lines
        line = lines.pop()
        assert expected in line and folder in line and "--restart" in line, line

    resumed = _cli_results(inputs[0], "resumed", 2)
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-3000:] + resumed[1].stderr[-3000:]
    assert not checkpoint_folder(output).exists()
    single = one_process(killed["model"], killed["data"], root / "single", "both")
    assert open_fisher_cache(output).manifest["counts"] == open_fisher_cache(single).manifest["counts"]
    caches_close(single, output, rtol=1e-6)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


def test_an_output_folder_other_ranks_cannot_see_is_named(tmp_path):
    import torch

    from graftmerge.estimate.distributed import Ranks
    from graftmerge.estimate.sharded_run import PROBE_NAME, _probe_error

    ranks = Ranks(1, 2, torch.device("cpu"), False)
    staging = tmp_path / ".out.partial-1-x" / "out"
    staging.mkdir(parents=True)
    (staging.parent / PROBE_NAME).write_text("token")
    assert _probe_error(staging, "token", "host0", ranks) is None
    message = _probe_error(tmp_path / "elsewhere" / "out", "token", "host0", ranks)
    assert "not shared" in message and "rank 1" in message and "host0" in message


def test_a_rank_out_of_memory_says_so_and_the_others_stop(inputs, tmp_path):
    """Both ranks stop after step 1; rank 1's address space is then capped at what it has (prlimit), so its
    next large buffer fails: it prints an out-of-memory line, rank 0 a lost-contact line, no cache."""
    import resource

    _, models, _ = inputs
    data = write_jsonl(tmp_path / "long.jsonl", random_rollouts(12, seed=4))
    output = tmp_path / "oom"
    args = [str(models["qwen3-untied"]), "-o", str(output), "--kind", "both", "--rollouts", str(data),
            "--batch-size", "2", "--fsdp", "--no-progress", "--collective-timeout", "60"]
    processes = launch_ranks(2, lambda rank: args, {"GRAFTMERGE_TEST_STOP_AT": "fisher-step:1"})
    _stop_both(processes)
    size = int(next(line for line in Path(f"/proc/{processes[1].pid}/status").read_text().splitlines()
                    if line.startswith("VmSize:")).split()[1]) * 1024
    resource.prlimit(processes[1].pid, resource.RLIMIT_AS, (size, size))
    for process in processes:
        process.send_signal(signal.SIGCONT)
    survivor, starved = finished(processes)
    assert "rank 1" in error_line(starved) and "ran out of memory" in error_line(starved)
    assert "lost contact with the other ranks" in error_line(survivor)
    assert not output.exists()


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_row_shards_are_the_chunks_fsdp2_cuts(world):
    import torch

    from graftmerge.math.ownership import row_range, shard_rows

    for rows in (1, 2, 3, 7, 32, 48, 129):
        chunks = torch.arange(rows).chunk(world)
        ranges = [row_range(rows, world, rank) for rank in range(world)]
        assert [stop - start for start, stop in ranges] == [len(c) for c in chunks] + [0] * (world - len(chunks))
        assert [i for start, stop in ranges for i in range(start, stop)] == list(range(rows))
        assert all(stop - start <= shard_rows(rows, world) for start, stop in ranges)


def test_balanced_owners_are_within_four_thirds_of_the_best_split():
    import itertools
    import random

    from graftmerge.math.ownership import balanced_owners

    generator = random.Random(0)
    for _ in range(200):
        world = generator.randint(1, 3)
        sizes = [generator.choice([1, 4, 9, 16, 64]) * generator.randint(1, 5) for _ in range(generator.randint(1, 7))]
        owners = balanced_owners(sizes, world)
        worst = max(sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(world))
        best = min(max(sum(s for s, o in zip(sizes, split, strict=True) if o == r) for r in range(world))
                   for split in itertools.product(range(world), repeat=len(sizes)))
        assert worst <= best * 4 / 3 + 1e-9
