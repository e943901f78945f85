"""A fake Hugging Face Hub and a fake HF cache, for push and pull tests that stay offline.

``FakeHub`` answers the HTTP calls huggingface_hub makes (create repo/branch, tree
listing, preupload, commit, HEAD/GET of files) through an ``httpx2.MockTransport``, so
push and pull run the real client code (the ``hub`` fixture in tests/conftest.py puts it
behind huggingface_hub's client). :func:`place_in_hf_cache` lays a folder out as the HF
cache keeps a download.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import httpx2
import yaml

REPO = "acme/tiny-fisher"


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
                return httpx2.Response(
                    200, json={"id": repo, "sha": commit, "siblings": [{"rfilename": p} for p in tree]}
                )
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


def offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


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
