"""Sharing Fisher caches (and deltas) on the Hub, offline: a fake Hub behind huggingface_hub's own client.

``FakeHub`` answers the HTTP calls huggingface_hub makes (create repo/branch, tree
listing, preupload, commit, HEAD/GET of files) through an ``httpx2.MockTransport``, so
push and pull run the real client code; merges run the stock ``mergekit-yaml`` (and
``graftmerge merge``) click commands in this process (conftest.run_cli), reading a
temporary HF cache offline.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import graft_yaml, one_line_error, read_model, run_cli, spd
from safetensors import safe_open

from graftmerge.cli.hub import delta_pull, delta_push, fisher_pull, fisher_push
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.hub.references import HubReference, hub_reference_or_none, parse_hub_reference
from graftmerge.pipeline.graft_plan import resolve_fisher_folder

SHARD_BYTES = 40_000  # tiny shards: a tiny model's cache spans many files
REPO = "acme/tiny-fisher"


# -- a fake Hub -----------------------------------------------------------------------


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Repos with branches and commits in memory, served the way the Hub's HTTP API serves them.

    ``.safetensors`` files are listed and served as LFS files (sha256 oid), the rest as
    regular git blobs. ``commits`` logs every commit (paths added and deleted);
    ``downloads`` every file body served. ``fail_commit`` / ``fail_download`` inject a
    dropped connection / a server error.
    """

    def __init__(self) -> None:
        self.branches: dict[str, dict[str, str]] = {}  # repo -> branch -> commit
        self.trees: dict[str, dict[str, bytes]] = {}  # commit -> path -> content
        self.commits: list[dict] = []
        self.downloads: list[str] = []
        self.fail_commit: int | None = None  # the n-th commit from now drops the connection
        self.fail_download: set[str] = set()
        self.visibility: dict[str, str | None] = {}

    # state helpers
    def new_commit(self, repo: str, branch: str, tree: dict[str, bytes], message: str, added=(), deleted=()) -> str:
        sha = hashlib.sha1(f"{repo}{branch}{len(self.commits)}{message}".encode()).hexdigest()
        self.trees[sha] = dict(tree)
        self.branches[repo][branch] = sha
        self.commits.append({"repo": repo, "branch": branch, "message": message,
                             "added": list(added), "deleted": list(deleted)})
        return sha

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        return self.trees[self.branches[repo][revision]]

    def uploaded(self) -> list[str]:
        return [path for commit in self.commits for path in commit["added"]]

    # HTTP
    @staticmethod
    def _error(status: int, code: str | None, commit: str | None = None) -> httpx2.Response:
        headers = {"X-Error-Code": code} if code else {}
        if commit:
            headers["X-Repo-Commit"] = commit
        return httpx2.Response(status, headers=headers, json={"error": code or "error"})

    def _resolve(self, repo: str, revision: str) -> str | httpx2.Response:
        if repo not in self.branches:
            return self._error(404, "RepoNotFound")
        if revision in self.branches[repo]:
            return self.branches[repo][revision]
        if revision in self.trees:
            return revision
        return self._error(404, "RevisionNotFound")

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if request.method == "POST" and path == "/api/repos/create":
            body = json.loads(request.content)
            repo = f"{body['organization']}/{body['name']}"
            if repo in self.branches:
                return httpx2.Response(409, json={"error": "exists", "url": f"https://huggingface.co/{repo}"})
            self.branches[repo] = {}
            self.visibility[repo] = body.get("visibility")
            self.new_commit(repo, "main", {".gitattributes": b"*.safetensors filter=lfs\n"}, "initial commit")
            return httpx2.Response(200, json={"url": f"https://huggingface.co/{repo}"})
        if request.method == "POST" and path == "/api/validate-yaml":
            yaml.safe_load(json.loads(request.content)["content"].split("---")[1])  # front matter parses
            return httpx2.Response(200, json={})
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(branch|tree|preupload|commit|revision)/([^/]+)(/.*)?", path)
        if match:
            repo, action, revision = match.group(1), match.group(2), match.group(3)
            if action == "branch":
                if repo not in self.branches:
                    return self._error(404, "RepoNotFound")
                if revision in self.branches[repo]:
                    return httpx2.Response(409, json={"error": "branch exists"})
                self.branches[repo][revision] = self.branches[repo]["main"]
                return httpx2.Response(200, json={})
            commit = self._resolve(repo, revision)
            if isinstance(commit, httpx2.Response):
                return commit
            tree = self.trees[commit]
            if action == "tree":
                return httpx2.Response(200, json=[self._listing(p, data) for p, data in sorted(tree.items())])
            if action == "revision":
                return httpx2.Response(200, json={"id": repo, "sha": commit, "siblings": [{"rfilename": p} for p in tree]})
            if action == "preupload":
                files = json.loads(request.content)["files"]
                return httpx2.Response(200, json={"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files
                ]})
            return self._commit(request, repo, revision, dict(tree))
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if match and request.method in ("HEAD", "GET"):
            repo, revision, name = match.groups()
            commit = self._resolve(repo, revision)
            if isinstance(commit, httpx2.Response):
                return commit
            if name not in self.trees[commit]:
                return self._error(404, "EntryNotFound", commit)
            data = self.trees[commit][name]
            headers = {"X-Repo-Commit": commit, "ETag": f'"{_git_blob(data)}"', "Content-Length": str(len(data))}
            if name.endswith(".safetensors"):
                headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
            if request.method == "HEAD":
                return httpx2.Response(200, headers=headers)
            if name in self.fail_download:
                return self._error(500, None)
            self.downloads.append(name)
            return httpx2.Response(200, headers=headers, content=data)
        raise AssertionError(f"the fake Hub does not serve {request.method} {request.url}")

    @staticmethod
    def _listing(path: str, data: bytes) -> dict:
        entry = {"type": "file", "path": path, "size": len(data), "oid": _git_blob(data)}
        if path.endswith(".safetensors"):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _commit(self, request: httpx2.Request, repo: str, branch: str, tree: dict[str, bytes]) -> httpx2.Response:
        if self.fail_commit is not None:
            self.fail_commit -= 1
            if self.fail_commit == 0:
                self.fail_commit = None
                raise httpx2.ConnectError("connection dropped (injected)", request=request)
        lines = [json.loads(line) for line in request.content.splitlines() if line.strip()]
        added, deleted = [], []
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                tree[value["path"]] = base64.b64decode(value["content"])
                added.append(value["path"])
            elif line["key"] == "deletedFile":
                del tree[value["path"]]
                deleted.append(value["path"])
            else:
                raise AssertionError(f"unexpected commit operation {line['key']}")
        sha = self.new_commit(repo, branch, tree, lines[0]["value"]["summary"], added, deleted)
        return httpx2.Response(200, json={"commitUrl": f"https://huggingface.co/{repo}/commit/{sha}", "commitOid": sha})


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fresh FakeHub behind huggingface_hub's client, online, with a temporary HF cache."""
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

    fake = FakeHub()
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # for anything reading the environment, or a subprocess
    monkeypatch.delenv("HF_TOKEN", raising=False)
    set_client_factory(lambda: httpx2.Client(
        transport=httpx2.MockTransport(fake.handle), event_hooks={"request": [hf_request_event_hook]},
        follow_redirects=True,
    ))
    fake.cache = cache
    yield fake
    set_client_factory(default_client_factory)


def offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def invoke(command, *args: str):
    return CliRunner().invoke(command, [*args, "-q"], catch_exceptions=False)


# -- caches ---------------------------------------------------------------------------


def write_sharded_cache(path: Path, post: Path, seed: int = 0, only=None, source: str | None = None) -> Path:
    """KFAC for attention/MLP weights (input factors shared by size, so q/k/v share one), diagonal else.

    ``only``: keep just the weights it accepts, with the same values (a cache "holding only
    those weights"); small shards so the cache spans many files.
    """
    g = torch.Generator().manual_seed(seed)
    shared: dict[int, torch.Tensor] = {}
    estimator = {"kind": "both", "data": {"token_sha256": "ab" * 32, "rollouts_file_sha256": "cd" * 32},
                 "batch_size": 4, "modules": ["*"]}
    with FisherCacheWriter(path, model=post, source=source, estimator=estimator, max_shard_bytes=SHARD_BYTES,
                           counts={"sequences": 16, "tokens": 2736, "completion_tokens": 2048}, overwrite=True) as w:
        for name, info in sorted(Checkpoint(post).tensors.items()):
            if len(info.shape) == 2 and "proj" in name:
                Q = shared.setdefault(info.shape[1], spd(info.shape[1], g))
                P = spd(info.shape[0], g) / 10
                if only is None or only(name):
                    w.add_kfac(name, P=P, Q=Q)
            else:
                values = torch.rand(info.shape, generator=g) ** 2
                if only is None or only(name):
                    w.add_diagonal(name, values)
    return path


@pytest.fixture(scope="module")
def cache(tied_models, tmp_path_factory) -> Path:
    return write_sharded_cache(tmp_path_factory.mktemp("hub") / "post-mixed", tied_models["post"], source="acme/tiny-post")


def merge(tmp_path: Path, models, fisher: str, name: str, tool=("mergekit-yaml",), post=None, donor=None, ft=None) -> dict:
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


def place_in_hf_cache(cache: Path, repo_id: str, folder: Path, branch: str = "main") -> str:
    """A model folder laid out as the HF cache keeps a download: blobs, refs/<branch>, snapshots/<commit>."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (storage / "refs").mkdir()
    (storage / "refs" / branch).write_text(commit)
    return commit


def test_partial_pull_fetches_only_needed_shards_and_merges_like_a_smaller_cache(hub, cache, tied_models, tmp_path, monkeypatch):
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
    with pytest.raises(GraftError, match=r"not a local folder.*graftmerge fisher pull acme/never-pulled@v3.*\./acme/never-pulled@v3"):
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
