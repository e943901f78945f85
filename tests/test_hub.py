"""Sharing Fisher caches (and deltas) on the Hub, offline: a fake Hub behind huggingface_hub's own client.

``FakeHub`` (tests/helpers/fake_hub.py) answers the HTTP calls huggingface_hub makes (create repo/branch, tree
listing, preupload, commit, HEAD/GET of files) through an ``httpx2.MockTransport``, so
push and pull run the real client code; merges run the stock ``mergekit-yaml`` (and
``graftmerge merge``) click commands in this process (tests.helpers.runners.run_cli), reading a
temporary HF cache offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from graftmerge.cli.hub import delta_pull, delta_push, fisher_pull, fisher_push
from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.hub.references import HubReference, hub_reference_or_none, parse_hub_reference
from graftmerge.pipeline.graft_plan import resolve_fisher_folder
from tests.helpers.configs import graft_yaml
from tests.helpers.fake_hub import REPO, offline, place_in_hf_cache
from tests.helpers.fisher_caches import write_sharded_cache
from tests.helpers.models import read_model
from tests.helpers.runners import invoke, one_line_error, run_cli

# -- a fake Hub -----------------------------------------------------------------------


# -- caches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tied_models, tmp_path_factory) -> Path:
    return write_sharded_cache(
        tmp_path_factory.mktemp("hub") / "post-mixed", tied_models["post"], source="acme/tiny-post"
    )


def merge(
    tmp_path: Path, models, fisher: str, name: str, tool=("mergekit-yaml",), post=None, donor=None, ft=None
) -> dict:
    config = tmp_path / f"{name}.yml"
    config.write_text(graft_yaml(post or models["post"], donor or models["donor"], [(ft or models["donor_ft"], 0.8)],
                                 rho=0.05, fisher=fisher))
    out = tmp_path / f"out-{name}"
    result = run_cli(*tool, str(config), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_model(out)


def assert_same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- references -----------------------------------------------------------------------


def test_references_parse_and_local_folders_win(tmp_path, monkeypatch):
    assert parse_hub_reference("org/name") == HubReference("org/name", None)
    assert parse_hub_reference("org/name@v1.2") == HubReference("org/name", "v1.2")
    assert parse_hub_reference("hf://org/name@" + "a" * 40) == HubReference("org/name", "a" * 40)
    for bad in ("name", "org/name/extra", "org/name@", "hf://x", "org/na me", "org/name@a b"):
        with pytest.raises(GraftError):
            parse_hub_reference(bad)
    monkeypatch.chdir(tmp_path)
    assert hub_reference_or_none("org/name@main") == HubReference("org/name", "main")
    (tmp_path / "org" / "name@main").mkdir(parents=True)
    assert hub_reference_or_none("org/name@main") is None  # an existing folder wins
    assert hub_reference_or_none("./org/other") is None  # written as a path: always local
    assert hub_reference_or_none("hf://org/name@main") == HubReference("org/name", "main")


# -- push -----------------------------------------------------------------------------


def test_push_commits_every_shard_then_manifest_and_card(hub, cache):
    result = invoke(fisher_push, str(cache), REPO)
    assert result.exit_code == 0, result.output
    local = {p.name: p.read_bytes() for p in cache.iterdir()}
    remote = hub.files(REPO)
    assert set(remote) == {*local, "README.md", ".gitattributes"} and hub.visibility[REPO] is None
    assert all(remote[name] == data for name, data in local.items())
    shards = sorted(n for n in local if n.endswith(".safetensors"))
    assert len(shards) >= 5
    # one commit per shard, then manifest and card together, last
    pushed = hub.commits[1:]
    assert [c["added"] for c in pushed[:-1]] == [[s] for s in shards]
    assert sorted(pushed[-1]["added"]) == ["README.md", "fisher_manifest.json"]

    card = remote["README.md"].decode()
    front = yaml.safe_load(card.split("---")[1])
    assert front == {"base_model": "acme/tiny-post", "library_name": "graftmerge",
                     "tags": ["graftmerge", "fisher", "retention-fisher", "kfac", "diagonal"]}
    body = card.split("---", 2)[2]
    for expected in ("ab" * 32, "cd" * 32, "| `sequences` | 16 |", "| `tokens` | 2736 |",
                     f"{len(shards)} safetensors shard(s)", f"fisher: {REPO}\n", f"graftmerge fisher pull {REPO}"):
        assert expected in body, expected
    assert "up to date" in invoke(fisher_push, str(cache), REPO).output  # nothing left to send
    assert len(hub.commits) == 1 + len(shards) + 1


def test_push_resumes_after_an_interruption_and_replaces_a_changed_cache(hub, cache, tied_models, tmp_path):
    hub.fail_commit = 3  # the third shard's commit drops the connection
    message = one_line_error(invoke(fisher_push, str(cache), REPO, "--revision", "v1", "--private"))
    assert "run the same command again" in message and hub.visibility[REPO] == "private"
    shards = sorted(p.name for p in cache.glob("*.safetensors"))
    assert set(hub.files(REPO, "v1")) == {".gitattributes", *shards[:2]}  # no manifest: not a cache yet
    before = len(hub.uploaded())

    assert invoke(fisher_push, str(cache), REPO, "--revision", "v1").exit_code == 0
    assert hub.uploaded()[before:] == [*shards[2:], "fisher_manifest.json", "README.md"]  # only what was missing
    assert "main" in hub.branches[REPO] and "fisher_manifest.json" not in hub.files(REPO, "main")

    # A different cache pushed onto the same branch: the old manifest goes first, stale shards last.
    other = write_sharded_cache(tmp_path / "other", tied_models["post"], seed=5,
                                only=lambda n: "layers.0." in n)
    start = len(hub.commits)
    assert invoke(fisher_push, str(other), REPO, "--revision", "v1").exit_code == 0
    assert hub.commits[start]["deleted"] == ["fisher_manifest.json"]
    expected = {p.name: p.read_bytes() for p in other.iterdir()}
    remote = hub.files(REPO, "v1")
    assert {n: remote[n] for n in remote if n not in ("README.md", ".gitattributes")} == expected


def test_push_refuses_what_is_not_a_cache(hub, tmp_path, tied_models):
    assert "no fisher_manifest.json" in one_line_error(invoke(fisher_push, str(tied_models["post"]), REPO))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "fisher_manifest.json").write_text(json.dumps({"format": "something.else", "files": {}}))
    assert "not a graftmerge Fisher manifest" in one_line_error(invoke(fisher_push, str(bad), REPO))
    assert "not a Hub reference" in one_line_error(invoke(fisher_push, str(tied_models["post"]), "noslash"))
    assert hub.commits == []


# -- pull and merge --------------------------------------------------------------------


def test_push_pull_merge_equals_the_local_cache(hub, cache, tied_models, tmp_path, monkeypatch):
    assert invoke(fisher_push, str(cache), REPO).exit_code == 0
    commit = hub.branches[REPO]["main"]
    result = invoke(fisher_pull, REPO)
    assert result.exit_code == 0, result.output
    shards = sorted(p.name for p in cache.glob("*.safetensors"))
    # each shard once; the manifest is read first (to plan) and written into the cache last
    assert sorted(hub.downloads) == sorted([*shards, "fisher_manifest.json", "fisher_manifest.json"])
    snapshot = hub.cache / "models--acme--tiny-fisher" / "snapshots" / commit
    assert str(snapshot) in result.output
    assert (hub.cache / "models--acme--tiny-fisher" / "refs" / "main").read_text() == commit
    hub.downloads.clear()
    assert invoke(fisher_pull, f"{REPO}@main").exit_code == 0 and hub.downloads == []  # all cached

    # The post/donor/ft models as Hub ids, from the same HF cache (mergekit alone cannot, offline).
    for role, repo in (("post", "acme/tiny-post"), ("donor", "acme/tiny-base"), ("donor_ft", "acme/tiny-ft")):
        place_in_hf_cache(hub.cache, repo, tied_models[role])
    offline(monkeypatch)
    local = merge(tmp_path, tied_models, str(cache), "local")
    from_hub = merge(tmp_path, tied_models, f"{REPO}@main", "hub")
    assert_same_model(local, from_hub)
    via_ids = merge(tmp_path, tied_models, f"hf://{REPO}@{commit}", "ids", tool=("graftmerge", "merge"),
                    post="acme/tiny-post", donor="acme/tiny-base", ft="acme/tiny-ft@main")
    assert_same_model(local, via_ids)


def test_partial_pull_fetches_only_needed_shards_and_merges_like_a_smaller_cache(
    hub, cache, tied_models, tmp_path, monkeypatch
):
    assert invoke(fisher_push, str(cache), REPO).exit_code == 0
    wanted = lambda name: ".layers.1.self_attn." in name or name == "model.norm.weight"  # noqa: E731
    out = tmp_path / "partial"
    result = invoke(fisher_pull, REPO, "-o", str(out), "--layers", "model.layers.1.self_attn.*",
                    "--layers", "model.norm.weight")
    assert result.exit_code == 0, result.output

    full, part = open_fisher_cache(cache), open_fisher_cache(out)
    chosen = [n for n in full.names() if wanted(n)]
    assert part.names() == chosen and len(chosen) == 7  # q/k/v/o (KFAC), q_norm, k_norm, norm
    # Every tensor the chosen weights read, and the shards holding them: nothing more was fetched.
    keys = set()
    for name in chosen:
        entry = full.entries[name]
        keys |= {entry["diagonal"]["key"]} if "diagonal" in entry else set()
        for side in ("rows", "columns") if "kfac" in entry else ():
            record = full.kfac_side(name, side)
            keys |= {record[f] for f in ("eigenvalues", "eigenvectors") if f in record}
    assert any(not k.startswith("kfac/model.layers.1.") for k in keys if k.startswith("kfac/"))  # a shared factor
    needed = {file for file in cache.glob("*.safetensors") if keys & set(safe_open(str(file), "pt").keys())}
    all_shards = list(cache.glob("*.safetensors"))
    fetched = [name for name in hub.downloads if name != "fisher_manifest.json"]
    assert sorted(fetched) == sorted(f.name for f in needed) and len(needed) < len(all_shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(f.name for f in needed)
    assert json.loads((out / "fisher_manifest.json").read_text())["pulled"]["layers"] == [
        "model.layers.1.self_attn.*", "model.norm.weight"]
    for name in chosen:
        if full.representation(name) == "kfac":
            a, b = full.kfac(name), part.kfac(name)
            assert all(torch.equal(x, y) for x, y in zip((a.U, a.S, a.V, a.D), (b.U, b.S, b.V, b.D)))
        else:
            assert torch.equal(full.diagonal(name), part.diagonal(name))

    smaller = write_sharded_cache(tmp_path / "smaller", tied_models["post"], only=wanted)
    offline(monkeypatch)
    assert_same_model(merge(tmp_path, tied_models, str(out), "partial"),
                      merge(tmp_path, tied_models, str(smaller), "smaller"))


def test_interrupted_pull_resumes_and_is_never_used_half_done(hub, cache, tmp_path, monkeypatch):
    assert invoke(fisher_push, str(cache), REPO).exit_code == 0
    shards = sorted(p.name for p in cache.glob("*.safetensors"))
    hub.fail_download = {shards[2]}
    out = tmp_path / "pulled"
    assert "run the same command again" in one_line_error(invoke(fisher_pull, REPO, "-o", str(out)))
    assert not out.exists() and not list(tmp_path.glob(".pulled.partial-*"))
    snapshot = hub.cache / "models--acme--tiny-fisher" / "snapshots" / hub.branches[REPO]["main"]
    assert (snapshot / shards[0]).is_file() and not (snapshot / "fisher_manifest.json").exists()
    with monkeypatch.context() as m:  # the half-downloaded copy is not used
        offline(m)
        with pytest.raises(GraftError, match=f"graftmerge fisher pull {REPO}"):
            resolve_fisher_folder(REPO)

    fetched_before = list(hub.downloads)
    hub.fail_download = set()
    result = invoke(fisher_pull, REPO, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert sorted(hub.downloads[len(fetched_before):]) == sorted([*shards[2:], *["fisher_manifest.json"] * 2])
    assert sorted(fetched_before) == sorted([*shards[:2], "fisher_manifest.json"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in cache.iterdir()}
    offline(monkeypatch)
    assert resolve_fisher_folder(REPO) == str(snapshot)
    assert resolve_fisher_folder(str(out)) == str(out)  # a local folder is used as it is


# -- bad input ------------------------------------------------------------------------


def test_pull_bad_inputs_say_what_to_do(hub, cache, tmp_path, monkeypatch):
    assert "no Hub repo acme/missing" in one_line_error(invoke(fisher_pull, "acme/missing"))
    assert invoke(fisher_push, str(cache), REPO).exit_code == 0
    assert "revision 'nope' does not exist in Hub repo acme/tiny-fisher" in one_line_error(
        invoke(fisher_pull, f"{REPO}@nope"))
    message = one_line_error(invoke(fisher_pull, REPO, "-o", str(tmp_path / "x"), "--layers", "model.nothing.*"))
    assert "--layers model.nothing.* matches no weight with a Fisher entry" in message
    assert "needs its own folder: add -o" in one_line_error(invoke(fisher_pull, REPO, "--layers", "model.*"))
    assert "not a Hub reference" in one_line_error(invoke(fisher_pull, "not-a-repo"))

    # Repos that are not Fisher caches: no manifest; a manifest of another format; a delta.
    hub.branches["acme/model"] = {}
    hub.new_commit("acme/model", "main", {"config.json": b"{}"}, "a model")
    assert "acme/model is not a graftmerge Fisher cache (the repo has no fisher_manifest.json)" in one_line_error(
        invoke(fisher_pull, "acme/model"))
    hub.branches["acme/odd"] = {}
    hub.new_commit("acme/odd", "main", {"fisher_manifest.json": b'{"format": "other", "files": {}}'}, "odd")
    assert "is not a graftmerge Fisher cache (fisher_manifest.json has format 'other'" in one_line_error(
        invoke(fisher_pull, "acme/odd"))
    assert "not a graftmerge delta (the repo has no delta_manifest.json)" in one_line_error(invoke(delta_pull, REPO))
    assert not (tmp_path / "x").exists()

    offline(monkeypatch)
    message = one_line_error(invoke(fisher_pull, "acme/never-pulled@v3"))
    assert "not in the local Hugging Face cache" in message and "graftmerge fisher pull acme/never-pulled@v3" in message
    with pytest.raises(
        GraftError, match=r"not a local folder.*graftmerge fisher pull acme/never-pulled@v3.*\./acme/never-pulled@v3"
    ):
        resolve_fisher_folder("acme/never-pulled@v3")


def test_offline_merge_without_the_cache_fails_before_any_work(hub, tied_models, tmp_path, monkeypatch):
    offline(monkeypatch)
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(tied_models["post"], tied_models["donor"], [(tied_models["donor_ft"], 1.0)],
                                 rho=0.05, fisher="acme/not-here@main"))
    result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert result.returncode != 0
    assert "graftmerge fisher pull acme/not-here@main" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    config.write_text(config.read_text().replace(str(tied_models["post"]), "acme/no-such-post"))
    result = run_cli("graftmerge", "merge", str(config), str(tmp_path / "out"))
    assert result.returncode == 2 and "hf download acme/no-such-post" in result.stderr


# -- deltas ---------------------------------------------------------------------------


def test_delta_push_and_pull_round_trip(hub, tied_models, tmp_path):
    from graftmerge.formats.delta_folder import open_delta
    from graftmerge.pipeline.delta_extract import extract_delta

    folder = extract_delta(tied_models["donor"], tied_models["donor_ft"], tmp_path / "delta",
                           shard_bytes=30_000, progress=False)
    assert invoke(delta_push, str(folder), "acme/tiny-delta").exit_code == 0
    card = hub.files("acme/tiny-delta")["README.md"].decode()
    assert "- delta" in card.split("---")[1] and "graftmerge delta pull acme/tiny-delta" in card
    out = tmp_path / "pulled"
    assert invoke(delta_pull, "acme/tiny-delta", "-o", str(out)).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert open_delta(out).manifest == open_delta(folder).manifest
    assert "not a graftmerge delta" in one_line_error(invoke(delta_push, str(tied_models["post"]), "acme/x"))


def test_graftmerge_merge_reads_hub_id_models_from_the_cache_for_any_method(hub, tied_models, tmp_path, monkeypatch):
    """mergekit-yaml cannot resolve org/name offline; graftmerge merge points it at the cached snapshot."""
    place_in_hf_cache(hub.cache, "acme/tiny-post", tied_models["post"])
    place_in_hf_cache(hub.cache, "acme/tiny-base", tied_models["donor"], branch="v2")
    offline(monkeypatch)
    outputs = {}
    for name, post, donor, tool in (("local", tied_models["post"], tied_models["donor"], "mergekit-yaml"),
                                    ("ids", "acme/tiny-post", "acme/tiny-base@v2", "graftmerge")):
        config = tmp_path / f"{name}.yml"
        config.write_text(f"merge_method: linear\nbase_model: {post}\nmodels:\n  - model: {post}\n"
                          f"    parameters: {{weight: 0.3}}\n  - model: {donor}\n    parameters: {{weight: 0.7}}\n"
                          "dtype: float32\n")
        tool_args = ("graftmerge", "merge") if tool == "graftmerge" else (tool,)
        result = run_cli(*tool_args, str(config), str(tmp_path / name))
        assert result.returncode == 0, result.stderr[-2000:]
        outputs[name] = read_model(tmp_path / name)
    assert_same_model(outputs["local"], outputs["ids"])
