"""OUT is replaced whole or not at all, by one process at a time (``graftmerge.formats.output_folder``).

The module on its own first (publish, the second rename failing, links, foreign folders,
the lock between two real processes, leftovers of dead processes), then the stock
``mergekit-yaml`` as a real process (forked from a warm parent past its imports:
tests/helpers/warm_processes.py) stopped at named stages (``$GRAFTMERGE_TEST_STOP_AT``)
and SIGKILLed there, two merges racing for one OUT, and every other command that writes
a folder: a failed or locked-out run leaves the old OUT as it was.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.cli.hub import fisher_pull, fisher_push
from graftmerge.errors import GraftError
from graftmerge.estimate.run import EstimateSettings, estimate_fisher
from graftmerge.formats import gguf_import, output_folder
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.formats.output_folder import (
    EMPTY,
    MERGE,
    NEW,
    OVERWRITE,
    STOP_ENV,
    OutputFolder,
    lock_path,
)
from graftmerge.hub import pull
from graftmerge.pipeline import delta_extract, sweep
from tests.helpers.configs import graft_yaml
from tests.helpers.estimation import make_model, random_rollouts, write_jsonl
from tests.helpers.fake_hub import REPO
from tests.helpers.fisher_caches import write_diagonal_cache, write_sharded_cache
from tests.helpers.ggufs import tiny_llama_gguf
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import invoke, run_cli, run_process
from tests.helpers.warm_processes import WarmProcess, WarmStarter

# -- helpers ----------------------------------------------------------------------------


def write_folder(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def beside(out: Path) -> list[str]:
    """Everything in OUT's parent but OUT itself (leftovers: staging, old copies, lock files)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def genuine_old_copy(folder: Path, old: Path) -> Path:
    """``folder`` renamed to ``old`` as publish renames OUT: its marker written beside first."""
    output_folder.write_old_marker(folder, old)
    folder.rename(old)
    return old


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


HOLD_LOCK = """
import sys
from graftmerge.formats.output_folder import OutputFolder
folder = OutputFolder(sys.argv[1], replace="overwrite").open()
(folder.staging / "half-written.safetensors").write_bytes(b"x")
print("locked", flush=True)
sys.stdin.read()
"""


def hold_lock(out: Path) -> subprocess.Popen:
    """Another real process that has locked OUT and started writing; it waits for its stdin to close."""
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


def kill(process: subprocess.Popen | WarmProcess) -> None:
    process.kill()
    process.wait()


def assert_locked_out(message: str, holder: subprocess.Popen | WarmProcess, out: Path) -> None:
    assert f"another graftmerge process (pid {holder.pid}) is writing {out}" in message, message


# -- the module -------------------------------------------------------------------------


def test_publish_replaces_out_whole_and_leaves_nothing_beside_it(tmp_path):
    out = write_folder(tmp_path / "out", {"model.safetensors": "old", "extra.json": "old"})
    with OutputFolder(out, replace=OVERWRITE) as folder:
        assert folder.staging.name == "out" and folder.staging.parent.parent == tmp_path
        assert lock_path(out).exists()
        (folder.staging / "model-00001-of-00002.safetensors").write_text("new")
        (folder.scratch / "tmp").mkdir(parents=True)
        assert contents(out) == {"extra.json": "old", "model.safetensors": "old"}  # untouched until the end
    assert contents(out) == {"model-00001-of-00002.safetensors": "new"}
    assert beside(out) == []  # no staging, no old copy, no lock file


def test_an_error_in_the_block_leaves_out_as_it_was(tmp_path):
    out = write_folder(tmp_path / "out", {"model.safetensors": "old"})
    with pytest.raises(RuntimeError), OutputFolder(out, replace=OVERWRITE) as folder:
        (folder.staging / "model.safetensors").write_text("half")
        raise RuntimeError("killed")
    assert contents(out) == {"model.safetensors": "old"} and beside(out) == []


