"""A merge reads the bytes it validated and scored: inputs are pinned by file identity.

Every input file (shards, indexes, adapter files, the Fisher cache's manifest and shards)
is pinned when opened (device, inode, size, mtime, ctime) and checked again after the
threshold pass and after mergekit wrote the merge, before OUT is published. A shard
rewritten in place (even with its mtime put back) or replaced by rename between the
pass and the merge, or during the merge, fails the run in one line; OUT is untouched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from graftmerge.formats.checkpoint import Checkpoint, read_safetensors_layout
from graftmerge.formats.output_folder import STOP_ENV
from graftmerge.pipeline import graft, graft_kernel, sweep
from tests.helpers.configs import graft_yaml
from tests.helpers.models import copy_model, tree_digest
from tests.helpers.runners import error_line, run_cli
from tests.helpers.warm_processes import WarmProcess, WarmStarter

TENSOR = "model.layers.0.mlp.up_proj.weight"




def rewrite_in_place(shard: Path) -> None:
    """Same size, same header: one float of the first tensor changed, the mtime put back."""
    before = os.stat(shard)
    layout = read_safetensors_layout(shard)
    with open(shard, "r+b") as handle:
        handle.seek(layout.data_start)
        word = handle.read(4)
        handle.seek(layout.data_start)
        handle.write(bytes(b ^ 0x40 for b in word))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def replace_by_rename(shard: Path) -> None:
    """Another file with the same bytes renamed over the shard (a new inode)."""
    copy = shard.with_name(shard.name + ".new")
    shutil.copyfile(shard, copy)
    os.replace(copy, shard)


CHANGES = {"in place": rewrite_in_place, "by rename": replace_by_rename}


@pytest.fixture
def inputs(tmp_path, tied_models, tied_diag_cache):
    """Private copies of donor_ft and the Fisher cache (they get edited), and a config reading them."""
    m = tied_models
    ft = copy_model(m["donor_ft"], tmp_path / "ft")
    fisher = copy_model(tied_diag_cache, tmp_path / "fisher")
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(ft, 1)], rho=0.05, fisher=fisher))
    return {"ft": ft, "fisher": fisher, "config": config, "post": m["post"], "donor": m["donor"]}


def ft_shard(folder: Path) -> Path:
    return Checkpoint(folder).tensors[TENSOR].file


def fisher_shard(folder: Path) -> Path:
    return sorted(folder.glob("*.safetensors"))[0]


def start_stopped(warm: WarmStarter, config: Path, out: Path, stop_at: str, log: Path) -> WarmProcess:
    """The stock mergekit-yaml as a real process (forked warm, past its imports:
    tests/helpers/warm_processes.py), stopped (SIGSTOP, by itself) at ``stop_at``."""
    process = warm.start(config, out, env={**os.environ, STOP_ENV: stop_at}, stderr=log, stdout=Path(os.devnull))
    assert process.wait_stopped(), log.read_text()[-3000:]
    return process


@pytest.mark.parametrize("stop_at, change, which, had_out", [
    ("scoring:2", "in place", "ft", False),  # during the pass: seen by the check before the merge starts
    ("merging:1", "by rename", "fisher", False),  # between the pass and the merge
    ("merging:5", "in place", "ft", True),  # during the merge: seen before OUT (here an old one) is published
])
def test_a_file_changed_between_the_pass_and_the_merge_fails_in_one_line(inputs, warm_mergekit_yaml, tmp_path, stop_at,
                                                                          change, which, had_out):
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    if had_out:
        copy_model(inputs["post"], out)
    before = tree_digest(out) if had_out else None
    shard = ft_shard(inputs["ft"]) if which == "ft" else fisher_shard(inputs["fisher"])
    log = tmp_path / "merge.log"
    process = start_stopped(warm_mergekit_yaml, inputs["config"], out, stop_at, log)
    try:
        CHANGES[change](shard)
    finally:
        process.send_signal(signal.SIGCONT)
        process.wait(timeout=300)
    result = subprocess.CompletedProcess([], process.returncode, "", log.read_text())
    line = error_line(result)
    assert str(shard) in line and "changed while the merge read it" in line and "run again" in line, line
    assert ("replaced by another file" in line) == (change == "by rename"), line
    assert (tree_digest(out) == before) if had_out else not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == (["out"] if had_out else [])  # no staging, no lock


@pytest.mark.parametrize("tool", ["mergekit-yaml", "graftmerge merge"])
def test_in_process_a_shard_changed_after_the_pass_fails(inputs, tmp_path, monkeypatch, tool):
    """Through the in-process CLIs: the shard is rewritten right after the threshold pass."""
    original = graft.prepare

    def prepare_then_change(*args, **kwargs):
        original(*args, **kwargs)
        rewrite_in_place(ft_shard(inputs["ft"]))

    monkeypatch.setattr(graft, "prepare", prepare_then_change)
    out = tmp_path / "out"
    line = error_line(run_cli(*tool.split(), str(inputs["config"]), str(out)))
    assert "changed while the merge read it (rewritten in place (modification time put back))" in line
    assert not out.exists()


def test_python_api_run_merge_raises_when_a_shard_changes_during_the_merge(inputs, tmp_path, monkeypatch):
    from graftmerge.adapter import import_hook

    import_hook.install()
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    from graftmerge.errors import GraftError

    original, calls = graft_kernel.graft, []

    def graft_then_change(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            replace_by_rename(fisher_shard(inputs["fisher"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(graft_kernel, "graft", graft_then_change)
    import yaml

    config = MergeConfiguration.model_validate(yaml.safe_load(inputs["config"].read_text()))
    out = tmp_path / "out"
    with pytest.raises(GraftError, match="changed while the merge read it .replaced by another file.; run again"):
        run_merge(config, str(out), options=MergeOptions(quiet=True))
    assert not out.exists()


def test_sweep_checks_its_inputs_before_publishing(inputs, tmp_path, monkeypatch):
    original = sweep._write_grid

    def write_then_change(*args, **kwargs):
        original(*args, **kwargs)
        rewrite_in_place(ft_shard(inputs["ft"]))

    monkeypatch.setattr(sweep, "_write_grid", write_then_change)
    out = tmp_path / "grid"
    result = run_cli("graftmerge", "sweep", str(inputs["config"]), "--lambda", "1", "--rho", "0,0.05", "-o", str(out))
    line = error_line(result)
    assert str(ft_shard(inputs["ft"])) in line and "changed while the merge read it" in line
    assert not out.exists()
