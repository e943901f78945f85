"""The user cache is not a back door (``graftmerge.formats.user_cache``).

Records are named by an HMAC under a per-user secret, so nobody without the secret can
plant or forge one; a threshold found there is cross-checked against the plan (k, D) and,
after the merge, against what it masked; entries are read only as regular files of
bounded size owned by the user, never through a link, and never block; writes replace
whatever sits at a record's name without following it; a malformed entry is rewritten.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graftmerge.errors import GraftError
from graftmerge.formats import fisher_cache, user_cache
from graftmerge.formats.fisher_cache import (
    open_fisher_cache,
    orthonormal_digest,
    unchanged_file_identity,
)
from graftmerge.formats.user_cache import PassedChecks, record_name
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import copy_model, read_model
from tests.helpers.runners import error_line, run_cli

NOBODY = 65534




@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own user cache folder (in-process and in subprocesses)."""
    folder = tmp_path / "user-cache"
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def setup(tmp_path, cache, tied_models, tied_diag_cache):
    """A graft config (ρ = 0.05, diagonal Fisher), merged once: its model and its one threshold entry."""
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=0.05, fisher=tied_diag_cache))
    assert run_cli("mergekit-yaml", str(config), str(tmp_path / "first")).returncode == 0
    [entry] = entries(cache)
    return {"config": config, "first": read_model(tmp_path / "first"), "entry": entry, "post": m["post"],
            "json": json.loads(entry.read_text())}


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "thresholds").glob("*.json")) if (cache / "thresholds").is_dir() else []


def same_model(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected)


def merge(setup, out: Path, tool: str = "mergekit-yaml"):
    return run_cli(*tool.split(), str(setup["config"]), str(out))


# -- planted and stale thresholds -----------------------------------------------------------------


@pytest.mark.parametrize("planted, tool", [
    ("everything masked", "mergekit-yaml"),  # threshold 0, k positives claimed: the output would be θpost
    ("nothing masked", "graftmerge merge"),  # a threshold above every score
])
def test_a_planted_threshold_under_the_real_key_is_refused_then_recomputed(setup, tmp_path, planted, tool):
    real = setup["json"]
    forged = ({**real, "threshold": 0.0, "tie_quota": {}, "positives": real["k"]} if planted == "everything masked"
              else {**real, "threshold": 1e30, "tie_quota": {}})
    setup["entry"].write_text(json.dumps(forged))
    out = tmp_path / "second"
    line = error_line(merge(setup, out, tool))
    assert str(setup["entry"]) in line and "does not match these inputs and was removed; run again" in line, line
    assert f"where its pass masks {real['k']} (k = {real['k']} of D = {real['total']})" in line
    assert not out.exists()
    assert not setup["entry"].exists()
    assert merge(setup, tmp_path / "third", tool).returncode == 0
    assert same_model(read_model(tmp_path / "third"), setup["first"])
    assert not same_model(setup["first"], read_model(setup["post"]))


@pytest.mark.parametrize("field, change", [("k", 1), ("total", 1), ("positives", 10**9)])
def test_a_threshold_for_another_k_or_total_is_recomputed(setup, tmp_path, field, change):
    setup["entry"].write_text(json.dumps({**setup["json"], field: setup["json"][field] + change}))
    assert merge(setup, tmp_path / "second").returncode == 0
    assert same_model(read_model(tmp_path / "second"), setup["first"])
    assert json.loads(setup["entry"].read_text()) == setup["json"]  # rewritten as the pass found it


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"[" * 100000,
    b'{"threshold": "0", "tie_quota": {}, "k": 1, "total": 1, "positives": 1}',
    b'{"threshold": 0.1, "tie_quota": {"x": true}, "k": 1, "total": 1, "positives": 1}',
    b'{"threshold": 0.1, "tie_quota": {}, "k": ' + b"9" * 5000 + b', "total": 1, "positives": 1}',
    b'{"threshold": NaN, "tie_quota": {}, "k": 1, "total": 1, "positives": 1}',
], ids=["bad json", "bad utf-8", "a list", "deep", "string threshold", "bool quota", "huge int", "nan"])
def test_a_malformed_entry_is_ignored_and_rewritten(setup, tmp_path, content):
    setup["entry"].write_bytes(content)
    result = merge(setup, tmp_path / "second")
    assert result.returncode == 0, result.stderr[-3000:]
    assert same_model(read_model(tmp_path / "second"), setup["first"])
    assert json.loads(setup["entry"].read_text()) == setup["json"]