def test_a_failed_second_rename_puts_the_old_out_back(tmp_path, monkeypatch):
    out = write_folder(tmp_path / "out", {"model.safetensors": "old"})
    real_rename = os.rename

    def rename(source, target):
        if Path(target) == out and ".partial-" in str(source):
            raise OSError(28, "No space left on device")
        return real_rename(source, target)

    monkeypatch.setattr(output_folder.os, "rename", rename)
    with pytest.raises(GraftError, match="cannot move the finished output into .*it is unchanged"), \
            OutputFolder(out, replace=OVERWRITE) as folder:
        (folder.staging / "model.safetensors").write_text("new")
    assert contents(out) == {"model.safetensors": "old"} and beside(out) == []


def test_a_run_killed_between_the_renames_is_undone_by_the_next_run(tmp_path):
    """OUT missing, its old copy beside it: the next run on OUT puts it back before anything else."""
    out = tmp_path / "out"
    pid = dead_pid()
    genuine_old_copy(write_folder(out, {"model.safetensors": "old"}), tmp_path / f".out.old-{pid}-abc123_x")
    write_folder(tmp_path / f".out.partial-{pid}-abc123_x" / "out", {"model.safetensors": "new"})
    with pytest.raises(GraftError, match="already exists; choose a new folder"):
        OutputFolder(out, replace=NEW).open()  # restored first, so OUT exists again
    assert contents(out) == {"model.safetensors": "old"} and beside(out) == []


@pytest.mark.parametrize("replace", [NEW, EMPTY, OVERWRITE, MERGE])
def test_a_symlinked_out_is_refused_never_followed(tmp_path, replace):
    target = write_folder(tmp_path / "elsewhere", {"model.safetensors": "keep", "notes.py": "keep"})
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    out.symlink_to(target)
    with pytest.raises(GraftError, match="is a symbolic link") as error:
        OutputFolder(out, replace=replace).open()
    assert "\n" not in str(error.value)
    assert contents(target) == {"model.safetensors": "keep", "notes.py": "keep"}
    assert out.is_symlink() and beside(out) == []


def test_policies_say_what_is_in_the_way(tmp_path):
    model_files = {"model.safetensors": "", "config.json": "", "README.md": "", "mergekit_config.yml": "",
                   "tokenizer.model": "", "merges.txt": "", "chat_template.jinja": ""}
    merged = write_folder(tmp_path / "merged", model_files)
    with OutputFolder(merged, replace=MERGE) as folder:
        (folder.staging / "model.safetensors").write_text("new")
    assert contents(merged) == {"model.safetensors": "new"}

    for name, make in [("train.py", lambda p: p.write_text("")), ("data", lambda p: p.mkdir()),
                       (".git", lambda p: p.mkdir())]:
        foreign = write_folder(tmp_path / f"foreign-{name}", model_files)
        make(foreign / name)
        with pytest.raises(GraftError, match=f"holds '{name}', which no merge writes"):
            OutputFolder(foreign, replace=MERGE).open()
        assert len(list(foreign.iterdir())) == len(model_files) + 1

    empty = tmp_path / "empty"
    empty.mkdir()
    OutputFolder(empty, replace=EMPTY).open().close()
    with pytest.raises(GraftError, match="already exists and is not an empty folder"):
        OutputFolder(merged, replace=EMPTY).open()
    with pytest.raises(GraftError, match="already exists; pass --overwrite"):
        OutputFolder(empty, replace=NEW, hint="pass --overwrite to replace it").open()
    (tmp_path / "file").write_text("")
    with pytest.raises(GraftError, match="exists and is not a folder"):
        OutputFolder(tmp_path / "file", replace=OVERWRITE).open()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_second_process_is_locked_out_until_the_first_is_gone(tmp_path):
    out = write_folder(tmp_path / "out", {"model.safetensors": "old"})
    holder = hold_lock(out)
    try:
        began = time.perf_counter()
        with pytest.raises(GraftError) as error:
            OutputFolder(out, replace=OVERWRITE).open()
        assert time.perf_counter() - began < 1  # fails fast, does not wait
        assert_locked_out(str(error.value), holder, out)
        assert [p.name for p in tmp_path.glob(f".out.partial-{holder.pid}-*")]  # its staging is kept
    finally:
        kill(holder)  # SIGKILL: it leaves its staging folder and its lock file
    assert lock_path(out).exists() and list(tmp_path.glob(f".out.partial-{holder.pid}-*"))
    with OutputFolder(out, replace=OVERWRITE) as folder:  # the kernel released its lock
        assert not list(tmp_path.glob(f".out.partial-{holder.pid}-*"))  # a dead process's staging goes
        (folder.staging / "model.safetensors").write_text("new")
    assert contents(out) == {"model.safetensors": "new"} and beside(out) == []


