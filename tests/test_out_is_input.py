"""OUT is never an input, and recovery trusts only what this user's graftmerge wrote (issue 24, classes 1 and 6).

Class 1: every command that writes a folder refuses, in one ``error:`` line naming OUT and
the input, an OUT that is an input, lies inside one or contains one, however it is spelled
(a symbolic link, ``a/../a``, ``.`` from inside the input); the input is left as it was and
nothing is written beside it. Class 6: an old copy of OUT is restored only with a marker
that verifies, the lock file is never truncated nor followed, and a parent anyone may write
without the sticky bit is refused.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
import yaml

from graftmerge.errors import GraftError
from graftmerge.formats import output_folder
from graftmerge.formats.output_folder import (
    NEW,
    OVERWRITE,
    OutputFolder,
    check_not_inputs,
    lock_path,
)
from graftmerge.hub import pull
from graftmerge.hub.kinds import FISHER
from graftmerge.pipeline.delta_extract import extract_delta, extract_lora
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache
from tests.helpers.models import copy_model, read_model, tree_digest
from tests.helpers.runners import run_cli

# -- fixtures and helpers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tied_models, tmp_path_factory) -> dict[str, Path]:
    """Read-only sources copied from: the tied models, a diagonal cache, a delta and a LoRA adapter."""
    root = tmp_path_factory.mktemp("sources")
    found = {role: tied_models[role] for role in ("post", "donor", "donor_ft")}
    found["fisher"] = write_diagonal_cache(root / "fisher", tied_models["post"])
    found["delta"] = extract_delta(tied_models["donor"], tied_models["donor_ft"], root / "delta", progress=False)
    found["adapter"] = extract_lora(tied_models["donor"], tied_models["donor_ft"], root / "adapter", rank=2,
                                    progress=False).path
    return found


@pytest.fixture
def work(sources, tmp_path) -> dict[str, Path]:
    """Private copies of every input under ``tmp_path/in`` (a test may try to destroy them)."""
    return {role: copy_model(path, tmp_path / "in" / role) for role, path in sources.items()}


def config(work: dict[str, Path], *, fisher: bool = True, delta: bool = False, adapter: bool = False) -> str:
    """A graft config over the private copies: ρ > 0 with the Fisher cache, optionally a delta or a LoRA donor_ft."""
    text = graft_yaml(work["post"], work["donor"], [(work["donor_ft"], 0.5)], rho=0.3 if fisher else 0.0,
                      fisher=work["fisher"] if fisher else None)
    data = yaml.safe_load(text)
    if delta:
        data["models"].append({"model": str(work["delta"]), "parameters": {"role": "delta", "weight": 0.5}})
    if adapter:
        data["models"].append({"model": f"{work['donor']}+{work['adapter']}",
                               "parameters": {"role": "donor_ft", "weight": 0.5}})
    return yaml.safe_dump(data, sort_keys=False)


def snapshot(root: Path) -> dict[str, str]:
    """Every folder's and file's digest under ``root`` (the inputs) plus the names at ``root``."""
    return {"names": sorted(p.name for p in root.iterdir()),
            **{p.name: tree_digest(p) if p.is_dir() else p.read_bytes().hex() for p in root.iterdir()}}


def refused(result, *names: str) -> str:
    """The one ``error:`` line of a CLI run that exited 2; it names each of ``names``."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def refused_as_input(result, out: str, *names: str) -> str:
    """``refused``, by the OUT-is-an-input check: the line names OUT, the input, and says why."""
    return refused(result, f"output folder {out} ", "choose an output folder outside every input", *names)


def merge_cli(tmp_path: Path, text: str, out: str, *, cwd: Path | None = None, command: str = "mergekit-yaml"):
    """``command`` (mergekit-yaml or graftmerge merge) on config ``text`` into ``out``."""
    path = tmp_path / "graft.yml"
    path.write_text(text)
    args = ("graftmerge", "merge") if command == "graftmerge merge" else ("mergekit-yaml",)
    return run_cli(*args, str(path), out, cwd=cwd)