def test_a_changed_input_file_is_a_new_key(setup, tmp_path, tied_models, tied_diag_cache):
    """The key binds each input's inode and ctime: a metadata change alone means a fresh pass."""
    ft = copy_model(tied_models["donor_ft"], tmp_path / "ft")
    setup["config"].write_text(graft_yaml(tied_models["post"], tied_models["donor"], [(ft, 1)], rho=0.05,
                                          fisher=tied_diag_cache))
    assert merge(setup, tmp_path / "a").returncode == 0
    assert len(entries(setup["entry"].parent.parent)) == 2
    shard = next(ft.glob("*.safetensors"))
    info = os.stat(shard)
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))  # same bytes, same mtime: a new ctime
    assert merge(setup, tmp_path / "b").returncode == 0
    assert len(entries(setup["entry"].parent.parent)) == 3


# -- what sits at an entry's name ---------------------------------------------------------------------


@pytest.mark.timeout(120)  # a read that blocked (FIFO) or never ended (/dev/zero) fails here, not hangs
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero"])
def test_an_entry_that_is_no_regular_file_is_neither_read_nor_kept(setup, tmp_path, planted):
    setup["entry"].unlink()
    if planted == "fifo":
        os.mkfifo(setup["entry"])
    else:
        setup["entry"].symlink_to("/dev/zero")
    result = merge(setup, tmp_path / "second")
    assert result.returncode == 0, result.stderr[-3000:]
    assert stat.S_ISREG(os.lstat(setup["entry"]).st_mode)  # replaced by a fresh record, never followed
    assert same_model(read_model(tmp_path / "second"), setup["first"])


@pytest.mark.parametrize("target", ["dangling", "existing"])
def test_a_link_where_a_record_is_written_is_replaced_not_followed(setup, tmp_path, target):
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = outside / "planted.json"
    if target == "existing":
        planted.write_text("keep me")
    setup["entry"].unlink()
    setup["entry"].symlink_to(planted)
    assert merge(setup, tmp_path / "second").returncode == 0
    assert stat.S_ISREG(os.lstat(setup["entry"]).st_mode)
    assert json.loads(setup["entry"].read_text()) == setup["json"]
    assert sorted(p.name for p in outside.iterdir()) == (["planted.json"] if target == "existing" else [])
    if target == "existing":
        assert planted.read_text() == "keep me"


def test_a_linked_cache_folder_is_not_used(setup, tmp_path, cache):
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in entries(cache):
        entry.unlink()
    (cache / "thresholds").rmdir()
    (cache / "thresholds").symlink_to(outside)
    result = merge(setup, tmp_path / "second")
    assert result.returncode == 0
    assert list(outside.iterdir()) == []  # nothing written through the link
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) <= 1 and all("graftmerge cache" in w for w in warnings)
    assert same_model(read_model(tmp_path / "second"), setup["first"])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_entries_and_folders_owned_by_someone_else_are_not_trusted(setup, tmp_path, cache):
    setup["entry"].write_text(json.dumps({**setup["json"], "threshold": 0.0, "positives": setup["json"]["k"]}))
    os.chown(setup["entry"], NOBODY, NOBODY)
    assert merge(setup, tmp_path / "second").returncode == 0  # not read: recomputed
    assert same_model(read_model(tmp_path / "second"), setup["first"])
    os.chown(cache / "thresholds", NOBODY, NOBODY)
    before = sorted(p.name for p in (cache / "thresholds").iterdir())
    assert merge(setup, tmp_path / "third").returncode == 0
    assert sorted(p.name for p in (cache / "thresholds").iterdir()) == before


# -- the secret and forged records -------------------------------------------------------------------


def secret(cache: Path) -> Path:
    return cache / user_cache.SECRET_NAME


def test_the_secret_is_private_and_stable(cache):
    name = record_name("check", "subject")
    info = os.lstat(secret(cache))
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 32
    assert info.st_uid == os.geteuid()
    assert record_name("check", "subject") == name != record_name("check", "other")


def spoil_mode(cache: Path) -> None:
    secret(cache).chmod(0o644)


def spoil_link(cache: Path) -> None:
    outside = cache.parent / "outside-secret"
    outside.write_bytes(secret(cache).read_bytes())
    outside.chmod(0o600)
    secret(cache).unlink()
    secret(cache).symlink_to(outside)


def spoil_hard_link(cache: Path) -> None:
    os.link(secret(cache), cache.parent / "another-name")