def test_leftovers_are_removed_only_when_their_process_is_gone(tmp_path):
    out = write_folder(tmp_path / "out", {"model.safetensors": "current"})
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead = dead_pid()
        kept = [f".out.partial-{live.pid}-abc", f".out.old-{live.pid}-abc", ".out.partial-notes",
                f".other.partial-{dead}-abc", f".out.partial-{dead}-a.b"]
        removed = [f".out.partial-{dead}-abc", f".out.old-{dead}-def"]  # OUT exists: the old copy is stale
        for name in kept + removed:
            if name.startswith(".out.old-"):  # as graftmerge makes them: with their marker
                genuine_old_copy(write_folder(tmp_path / "tmp", {"x.safetensors": name}), tmp_path / name)
            else:
                write_folder(tmp_path / name, {"x.safetensors": name})
        with OutputFolder(out, replace=OVERWRITE):
            assert sorted(n for n in kept + removed if (tmp_path / n).exists()) == sorted(kept)
        assert contents(out) == {}  # nothing written: OUT is now empty, as the block said
        assert beside(out) == sorted(kept + [f".out.old-{live.pid}-abc.marker"])
    finally:
        kill(live)


def test_the_lock_file_is_never_followed(tmp_path):
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock_path(out).symlink_to(victim)
    with pytest.raises(GraftError, match="cannot lock"):
        OutputFolder(out).open()
    assert victim.read_text() == "precious" and not out.exists()


# -- mergekit-yaml killed at every stage ------------------------------------------------

OLD_ARGS: tuple[str, ...] = ()  # mergekit's default shard size: one model.safetensors
NEW_ARGS = ("--out-shard-size", "20K")  # many model-0000i-of-0000n.safetensors and an index


def old_config(models) -> str:
    return graft_yaml(models["post"], models["donor"], [(models["donor_ft"], 1.0)], lam=0.5)


def new_config(models, fisher) -> str:
    return graft_yaml(models["post"], models["donor"], [(models["donor_ft"], 1.0)], rho=0.3, fisher=fisher)


def merge(config_text: str, out: Path, *args: str) -> Path:
    """The stock mergekit-yaml (in this process) into ``out``; its config goes two levels up."""
    config = out.parent.parent / f"{out.parent.name}-{out.name}.yml"
    config.write_text(config_text)
    result = run_cli("mergekit-yaml", str(config), str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def references(tied_models, tied_diag_cache, tmp_path_factory) -> dict[str, Path]:
    """The old and the new model, each merged once into a folder named ``out`` (the card names it)."""
    root = tmp_path_factory.mktemp("references")
    old = merge(old_config(tied_models), write_folder(root / "old", {}) / "out", *OLD_ARGS)
    new = merge(new_config(tied_models, tied_diag_cache), write_folder(root / "new", {}) / "out", *NEW_ARGS)
    assert {p.name for p in old.iterdir()} != {p.name for p in new.iterdir()}  # two shard layouts
    return {"old": old, "new": new}


def tensor_digest(folder: Path) -> dict[str, bytes]:
    return {name: tensor.numpy().tobytes() for name, tensor in read_model(folder).items()}


def assert_same_model(got: Path, expected: Path) -> None:
    """The same files, the same tensors bit for bit, and the same shard files byte for byte.

    (Tokenizer files are compared by name only: transformers serialises one flag differently
    in a fresh process than in this long-lived one.)
    """
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in expected.iterdir())
    assert tensor_digest(got) == tensor_digest(expected)
    for shard in expected.glob("*.safetensors"):
        assert (got / shard.name).read_bytes() == shard.read_bytes(), shard.name


def assert_unchanged(got: Path, expected: Path) -> None:
    """Every file byte for byte as it was (OUT untouched)."""
    assert_same_model(got, expected)
    assert tree_digest(got) == tree_digest(expected)