# -- class 1: OUT is no input, through the merge CLIs -----------------------------------

ROLES = {"post": "post model", "donor": "donor", "donor_ft": "donor_ft", "fisher": "Fisher cache",
         "delta": "delta", "adapter": "adapter of donor_ft"}


@pytest.mark.parametrize("command", ["mergekit-yaml", "graftmerge merge"])
@pytest.mark.parametrize("role", list(ROLES))
def test_merge_into_an_input_is_refused_and_the_input_untouched(work, tmp_path, role, command):
    before = snapshot(tmp_path / "in")
    text = config(work, delta=role == "delta", adapter=role == "adapter")
    result = merge_cli(tmp_path, text, str(work[role]), command=command)
    refused_as_input(result, str(work[role]), ROLES[role])
    assert snapshot(tmp_path / "in") == before  # the input as it was, nothing new beside it


def spellings(work: dict[str, Path], tmp_path: Path) -> dict[str, tuple[str, Path | None, str]]:
    """(OUT as given, cwd, what the message says) per way of reaching the post model or a folder around it."""
    post = work["post"]
    (tmp_path / "link").symlink_to(post)
    (tmp_path / "parent-link").symlink_to(post.parent)
    return {
        "inside": (str(post / "sub"), None, "is inside"),
        "deeper inside": (str(post / "a" / "b"), None, "is inside"),
        "containing": (str(post.parent), None, "contains"),
        "symlink": (str(tmp_path / "link"), None, "is the"),
        "inside a linked parent": (str(tmp_path / "parent-link" / "post" / "x"), None, "is inside"),
        "dot-dot": (str(post / ".." / "post"), None, "is the"),
        "cwd": (".", post, "is the"),
        "cwd child": ("out", post, "is inside"),
    }


@pytest.mark.parametrize("spelling", ["inside", "deeper inside", "containing", "symlink", "inside a linked parent",
                                      "dot-dot", "cwd", "cwd child"])
def test_merge_into_an_input_under_any_spelling_is_refused(work, tmp_path, spelling):
    out, cwd, how = spellings(work, tmp_path)[spelling]
    before = snapshot(tmp_path / "in")
    refused_as_input(merge_cli(tmp_path, config(work), out, cwd=cwd), out, how)
    assert snapshot(tmp_path / "in") == before
    assert not (work["post"] / "sub").exists() and not (work["post"] / "a").exists()