def spoil_owner(cache: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    os.chown(secret(cache), NOBODY, NOBODY)


@pytest.mark.parametrize("spoil", [spoil_mode, spoil_link, spoil_hard_link, spoil_owner],
                         ids=["mode 0644", "a link", "a hard link", "another owner"])
def test_an_unsound_secret_is_replaced_and_its_records_no_longer_vouch(cache, spoil):
    passed = PassedChecks("orthonormal")
    passed.add("digest")
    assert "digest" in passed
    old = secret(cache).read_bytes()
    spoil(cache)
    assert "digest" not in passed  # a new secret: nothing recorded under the old one is found
    info = os.lstat(secret(cache))
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_nlink == 1
    assert secret(cache).read_bytes() != old
    if spoil is spoil_link:
        assert (cache.parent / "outside-secret").read_bytes() == old  # the link's target was left alone


def hostile_kfac_cache(tmp_path: Path, post: Path) -> tuple[Path, str, str, Path]:
    """A KFAC cache whose first eigenvectors are scaled by 1.5 (not orthonormal): (cache, weight, key, shard)."""
    cache = write_mixed_cache(tmp_path / "hostile", post)
    opened = open_fisher_cache(cache)
    name, key = next((n, opened.kfac_side(n, side)["eigenvectors"]) for n in opened.names("kfac")
                     for side in ("rows", "columns") if "eigenvectors" in opened.kfac_side(n, side))
    shard = cache / opened.manifest["files"][key]
    tensors = load_file(shard)
    tensors[key] = tensors[key] * 1.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return cache, name, key, shard


def test_forged_orthonormality_records_do_not_skip_the_check(tmp_path, cache, monkeypatch, tied_models):
    """The old records were sha256 of the content or of stat() and the key: anyone could write them."""
    monkeypatch.setattr(fisher_cache, "SETTLED_SECONDS", 0.0)
    hostile, name, key, shard = hostile_kfac_cache(tmp_path, tied_models["post"])
    vectors = load_file(shard)[key]
    info = os.stat(shard)
    forged = [orthonormal_digest(vectors), unchanged_file_identity(info, info, key)]
    (cache / "orthonormal").mkdir(parents=True, exist_ok=True)
    for subject in forged:  # by the old recipe, and under a secret of the forger's own
        (cache / "orthonormal" / subject).touch()
        (cache / "orthonormal" / user_cache.hmac.new(b"x" * 32, subject.encode(), "sha256").hexdigest()).touch()
    with pytest.raises(GraftError, match="not orthonormal"):
        open_fisher_cache(hostile).kfac(name)
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1)], rho=0.05, fisher=hostile, mask="kfac"))
    line = error_line(run_cli("mergekit-yaml", str(config), str(tmp_path / "out")))
    assert "not orthonormal" in line and not (tmp_path / "out").exists()


def test_a_link_where_an_orthonormality_record_goes_is_not_followed(tmp_path, cache, tied_models):
    good = write_mixed_cache(tmp_path / "good", tied_models["post"])
    opened = open_fisher_cache(good)
    name = opened.names("kfac")[0]
    record_name("orthonormal", "probe")  # the secret exists
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / "orthonormal").mkdir(exist_ok=True)
    for side in ("rows", "columns"):
        record = opened.kfac_side(name, side)
        if "eigenvectors" in record:
            key = record["eigenvectors"]
            vectors = load_file(good / opened.manifest["files"][key])[key]
            link = cache / "orthonormal" / record_name("orthonormal", orthonormal_digest(vectors))
            link.unlink(missing_ok=True)  # the writer recorded its own check
            link.symlink_to(outside / side)
    opened.kfac(name)
    assert list(outside.iterdir()) == []
    assert all(not p.is_symlink() for p in (cache / "orthonormal").iterdir())


def test_reads_are_bounded_and_never_block(cache, tmp_path):
    record_name("t", "x")
    (cache / "t").mkdir()
    (cache / "t" / "big").write_bytes(b"0" * (user_cache.MAX_RECORD_BYTES + 1))
    os.mkfifo(cache / "t" / "fifo")
    (cache / "t" / "zero").symlink_to("/dev/zero")
    os.mkdir(cache / "t" / "folder")
    for name in ("big", "fifo", "zero", "folder", "missing"):
        assert user_cache.read_record("t", name) is None, name
    user_cache.write_record("t", "fifo", b"ok")
    assert user_cache.read_record("t", "fifo") == b"ok"  # the FIFO was replaced by a regular file