def start_merge(warm: WarmStarter, config: Path, out: Path, stop_at: str, log: Path, *args: str) -> WarmProcess:
    """The stock mergekit-yaml as a real process (forked warm, past its imports) that stops itself
    (SIGSTOP) at ``stop_at``."""
    env = {**os.environ, STOP_ENV: stop_at, "GRAFTMERGE_CACHE_DIR": str(log.parent / f"cache-{log.stem}")}
    return warm.start(config, out, *args, env=env, stdout=log, stderr=log)


def wait_stopped(process: WarmProcess, log: Path) -> None:
    assert process.wait_stopped(), log.read_text()[-3000:]


@pytest.mark.parametrize("stage, had_old", [
    ("scoring", True), ("merging:3", True), ("merging:3", False), ("staged", True),
    ("publish-aside", True), ("publish-done", True),
])
def test_mergekit_yaml_killed_at_any_stage_leaves_the_old_or_the_new_model(
        tied_models, tied_diag_cache, references, warm_mergekit_yaml, tmp_path, stage, had_old):
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    if had_old:
        shutil.copytree(references["old"], out)
    config = tmp_path / "new.yml"
    config.write_text(new_config(tied_models, tied_diag_cache))
    log = tmp_path / "merge.log"
    process = start_merge(warm_mergekit_yaml, config, out, stage, log, *NEW_ARGS)
    wait_stopped(process, log)
    staging = list(out.parent.glob(f".out.partial-{process.pid}-*"))
    assert len(staging) == 1
    if stage.startswith("merging"):
        assert list((staging[0] / "out").glob("*.safetensors"))  # shards were being written
    kill(process)

    if stage == "publish-done":
        assert_same_model(out, references["new"])
    elif stage == "publish-aside":  # the instant between the two renames: no OUT, the old one intact beside it
        assert not out.exists()
        [old_copy] = [p for p in out.parent.glob(f".out.old-{process.pid}-*") if p.is_dir()]  # and its marker
        assert_unchanged(old_copy, references["old"])
        broken = tmp_path / "broken.yml"
        broken.write_text(new_config(tied_models, tmp_path / "no-such-cache"))
        failed = run_cli("mergekit-yaml", str(broken), str(out))
        assert failed.returncode == 2 and "error: " in failed.stderr
        assert_unchanged(out, references["old"])  # even a failing next run puts it back first
    elif had_old:
        assert_unchanged(out, references["old"])
    else:
        assert not out.exists()

    merge(config.read_text(), out, *NEW_ARGS)
    assert_same_model(out, references["new"])
    assert beside(out) == []  # the killed run's staging (and lock file) are gone


def test_remerging_with_another_shard_layout_leaves_no_stale_shard(tied_models, tied_diag_cache, references,
                                                                   tmp_path):
    out = tmp_path / "models" / "out"
    merge(new_config(tied_models, tied_diag_cache), out, *NEW_ARGS)
    assert_same_model(out, references["new"])
    merge(old_config(tied_models), out, *OLD_ARGS)
    assert_same_model(out, references["old"])  # no model-0000i-of-0000n shard or index left
    merge(new_config(tied_models, tied_diag_cache), out, *NEW_ARGS)
    assert_same_model(out, references["new"])  # no model.safetensors left beside the index
    assert beside(out) == []


def test_two_merges_into_one_out_one_is_refused_the_other_wins(tied_models, tied_diag_cache, references,
                                                               warm_mergekit_yaml, tmp_path):
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    shutil.copytree(references["old"], out)
    config = tmp_path / "new.yml"
    config.write_text(new_config(tied_models, tied_diag_cache))
    log = tmp_path / "first.log"
    first = start_merge(warm_mergekit_yaml, config, out, "merging:2", log, *NEW_ARGS)
    # the second is the console script itself, start-up and all
    try:
        wait_stopped(first, log)
        second = run_process("mergekit-yaml", str(config), str(out), *NEW_ARGS)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("error: ") and "Traceback" not in second.stderr
        assert_locked_out(lines[-1], first, out)
        assert_unchanged(out, references["old"])
    finally:
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=300)
    assert first.returncode == 0, log.read_text()[-3000:]
    assert_same_model(out, references["new"])
    assert beside(out) == []