def test_merge_into_a_bind_mounted_input_is_refused(work, tmp_path):
    """The same folder under another mount point: only its (device, inode) says it is the input."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    mount = tmp_path / "mnt"
    mount.mkdir()
    if os.system(f"mount --bind {work['post'].parent} {mount} 2>/dev/null") != 0:
        pytest.skip("bind mounts are not allowed here")
    try:
        before = snapshot(tmp_path / "in")
        refused_as_input(merge_cli(tmp_path, config(work), str(mount / "post" / "x")), str(mount / "post" / "x"),
                         "is inside", "post model")
        assert snapshot(tmp_path / "in") == before
    finally:
        os.system(f"umount {mount}")


def test_python_api_refuses_an_input_as_out(work, tmp_path):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    from graftmerge.adapter import import_hook

    import_hook.install()
    before = snapshot(tmp_path / "in")
    merge_config = MergeConfiguration.model_validate(yaml.safe_load(config(work)))
    for role in ("post", "fisher"):
        with pytest.raises(GraftError, match=f"output folder {work[role]} is the"):
            run_merge(merge_config, str(work[role]), options=MergeOptions(quiet=True))
    assert snapshot(tmp_path / "in") == before


def test_a_merge_beside_its_inputs_still_works(work, tmp_path):
    """The check refuses overlaps only: OUT a sibling of every input is written as before."""
    result = merge_cli(tmp_path, config(work, delta=True, adapter=True), str(tmp_path / "in" / "merged"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_model(tmp_path / "in" / "merged")


# -- class 1: the other writers ---------------------------------------------------------


@pytest.mark.parametrize("target", ["post", "fisher", "parent"])
def test_sweep_into_an_input_is_refused(work, tmp_path, target):
    out = work[target] if target != "parent" else tmp_path / "in"
    before = snapshot(tmp_path / "in")
    (tmp_path / "graft.yml").write_text(config(work))
    result = run_cli("graftmerge", "sweep", str(tmp_path / "graft.yml"), "--lambda", "0.5,1", "--rho", "0.3",
                     "-o", str(out))
    refused_as_input(result, str(out), {"post": "is the post model", "fisher": "is the Fisher cache",
                                        "parent": "contains"}[target])
    assert snapshot(tmp_path / "in") == before


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("target", ["donor", "donor_ft", "inside donor"])
def test_delta_extract_into_an_input_is_refused(work, tmp_path, target, lora):
    out = work["donor"] / "sub" if target == "inside donor" else work[target]
    before = snapshot(tmp_path / "in")
    result = run_cli("graftmerge", "delta", "extract", str(work["donor"]), str(work["donor_ft"]), "-o", str(out),
                     *(["--rank", "2"] if lora else []))
    refused_as_input(result, str(out), "is inside the donor" if target == "inside donor" else f"is the {target} ")
    assert snapshot(tmp_path / "in") == before


@pytest.mark.parametrize("target", ["cache", "inside", "parent"])
def test_fisher_compress_into_its_source_is_refused(work, tmp_path, target):
    out = {"cache": work["fisher"], "inside": work["fisher"] / "x", "parent": tmp_path / "in"}[target]
    before = snapshot(tmp_path / "in")
    result = run_cli("graftmerge", "fisher", "compress", str(work["fisher"]), "--rank", "1", "-o", str(out))
    refused_as_input(result, str(out), "Fisher cache")
    assert snapshot(tmp_path / "in") == before


@pytest.mark.parametrize("target", ["model", "rollouts folder"])
def test_fisher_estimate_into_its_model_or_data_is_refused(work, tmp_path, target):
    data = tmp_path / "in" / "data"
    data.mkdir()
    (data / "rollouts.jsonl").write_text('{"prompt_ids": [1], "completion_ids": [2]}\n')
    out = work["post"] if target == "model" else data
    before = snapshot(tmp_path / "in")
    result = run_cli("graftmerge", "fisher", "estimate", str(work["post"]), "-o", str(out), "--overwrite",
                     "--rollouts", str(data / "rollouts.jsonl"), "--no-progress")
    refused_as_input(result, str(out), "is the model" if target == "model" else "contains the rollouts file")
    assert snapshot(tmp_path / "in") == before


@pytest.mark.parametrize("target", ["folder holding it", "the file"])
def test_import_gguf_into_its_own_file_or_folder_is_refused(tmp_path, target):
    folder = tmp_path / "in"
    folder.mkdir()
    gguf = folder / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # refused before it is parsed
    out = folder if target == "folder holding it" else gguf
    before = snapshot(folder)
    result = run_cli("graftmerge", "import-gguf", str(gguf), "-o", str(out), "--overwrite")
    refused_as_input(result, str(out), "GGUF file")
    assert snapshot(folder) == before


@pytest.mark.parametrize("target", ["repo folder", "inside the snapshot", "the hub cache"])
def test_pull_into_the_cache_folder_it_reads_is_refused(tmp_path, monkeypatch, target):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--fisher"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    out = {"repo folder": repo, "inside the snapshot": repo / "snapshots" / ("0" * 40) / "x",
           "the hub cache": cache}[target]
    before = snapshot(cache)
    result = run_cli("graftmerge", "fisher", "pull", "org/fisher", "-o", str(out), "--overwrite")
    refused_as_input(result, str(out), "models--org--fisher")
    with pytest.raises(GraftError, match="Hugging Face cache folder of org/fisher"):
        pull.pull_artifact(FISHER, "org/fisher", output=out, overwrite=True, cache_dir=cache)
    assert snapshot(cache) == before


def test_python_api_of_every_writer_refuses_an_input_as_out(work, tmp_path):
    """The functions behind the commands refuse the same way, before they write anything."""
    from graftmerge.estimate.run import EstimateSettings, estimate_fisher
    from graftmerge.formats.fisher_cache import FisherCacheWriter
    from graftmerge.formats.gguf_import import import_gguf
    from graftmerge.pipeline.fisher_compress import compress_cache

    gguf = tmp_path / "in" / "gguf" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    rollouts = tmp_path / "in" / "rollouts.jsonl"
    rollouts.write_text("")
    before = snapshot(tmp_path / "in")
    calls = {
        "extract_delta": lambda: extract_delta(work["donor"], work["donor_ft"], work["donor_ft"], progress=False),
        "extract_lora": lambda: extract_lora(work["donor"], work["donor_ft"], work["donor"] / "x", rank=2,
                                             progress=False),
        "compress_cache": lambda: compress_cache(work["fisher"], work["fisher"], 1, progress=False),
        "FisherCacheWriter": lambda: FisherCacheWriter(work["post"] / "fisher", model=work["post"]),
        "import_gguf": lambda: import_gguf(gguf, gguf.parent, overwrite=True),
        "estimate_fisher": lambda: estimate_fisher(EstimateSettings(model=work["post"], output=tmp_path / "in",
                                                                    rollouts=rollouts, overwrite=True,
                                                                    progress=False)),
    }
    for name, call in calls.items():
        with pytest.raises(GraftError, match="choose an output folder outside every input"):
            call()
        assert snapshot(tmp_path / "in") == before, name


def test_a_hub_snapshot_input_stands_for_its_whole_repo_folder(tmp_path):
    """A model resolved to a snapshot: OUT in the repo's blobs/ (where its files point) is refused too."""
    repo = tmp_path / "models--org--post"
    snapshot_folder = repo / "snapshots" / ("a" * 40)
    snapshot_folder.mkdir(parents=True)
    (repo / "blobs").mkdir()
    with pytest.raises(GraftError, match="is inside the post model"):
        check_not_inputs(repo / "blobs" / "x", [("post model", snapshot_folder)])
    check_not_inputs(tmp_path / "elsewhere", [("post model", snapshot_folder)])  # a sibling is fine


