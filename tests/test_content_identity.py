"""A Fisher cache belongs to a model by content, not by path (issue 36, class 9).

The manifest records ``model.weights_sha256`` (every tensor's sha256 by name, dtype and
shape). The same weights are accepted wherever they lie: copied elsewhere, resharded, named
by a Hub id whose snapshot holds them, or the reverse; a fine-tune of the same shapes, or a
copy edited in place (its mtime put back), is refused in one line by ``graft`` and by the
``fisher`` merge method. Old caches without the digest still open, with a warning (graft:
names and shapes; fisher/regmean: the recorded place, as before). Digests are remembered per
unchanged file in the user cache, so a second look does not hash again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats import model_content
from graftmerge.formats.checkpoint import Checkpoint
from tests.helpers.configs import graft_yaml
from tests.helpers.data_aware import config, make_models, write_both_cache
from tests.helpers.fake_hub import place_in_hf_cache
from tests.helpers.fisher_caches import write_diagonal_cache
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import error_line, run_cli


@pytest.fixture(scope="module")
def graft_setup(tied_models, tied_diag_cache, tmp_path_factory):
    """The post model, its cache, and the reference merge on the post where the cache was estimated."""
    root = tmp_path_factory.mktemp("content")
    (root / "ref.yml").write_text(graft_yaml(tied_models["post"], tied_models["donor"], [(tied_models["donor_ft"], 1)],
                                             rho=0.2, fisher=tied_diag_cache))
    done = run_cli("graftmerge", "merge", str(root / "ref.yml"), str(root / "ref"))
    assert done.returncode == 0, done.stderr[-3000:]
    return root, tied_models, tied_diag_cache, read_model(root / "ref")


def merge(tmp_path: Path, models: dict, post: str | Path, cache: Path, env: dict | None = None):
    (tmp_path / "g.yml").write_text(graft_yaml(post, models["donor"], [(models["donor_ft"], 1)], rho=0.2,
                                               fisher=cache))
    return run_cli("graftmerge", "merge", str(tmp_path / "g.yml"), str(tmp_path / "out"), env=env)


def resharded(source: Path, target: Path) -> Path:
    """The same tensors in one file under another name, without the index."""
    target.mkdir()
    for file in source.iterdir():
        if not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy(file, target / file.name)
    tensors = {name: Checkpoint(source).read(name) for name in Checkpoint(source).tensors}
    save_file(dict(reversed(tensors.items())), str(target / "model.safetensors"))
    return target


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("where", ["copy", "resharded", "hub id"])
def test_the_same_weights_anywhere_are_accepted(tmp_path, graft_setup, hf_cache, where):
    root, models, cache, reference = graft_setup
    if where == "copy":
        post = shutil.copytree(models["post"], tmp_path / "elsewhere" / "post")
    elif where == "resharded":
        post = resharded(models["post"], tmp_path / "one-file")
    else:
        place_in_hf_cache(hf_cache, "acme/post", models["post"])
        post = "acme/post"
    done = merge(tmp_path, models, post, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stderr
    merged = read_model(tmp_path / "out")
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[name], reference[name]) for name in reference)


def test_a_cache_estimated_on_a_hub_snapshot_fits_the_local_copy(tmp_path, graft_setup, hf_cache):
    root, models, _, reference = graft_setup
    place_in_hf_cache(hf_cache, "acme/post", models["post"])
    snapshot = next((hf_cache / "models--acme--post" / "snapshots").iterdir())
    cache = write_diagonal_cache(tmp_path / "hub-cache", snapshot)
    assert json.loads((cache / "fisher_manifest.json").read_text())["model"]["source"] == "acme/post"
    done = merge(tmp_path, models, models["post"], cache)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = read_model(tmp_path / "out")
    assert all(torch.equal(merged[name], reference[name]) for name in reference)  # same cache values (seed 0)


def edit_in_place(folder: Path, put_mtime_back: bool) -> None:
    """One value of one tensor changed in place (same names, shapes, dtypes), its mtime put back if asked."""
    file = sorted(folder.glob("*.safetensors"))[0]
    stat = file.stat()
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    if put_mtime_back:
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("which", ["fine-tune", "edited copy", "edited copy, mtime put back"])
def test_other_weights_of_the_same_shapes_are_refused(tmp_path, graft_setup, which, monkeypatch):
    root, models, cache, _ = graft_setup
    monkeypatch.setattr(model_content, "SETTLED_SECONDS", 0.0)  # remember digests at once: an edit must not hide
    if which == "fine-tune":
        post = models["donor_ft2"]  # another fine-tune of the donor: the post's names and shapes
    else:
        post = shutil.copytree(models["post"], tmp_path / "edited")
        (tmp_path / "first").mkdir()
        assert merge(tmp_path / "first", models, post, cache).returncode == 0  # accepted, its digests remembered
        edit_in_place(post, put_mtime_back="mtime" in which)
    before = tree_digest(cache)
    done = merge(tmp_path, models, post, cache)
    line = error_line(done)
    assert "was estimated on other weights than" in line and str(cache) in line, line
    assert not (tmp_path / "out").exists() and tree_digest(cache) == before


def test_digests_are_remembered_per_unchanged_file(tmp_path, tied_models, monkeypatch):
    monkeypatch.setattr(model_content, "SETTLED_SECONDS", 0.0)
    copy = shutil.copytree(tied_models["post"], tmp_path / "post")
    first = model_content.weights_sha256(Checkpoint(copy))

    def no_hashing(layout):
        raise AssertionError(f"{layout.file} hashed again")

    monkeypatch.setattr(model_content, "_hash_tensors", no_hashing)
    assert model_content.weights_sha256(Checkpoint(copy)) == first
    file = sorted(copy.glob("*.safetensors"))[0]
    file.write_bytes(file.read_bytes())  # same bytes, new ctime: hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        model_content.weights_sha256(Checkpoint(copy))


def manifest_edited(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    manifest = json.loads((target / "fisher_manifest.json").read_text())
    edit(manifest["model"])
    (target / "fisher_manifest.json").write_text(json.dumps(manifest))
    return target


def test_an_old_cache_without_a_digest_is_used_by_names_and_shapes_with_a_warning(tmp_path, graft_setup):
    root, models, cache, reference = graft_setup
    old = manifest_edited(cache, tmp_path / "old-cache", lambda model: model.pop("weights_sha256"))
    done = merge(tmp_path, models, models["donor_ft2"], old)  # what the old check could not tell apart
    assert done.returncode == 0, done.stderr[-3000:]
    assert "records no digest of its model's weights" in done.stderr


@pytest.mark.parametrize("value", ["abc", 7, "A" * 64])
def test_a_corrupt_digest_is_one_line(tmp_path, graft_setup, value):
    root, models, cache, _ = graft_setup
    bad = manifest_edited(cache, tmp_path / "bad-cache", lambda model: model.update(weights_sha256=value))
    assert "corrupt manifest (`model.weights_sha256`" in error_line(merge(tmp_path, models, models["post"], bad))


def test_a_cast_copy_is_checked_by_names_and_shapes_with_a_warning(tmp_path, graft_setup):
    root, models, cache, _ = graft_setup
    cast = shutil.copytree(models["post"], tmp_path / "bf16")
    for file in cast.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, str(file))
    (tmp_path / "g.yml").write_text(graft_yaml(cast, models["donor"], [(models["donor_ft"], 1)], rho=0.2,
                                               fisher=cache))
    done = run_cli("graftmerge", "merge", str(tmp_path / "g.yml"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a cast copy cannot be compared by content" in done.stderr


# -- the fisher merge method: it compared recorded paths ----------------------------------------


@pytest.fixture(scope="module")
def fisher_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fisher-content")
    models = make_models(root, "llama-untied", count=2)
    caches = [root / f"f{i}" for i in range(len(models))]
    for model, cache in zip(models, caches):
        write_both_cache(cache, model, seed=caches.index(cache), only_diagonal=True)
    return root, models, caches


def fisher_merge(tmp_path: Path, models, caches):
    (tmp_path / "f.yml").write_text(config("fisher", models, caches, [1.0, 1.0]))
    return run_cli("mergekit-yaml", str(tmp_path / "f.yml"), str(tmp_path / "out"))


def test_fisher_merge_accepts_its_models_copied_elsewhere(tmp_path, fisher_setup):
    root, models, caches = fisher_setup
    copies = [shutil.copytree(model, tmp_path / "moved" / model.name) for model in models]
    done = fisher_merge(tmp_path, copies, caches)
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "ref").mkdir()
    assert fisher_merge(tmp_path / "ref", models, caches).returncode == 0
    reference = read_model(tmp_path / "ref" / "out")
    assert all(torch.equal(t, reference[n]) for n, t in read_model(tmp_path / "out").items())


def test_fisher_merge_old_caches_fall_back_to_the_recorded_place(tmp_path, fisher_setup):
    root, models, caches = fisher_setup
    old = [manifest_edited(cache, tmp_path / f"old{i}", lambda model: model.pop("weights_sha256"))
           for i, cache in enumerate(caches)]
    copies = [shutil.copytree(model, tmp_path / "moved" / model.name) for model in models]
    done = fisher_merge(tmp_path, copies, old)
    assert "was made for the model in" in error_line(done)
    assert "records no digest" in done.stderr
    assert fisher_merge(tmp_path / "moved", models, old).returncode == 0


def test_a_bigger_model_hashes_per_tensor_the_same_after_a_reshard(tmp_path):
    save_tiny_model(tmp_path / "a", seed=2, max_shard_size="20KB")
    first = model_content.weights_sha256(Checkpoint(tmp_path / "a"))
    assert len(Checkpoint(tmp_path / "a").layouts) > 1
    assert model_content.weights_sha256(Checkpoint(resharded(tmp_path / "a", tmp_path / "b"))) == first


def test_the_run_fingerprint_sees_weights_config_and_code_not_the_path(tmp_path, tied_models):
    """What estimate checkpoints are keyed by (both the one-process and the --fsdp path)."""
    first = model_content.model_fingerprint(tied_models["post"])
    copy = shutil.copytree(tied_models["post"], tmp_path / "copy")
    assert model_content.model_fingerprint(copy) == first
    (copy / "modeling_custom.py").write_text("# remote code\n")
    assert model_content.model_fingerprint(copy) != first
    (copy / "modeling_custom.py").unlink()
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert model_content.model_fingerprint(copy) != first