def test_merge_refuses_a_foreign_or_linked_out_in_one_line(tied_models, tied_diag_cache, tmp_path):
    config = tmp_path / "new.yml"
    config.write_text(new_config(tied_models, tied_diag_cache))
    project = write_folder(tmp_path / "project", {"train.py": "print()", "config.json": "{}"})
    before = tree_digest(project)
    result = run_cli("mergekit-yaml", str(config), str(project))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "holds 'train.py', which no merge writes" in result.stderr
    link = tmp_path / "link"
    link.symlink_to(project)
    result = run_cli("graftmerge", "merge", str(config), str(link))
    assert result.returncode == 2 and "is a symbolic link" in result.stderr
    assert tree_digest(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "new.yml", "project"]


# -- the other commands that write a folder --------------------------------------------------


def test_fisher_cache_writer_keeps_the_old_cache_until_the_new_one_is_complete(tied_models, tmp_path):
    cache = write_diagonal_cache(tmp_path / "fisher", tied_models["post"], seed=1)
    before = tree_digest(cache)
    with pytest.raises(RuntimeError), FisherCacheWriter(cache, model=tied_models["post"], overwrite=True) as w:
        w.add_diagonal("model.norm.weight", torch.ones(64))
        raise RuntimeError("killed")
    assert tree_digest(cache) == before and beside(cache) == []
    holder = hold_lock(cache)
    try:
        with pytest.raises(GraftError) as error:
            FisherCacheWriter(cache, model=tied_models["post"], overwrite=True).__enter__()
        assert_locked_out(str(error.value), holder, cache)
    finally:
        kill(holder)
    write_diagonal_cache(cache, tied_models["post"], seed=2)
    assert tree_digest(cache) != before and open_fisher_cache(cache).manifest["kind"] == "diagonal"
    assert beside(cache) == []