# -- class 6: recovery trusts only what this user's graftmerge wrote ------------------


def dead_pid() -> int:
    """A pid that no process has now."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def make_folder(folder: Path, content: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in content.items():
        (folder / name).write_text(text)
    return folder


def test_a_planted_old_copy_without_marker_is_never_restored(tmp_path, capsys):
    out = tmp_path / "out"
    planted = make_folder(tmp_path / f".out.old-{dead_pid()}-abc", {"model.safetensors": "planted"})
    with OutputFolder(out, replace=NEW) as folder:
        (folder.staging / "model.safetensors").write_text("mine")
    assert files(out) == {"model.safetensors": "mine"}  # a clean new OUT, not the planted folder
    assert files(planted) == {"model.safetensors": "planted"}  # left alone, not deleted
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: ") and planted.name in warning[0]


def test_a_planted_old_copy_through_the_cli_does_not_become_the_model(work, tmp_path):
    out = tmp_path / "out"
    planted = make_folder(tmp_path / f".out.old-{dead_pid()}-abc", {"model.safetensors": "planted"})
    result = merge_cli(tmp_path, config(work, fisher=False), str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_model(out) and planted.exists()


def test_a_marker_whose_listing_does_not_match_is_not_trusted(tmp_path):
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{dead_pid()}-abc"
    source = make_folder(tmp_path / "genuine", {"model.safetensors": "old"})
    output_folder.write_old_marker(source, old)
    source.rename(old)
    (old / "extra.safetensors").write_text("added after the marker")  # the listing no longer matches
    assert not output_folder.verify_old_marker(old)
    with OutputFolder(out, replace=NEW):
        pass
    assert files(out) == {} and old.exists()


def test_a_marker_for_another_folder_is_not_trusted(tmp_path):
    """The listing digest binds the marker to one folder (its inode): a copy with equal files does not match."""
    pid = dead_pid()
    genuine = make_folder(tmp_path / "genuine", {"model.safetensors": "old"})
    output_folder.write_old_marker(genuine, tmp_path / f".out.old-{pid}-abc")
    make_folder(tmp_path / f".out.old-{pid}-abc", {"model.safetensors": "old"})
    assert not output_folder.verify_old_marker(tmp_path / f".out.old-{pid}-abc")


def test_another_users_old_copy_is_never_restored(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{dead_pid()}-abc"
    source = make_folder(tmp_path / "genuine", {"model.safetensors": "theirs"})
    output_folder.write_old_marker(source, old)
    source.rename(old)
    for path in (old, old / "model.safetensors", output_folder.marker_path(old)):
        os.chown(path, 12345, 12345)
    partial = make_folder(tmp_path / f".out.partial-{dead_pid()}-abc" / "out", {"x.safetensors": "theirs"}).parent
    os.chown(partial, 12345, 12345)
    with OutputFolder(out, replace=NEW):
        pass
    assert files(out) == {} and old.exists() and partial.exists()  # neither restored nor deleted


def test_a_genuine_old_copy_is_restored_and_its_marker_removed(tmp_path):
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{dead_pid()}-abc"
    source = make_folder(tmp_path / "genuine", {"model.safetensors": "old"})
    output_folder.write_old_marker(source, old)
    source.rename(old)
    with pytest.raises(GraftError, match="already exists"):
        OutputFolder(out, replace=NEW).open()
    assert files(out) == {"model.safetensors": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_leaves_no_marker_beside_or_inside_out(tmp_path):
    out = make_folder(tmp_path / "out", {"model.safetensors": "old"})
    with OutputFolder(out, replace=OVERWRITE) as folder:
        (folder.staging / "model.safetensors").write_text("new")
    assert files(out) == {"model.safetensors": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_hard_linked_lock_is_refused_and_its_target_untouched(work, tmp_path):
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious bytes")
    os.link(victim, lock_path(out))
    with pytest.raises(GraftError, match="not a lock file of yours"):
        OutputFolder(out).open()
    refused(merge_cli(tmp_path, config(work, fisher=False), str(out)), str(lock_path(out)))
    assert victim.read_text() == "precious bytes" and not out.exists()


def test_another_users_lock_file_is_refused_and_untouched(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    out = tmp_path / "out"
    lock_path(out).write_text("theirs")
    os.chown(lock_path(out), 12345, 12345)
    with pytest.raises(GraftError, match="not a lock file of yours"):
        OutputFolder(out).open()
    assert lock_path(out).read_text() == "theirs" and not out.exists()


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious bytes")
    lock_path(out).symlink_to(victim)
    with pytest.raises(GraftError, match="cannot lock"):
        OutputFolder(out).open()
    assert victim.read_text() == "precious bytes" and not out.exists()


def test_a_fifo_lock_is_refused_without_hanging(tmp_path):
    out = tmp_path / "out"
    os.mkfifo(lock_path(out))

    def hung(*_):
        raise AssertionError("opening the lock hung on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(GraftError, match="not a lock file of yours"):
            OutputFolder(out).open()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not out.exists()


def test_a_stale_lock_is_reused_without_truncation(tmp_path):
    """A lock file left by a killed run (ours): locked again; the pid is written over its start, not truncated."""
    out = tmp_path / "out"
    lock_path(out).write_text("x" * 40)
    folder = OutputFolder(out).open()
    try:
        text = lock_path(out).read_text()
        assert text[:11].strip() == str(os.getpid()) and len(text) == 40
    finally:
        folder.close()


def test_a_world_writable_parent_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(GraftError, match="writable by every user and has no sticky bit"):
        OutputFolder(shared / "out").open()
    assert list(shared.iterdir()) == []  # no lock, no staging
    shared.chmod(0o777 | stat.S_ISVTX)  # like /tmp: fine
    with OutputFolder(shared / "out") as folder:
        (folder.staging / "a.txt").write_text("ok")
    assert files(shared / "out") == {"a.txt": "ok"}