def test_fisher_estimate_locks_its_output_before_any_work_and_keeps_the_old_cache(tmp_path):
    post = make_model(tmp_path / "post", tied=False)
    data = write_jsonl(tmp_path / "rollouts.jsonl", random_rollouts(5, seed=3))
    output = tmp_path / "fisher" / "post-diag"

    def settings(**options) -> EstimateSettings:
        return EstimateSettings(model=post, output=output, rollouts=data, batch_size=2, progress=False, **options)

    estimate_fisher(settings())
    before = tree_digest(output)

    def interrupt(index: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        estimate_fisher(settings(overwrite=True, kind="both"), after_batch=interrupt)
    assert tree_digest(output) == before and beside(output) == []
    holder = hold_lock(output)
    try:
        batches: list[int] = []
        with pytest.raises(GraftError) as error:
            estimate_fisher(settings(overwrite=True), after_batch=batches.append)
        assert_locked_out(str(error.value), holder, output) and batches == []
    finally:
        kill(holder)
    assert tree_digest(output) == before


def test_delta_extract_never_publishes_over_an_out_that_appears_and_is_locked_out(tied_models, tmp_path,
                                                                                   monkeypatch):
    m = tied_models
    out = tmp_path / "delta"
    real_write = delta_extract._write_shards

    def someone_else_writes_out(*args, **kwargs):
        write_folder(out, {"theirs.safetensors": "theirs"})
        return real_write(*args, **kwargs)

    monkeypatch.setattr(delta_extract, "_write_shards", someone_else_writes_out)
    result = CliRunner().invoke(main, ["delta", "extract", str(m["donor"]), str(m["donor_ft"]), "-o", str(out)])
    assert result.exit_code == 2 and "already exists; choose a new folder" in result.output, result.output
    assert contents(out) == {"theirs.safetensors": "theirs"} and beside(out) == []
    monkeypatch.undo()

    shutil.rmtree(out)
    holder = hold_lock(out)
    try:
        result = CliRunner().invoke(main, ["delta", "extract", str(m["donor"]), str(m["donor_ft"]), "-o", str(out)])
        assert result.exit_code == 2
        assert_locked_out(result.output, holder, out)
    finally:
        kill(holder)
    assert not out.exists()


def test_sweep_interrupted_while_writing_leaves_the_empty_out_empty(tied_models, tied_diag_cache, tmp_path,
                                                                   monkeypatch):
    config = tmp_path / "g.yml"
    config.write_text(new_config(tied_models, tied_diag_cache))
    out = tmp_path / "sweep"
    out.mkdir()
    real_write_grid = sweep._write_grid

    def interrupted(config, source, views, staging, *args):
        real_write_grid(config, source, views, staging, *args)
        assert list(staging.rglob("*.safetensors"))
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "_write_grid", interrupted)
    result = run_cli("graftmerge", "sweep", str(config), "--lambda", "0.5,1", "--rho", "0.1", "-o", str(out))
    assert result.returncode != 0
    assert list(out.iterdir()) == [] and beside(out) == ["g.yml"]
    monkeypatch.undo()
    holder = hold_lock(out)
    try:
        result = run_cli("graftmerge", "sweep", str(config), "--lambda", "1", "--rho", "0.1", "-o", str(out))
        assert result.returncode == 2
        assert_locked_out(result.stderr, holder, out)
    finally:
        kill(holder)
    result = run_cli("graftmerge", "sweep", str(config), "--lambda", "1", "--rho", "0.1", "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in out.iterdir()] == ["lambda-1.0_rho-0.1"] and beside(out) == ["g.yml"]


def test_import_gguf_overwrite_refuses_a_link_and_keeps_the_old_folder_on_failure(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    gguf = tiny_llama_gguf(tmp_path / "models" / "tiny.gguf")  # complete, so only OUT can make the import fail
    target = write_folder(tmp_path / "elsewhere", {"config.json": "{}", "notes.txt": "mine"})
    link = tmp_path / "post"
    link.symlink_to(target)
    result = CliRunner().invoke(main, ["import-gguf", str(gguf), "-o", str(link), "--overwrite"])
    assert result.exit_code == 2 and "is a symbolic link" in result.output, result.output
    assert contents(target) == {"config.json": "{}", "notes.txt": "mine"} and link.is_symlink()

    old = write_folder(tmp_path / "old", {"config.json": "{}", "model.safetensors": "old"})

    def failing_load(header, dtype):
        raise GraftError("cannot import: the machine ran out of memory")

    monkeypatch.setattr(gguf_import, "_load_model", failing_load)
    result = CliRunner().invoke(main, ["import-gguf", str(gguf), "-o", str(old), "--overwrite"])
    assert result.exit_code == 2 and "ran out of memory" in result.output, result.output
    assert contents(old) == {"config.json": "{}", "model.safetensors": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "models", "old", "post"]


@pytest.fixture
def fake(hub):
    """The FakeHub (the ``hub`` fixture), online, behind huggingface_hub's client, with a temporary HF cache."""
    return hub


def test_pull_overwrite_keeps_the_old_folder_on_failure_and_is_locked_out(fake, tmp_path, tied_models,
                                                                          monkeypatch):
    cache = write_sharded_cache(tmp_path / "post-mixed", tied_models["post"], source="acme/tiny-post")
    assert invoke(fisher_push, str(cache), REPO).exit_code == 0
    out = write_folder(tmp_path / "pulled" / "out", {"fisher_manifest.json": "{}", "old.safetensors": "old"})
    real_fill = pull.fill_folder

    def fill_then_fail(staging, *args):
        real_fill(staging, *args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pull, "fill_folder", fill_then_fail)
    with pytest.raises(OSError):
        invoke(fisher_pull, REPO, "-o", str(out), "--overwrite")
    assert contents(out) == {"fisher_manifest.json": "{}", "old.safetensors": "old"} and beside(out) == []
    monkeypatch.setattr(pull, "fill_folder", real_fill)
    holder = hold_lock(out)
    try:
        downloads = len(fake.downloads)
        result = invoke(fisher_pull, REPO, "-o", str(out), "--overwrite")
        assert result.exit_code == 2 and len(fake.downloads) == downloads  # refused before any download
        assert_locked_out(result.output, holder, out)
    finally:
        kill(holder)
    assert invoke(fisher_pull, REPO, "-o", str(out), "--overwrite").exit_code == 0
    assert {p.name for p in out.iterdir()} == {p.name for p in cache.iterdir()} and beside(out) == []
