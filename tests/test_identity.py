"""Identity by what a thing is, not how it is spelled; consistency checked, not trusted (issue 24, class 8).

- Graft inputs are compared by real identity (the folder's device and inode; a folder whose
  weight files are all the same files as another's): a donor_ft that is the donor, the post
  model or another donor_ft under any spelling (a link, ``a/../a``, absolute against relative,
  a linked parent, hard-linked shards) is refused in one line naming both spellings and the
  folder. The base_model again as ``role: donor`` (the masked update) works under any spelling.
- In memory, an input is its tensors: the same state dict (or the same tensors) given as donor
  and donor_ft is refused; one that shares only some tensors with the donor is a fine-tune.
- A Fisher manifest's entries name the tensors the format names for their weight; an entry
  naming another weight's tensor (or a tensor named twice) is refused.
- A Hub answer whose ETag or commit would become a path outside the cache is refused before
  huggingface_hub writes anything; a fetched blob must match its hash.

Every refusal through ``mergekit-yaml``, ``graftmerge merge`` and the Python API: exit 2, one
``error:`` line, OUT absent, inputs unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge_methods import merge_state_dicts
from mergekit.options import MergeOptions

from graftmerge.adapter import import_hook
from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.hub.kinds import FISHER
from graftmerge.hub.pull import pull_artifact
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import assert_identical, read_model, tree_digest
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import mergekit_yaml_model, run_cli

Q0, Q1, O1 = (f"model.layers.{i}.self_attn.{p}_proj.weight" for i, p in ((0, "q"), (1, "q"), (1, "o")))


def lines_of(result) -> list[str]:
    """stderr's lines, progress bars left out."""
    return [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line and "?it/s" not in line]


def refused_everywhere(
    tmp_path: Path, config: str, watched: list[Path], *expected: str, cwd: Path | None = None
) -> str:
    """``config`` through mergekit-yaml, graftmerge merge and run_merge: refused cleanly, every time; the line."""
    (tmp_path / "graft.yml").write_text(config)
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "out"
    line = ""
    for tool in (("mergekit-yaml",), ("graftmerge", "merge")):
        result = run_cli(*tool, str(tmp_path / "graft.yml"), str(out), cwd=cwd)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = lines_of(result)
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr
        line = lines[0]
        assert all(text in line for text in expected), line
        assert not out.exists() and not list(tmp_path.glob(".out.*"))
    from mergekit.merge import run_merge

    import_hook.install()
    previous = os.getcwd()
    os.chdir(cwd or previous)
    try:
        with pytest.raises(GraftError) as raised:
            run_merge(
                MergeConfiguration.model_validate(yaml.safe_load(config)), str(out), options=MergeOptions(quiet=True)
            )
    finally:
        os.chdir(previous)
    assert "\n" not in str(raised.value) and all(text in str(raised.value) for text in expected), raised.value
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert [tree_digest(p) for p in watched] == before
    return line


def models_yaml(post, entries: list[tuple[str, str]], extra: str = "") -> str:
    """A graft config: ``base_model: post`` and ``entries`` (path, role), float32."""
    models = "".join(f"  - model: {path}\n    parameters: {{role: {role}}}\n" for path, role in entries)
    return f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}{extra}dtype: float32\nout_dtype: float32\n"


# -- 1. the same folder under another spelling ------------------------------------------------


def spellings(tmp_path: Path, folder: Path) -> dict[str, tuple[str, Path | None]]:
    """Other spellings of ``folder``: (the spelling, the folder to run from or None)."""
    (tmp_path / "link").symlink_to(folder)
    (tmp_path / "parent-link").symlink_to(folder.parent)
    return {
        "symlink": (str(tmp_path / "link"), None),
        "a/../a": (str(folder / ".." / folder.name), None),
        "relative": (os.path.relpath(folder, tmp_path), tmp_path),
        "linked parent": (str(tmp_path / "parent-link" / folder.name), None),
    }


@pytest.mark.parametrize("spelling", ["symlink", "a/../a", "relative", "linked parent"])
def test_donor_ft_that_is_the_donor_under_another_spelling_is_refused(tmp_path, tied_models, spelling):
    m = tied_models
    other, cwd = spellings(tmp_path, m["donor"])[spelling]
    config = models_yaml(m["post"], [(m["donor"], "donor"), (other, "donor_ft"), (m["donor_ft"], "donor_ft")])
    line = refused_everywhere(tmp_path, config, [m["post"], m["donor"], m["donor_ft"]],
                              f"model {other} (donor_ft)", f"model {m['donor']} (donor)",
                              f"same folder {os.path.realpath(m['donor'])}", cwd=cwd)
    assert "only the base_model may appear again" in line


def test_two_donor_fts_that_are_one_folder_are_refused(tmp_path, tied_models):
    m = tied_models
    (tmp_path / "ft-link").symlink_to(m["donor_ft"])
    config = models_yaml(
        m["post"], [(m["donor"], "donor"), (m["donor_ft"], "donor_ft"), (tmp_path / "ft-link", "donor_ft")]
    )
    refused_everywhere(tmp_path, config, [m["post"], m["donor"], m["donor_ft"]],
                       f"model {tmp_path / 'ft-link'} (donor_ft)", f"model {m['donor_ft']} (donor_ft)", "same folder")


def test_a_donor_ft_whose_weight_files_are_the_donors_is_refused(tmp_path, tied_models):
    """A copy made of hard links (``cp -al``) is another folder holding the very same bytes: Δ = 0."""
    m = tied_models
    copy = tmp_path / "hard-linked-donor"
    copy.mkdir()
    for file in m["donor"].iterdir():
        os.link(file, copy / file.name)
    config = models_yaml(m["post"], [(m["donor"], "donor"), (copy, "donor_ft")])
    refused_everywhere(tmp_path, config, [m["post"], m["donor"]], f"model {copy} (donor_ft)",
                       f"hold the very same files (links to one copy: {os.path.realpath(copy)} and "
                       f"{os.path.realpath(m['donor'])})")


def test_a_donor_ft_sharing_some_weight_files_with_the_donor_is_a_fine_tune(tmp_path, tied_models):
    """Hard links for the shards a fine-tune left unchanged are fine: only all-the-same is one input."""
    m = tied_models
    partial = tmp_path / "partly-linked"
    partial.mkdir()
    shards = sorted(p.name for p in m["donor_ft"].glob("*.safetensors"))
    for file in m["donor_ft"].iterdir():
        source = m["donor"] / file.name if file.name == shards[0] else file
        os.link(source, partial / file.name)
    got = mergekit_yaml_model(tmp_path, graft_yaml(m["post"], m["donor"], [(partial, 1.0)]), "partial")
    post, donor, ft = read_model(m["post"]), read_model(m["donor"]), read_model(partial)
    for name in post:
        assert torch.equal(got[name], post[name] + (ft[name] - donor[name])), name


def test_donor_ft_that_is_the_post_model_is_refused_under_any_spelling(tmp_path, tied_models):
    """Δ = θpost − θdonor re-adds the post model's own update: refused, as the same spelling is."""
    m = tied_models
    (tmp_path / "post-link").symlink_to(m["post"])
    config = models_yaml(m["post"], [(m["donor"], "donor"), (tmp_path / "post-link", "donor_ft")])
    refused_everywhere(tmp_path, config, [m["post"], m["donor"]], f"model {tmp_path / 'post-link'} (donor_ft)",
                       "(base_model)", "same folder")


def test_two_deltas_that_are_one_folder_are_refused(tmp_path, tied_models):
    m = tied_models
    delta = tmp_path / "delta"
    result = run_cli("graftmerge", "delta", "extract", str(m["donor"]), str(m["donor_ft"]), "-o", str(delta))
    assert result.returncode == 0, result.stderr[-2000:]
    config = models_yaml(m["post"], [(m["donor"], "donor"), (delta, "delta"), (delta / ".." / "delta", "delta")])
    refused_everywhere(tmp_path, config, [m["post"], m["donor"], delta], f"model {delta / '..' / 'delta'} (delta)",
                       f"model {delta} (delta)", "same folder")


@pytest.mark.parametrize("second", ["donor_ft", "delta"])
def test_one_lora_adapter_given_twice_is_refused(tmp_path, tied_models, second):
    """``BASE+ADAPTER`` is the adapter's input: the same adapter again (through a link), as another
    ``BASE+ADAPTER`` or alone as a delta, would add its update twice."""
    m = tied_models
    adapter = tmp_path / "adapter"
    made = run_cli(
        "graftmerge", "delta", "extract", str(m["donor"]), str(m["donor_ft"]), "--rank", "4", "-o", str(adapter)
    )
    assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "adapter-link").symlink_to(adapter)
    again = f"{m['donor']}+{tmp_path / 'adapter-link'}" if second == "donor_ft" else str(tmp_path / "adapter-link")
    config = models_yaml(m["post"], [(m["donor"], "donor"), (f"{m['donor']}+{adapter}", "donor_ft"), (again, second)])
    refused_everywhere(tmp_path, config, [m["post"], m["donor"], adapter], f"model {again} ({second})",
                       f"model {m['donor']}+{adapter} (donor_ft)", f"same folder {os.path.realpath(adapter)}")


@pytest.fixture(scope="module")
def sft(tied_models, tmp_path_factory) -> Path:
    """θpost fine-tuned: the update the masked-update case grafts."""
    post = Checkpoint(tied_models["post"])
    folder = tmp_path_factory.mktemp("identity-sft") / "post-sft"
    save_tiny_model(folder, seed=11, base={n: post.read(n) for n in post.tensors}, noise=0.03, tie_word_embeddings=True)
    return folder


@pytest.mark.parametrize("spelling", ["same", "symlink", "a/../a", "linked parent"])
def test_the_post_again_as_donor_masks_the_update_under_any_spelling(tmp_path, tied_models, tied_diag_cache, sft,
                                                                      spelling):
    post = tied_models["post"]
    donor = str(post) if spelling == "same" else spellings(tmp_path, post)[spelling][0]
    got = mergekit_yaml_model(tmp_path, graft_yaml(post, donor, [(sft, 0.8)], rho=0.02, fisher=tied_diag_cache), "m")
    brute = brute_force_graft(post, post, [(sft, 0.8)], tied_diag_cache, 0.02)
    assert any(mask.any() for mask in brute.masks.values())
    for name, expected in brute.expected.items():
        assert torch.equal(got[name], expected), name


# -- in memory: an input is its tensors -----------------------------------------------------


def state_dicts(tied_models) -> tuple[dict, dict, dict]:
    return read_model(tied_models["post"]), read_model(tied_models["donor"]), read_model(tied_models["donor_ft"])


@pytest.mark.parametrize("how", ["the same dict", "a copy of the dict", "the post as donor_ft"])
def test_merge_state_dicts_refuses_one_input_given_twice(tied_models, how):
    post, donor, _ = state_dicts(tied_models)
    twin = {"the same dict": donor, "a copy of the dict": dict(donor), "the post as donor_ft": post}[how]
    before = {n: t.clone() for n, t in donor.items()}
    with pytest.raises(GraftError) as raised:
        merge_state_dicts({"post": post, "donor": donor, "ft": twin}, "graft", base="post", dtype=torch.float32,
                          parameters={"role": {"donor": "donor", "ft": "donor_ft"}})
    other = "'post' (base)" if how == "the post as donor_ft" else "'donor' (donor)"
    assert "\n" not in str(raised.value)
    assert f"graft input 'ft' (donor_ft) and input {other} are the same tensors" in str(raised.value)
    assert_identical(donor, before)


def test_merge_state_dicts_takes_a_fine_tune_sharing_some_tensors_and_the_post_as_donor(tied_models):
    """A fine-tune built as ``dict(donor)`` with some weights replaced is a fine-tune; the post
    state dict itself as the donor is the masked update: both accepted, by the arithmetic."""
    post, donor, ft = state_dicts(tied_models)
    changed = dict(donor)
    changed[Q0] = ft[Q0]
    got = merge_state_dicts({"post": post, "donor": donor, "ft": changed}, "graft", base="post", dtype=torch.float32,
                            parameters={"role": {"donor": "donor", "ft": "donor_ft"}})
    for name in post:
        assert torch.equal(got[name], post[name] + (changed[name] - donor[name])), name
    got = merge_state_dicts({"post": post, "donor": post, "ft": ft}, "graft", base="post", dtype=torch.float32,
                            parameters={"role": {"donor": "donor", "ft": "donor_ft"}, "lambda": 0.5})
    for name in post:
        assert torch.equal(got[name], post[name] + 0.5 * (ft[name] - post[name])), name


# -- 2. a Fisher manifest names each weight's own tensors ---------------------------------------


def edited_cache(tmp_path: Path, post: Path, kind: str, edit) -> Path:
    """A valid cache (diagonal or mixed) whose manifest ``edit`` then changes in place."""
    path = tmp_path / f"fisher-{kind}"
    (write_diagonal_cache if kind == "diagonal" else write_mixed_cache)(path, post)
    manifest_file = path / "fisher_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    edit(manifest)
    manifest_file.write_text(json.dumps(manifest))
    return path


def _diagonal_of_another(m: dict) -> None:
    m["entries"][Q1]["diagonal"]["key"] = Q0


def _factor_of_another(m: dict) -> None:
    m["entries"][Q1]["kfac"]["rows"] = f"kfac/{O1}/rows"


def _tensor_named_twice(m: dict) -> None:
    m["factors"][f"kfac/{Q1}/rows"]["eigenvalues"] = f"kfac/{Q0}/rows/eigenvalues"


MANIFEST_CASES = {
    "diagonal entry naming another weight's tensor": ("diagonal", _diagonal_of_another,
                                                      [f"the diagonal entry of weight {Q1!r} names tensor {Q0!r}"]),
    "KFAC entry naming another weight's factor": ("mixed", _factor_of_another,
                                                  [f"factor 'kfac/{Q1}/rows' is not the rows side of weight {Q1!r}"]),
    "factor naming another factor's tensor": ("mixed", _tensor_named_twice,
                                              [f"factor 'kfac/{Q1}/rows' of weight {Q1!r} names tensor "
                                               f"'kfac/{Q0}/rows/eigenvalues'"]),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_a_manifest_entry_naming_another_weights_tensor_is_refused(tmp_path, tied_models, case):
    m = tied_models
    kind, edit, expected = MANIFEST_CASES[case]
    cache = edited_cache(tmp_path, m["post"], kind, edit)
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.1, fisher=cache)
    refused_everywhere(tmp_path, config, [m["post"], m["donor"], m["donor_ft"], cache], f"Fisher cache {cache}",
                       *expected)
    with pytest.raises(GraftError, match="names tensor|is not the rows side"):
        open_fisher_cache(cache)


def test_a_diagonal_shared_by_two_entries_is_refused(tmp_path, tied_models):
    """Two weights, one stored tensor: the second entry names the first's (and the spare is left unread)."""
    cache = edited_cache(tmp_path, tied_models["post"], "diagonal",
                         lambda m: m["entries"][O1]["diagonal"].update(key=Q1))
    with pytest.raises(GraftError) as raised:
        open_fisher_cache(cache)
    assert f"the diagonal entry of weight {O1!r} names tensor {Q1!r}" in str(raised.value)
    assert str(cache) in str(raised.value) and "\n" not in str(raised.value)


def test_caches_the_writer_makes_still_open_with_shared_factors(tmp_path, tied_models):
    """The format's own sharing (one input-side factor for every weight that reads the same input) is kept."""
    cache = open_fisher_cache(write_mixed_cache(tmp_path / "mixed", tied_models["post"]))
    sides = {cache.entries[name]["kfac"]["columns"] for name in cache.names("kfac") if name.endswith("q_proj.weight")}
    assert len(sides) == 1  # q_proj of both layers share one stored factor


# -- 3. a hostile Hub: names that would become paths ---------------------------------------------

REPO = "acme/hostile-fisher"
COMMIT = hashlib.sha1(b"the commit").hexdigest()


class HostileHub:
    """Serves one Fisher cache at ``COMMIT`` as the Hub does (HEAD and GET of ``resolve``), except
    that ``headers[name]`` (None: left out) and ``bodies[name]`` replace what a file's answer carries."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.headers: dict[str, dict[str, str]] = {}
        self.bodies: dict[str, bytes] = {}

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        prefix = f"/{REPO}/resolve/"
        assert request.url.path.startswith(prefix), request.url
        revision, name = request.url.path[len(prefix):].split("/", 1)
        assert revision in ("main", COMMIT), revision
        data = self.files[name]
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{hashlib.sha1(b"blob %d" % len(data) + bytes(1) + data).hexdigest()}"',
            "Content-Length": str(len(data)),
        }
        if name.endswith(".safetensors"):
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
        for header, value in self.headers.get(name, {}).items():  # None: the header is not sent
            headers.pop(header, None) if value is None else headers.__setitem__(header, value)
        body = self.bodies.get(name, data)
        return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else body)


@pytest.fixture
def hostile_hub(tmp_path, tied_models, monkeypatch):
    """A HostileHub serving a diagonal cache of the tiny post model, behind huggingface_hub's client;
    a temporary HF cache at ``tmp_path/deep/er/hf-cache`` (deep, so ``../`` has room to escape inside tmp_path)."""
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

    source = write_diagonal_cache(tmp_path / "source-cache", tied_models["post"])
    fake = HostileHub({p.name: p.read_bytes() for p in source.iterdir() if p.is_file()})
    cache = tmp_path / "deep" / "er" / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(sys, "argv", ["graftmerge"])
    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handle),
                                             event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True))
    fake.cache = cache
    yield fake
    set_client_factory(default_client_factory)


def everything_under(root: Path) -> set[str]:
    """Every path under ``root``, links not followed."""
    return {str(Path(folder, name).relative_to(root)) for folder, folders, files in os.walk(root)
            for name in [*folders, *files]}


def hostile_cases(tmp_path: Path) -> dict[str, tuple[dict[str, str], str]]:
    """Header overrides for the shard (what the server says) and the words the refusal must have."""
    return {
        "ETag with ../": ({"X-Linked-Etag": '"../../../../escaped"'}, "X-Linked-Etag '\"../../../../escaped\"'"),
        "ETag an absolute path": ({"X-Linked-Etag": f'"{tmp_path / "escaped-abs"}"'}, "is not a content hash"),
        "plain ETag with ../": ({"X-Linked-Etag": None, "ETag": '"../../../escaped"'}, "ETag '\"../../../escaped\"'"),
        "another commit": ({"X-Repo-Commit": "../../../escaped"}, "answered commit '../../../escaped'"),
    }


@pytest.mark.parametrize("case", ["ETag with ../", "ETag an absolute path", "plain ETag with ../", "another commit"])
@pytest.mark.parametrize("api", ["cli", "python"])
def test_a_hostile_etag_writes_nothing_outside_the_cache(tmp_path, hostile_hub, case, api):
    shard = next(name for name in hostile_hub.files if name.endswith(".safetensors"))
    headers, expected = hostile_cases(tmp_path)[case]
    hostile_hub.headers[shard] = headers
    before = everything_under(tmp_path)
    out = tmp_path / "pulled"
    if api == "cli":
        result = run_cli("graftmerge", "fisher", "pull", REPO, "-o", str(out), "-q")
        assert result.returncode == 2, result.stderr
        lines = lines_of(result)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
        assert "Traceback" not in result.stderr
    else:
        with pytest.raises(GraftError, match="hostile or broken server") as raised:
            pull_artifact(FISHER, REPO, output=out, progress=False)
        assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert not out.exists()
    new = {p for p in everything_under(tmp_path) - before if not p.startswith("deep/er/hf-cache")}
    assert new == set(), new  # nothing beside the cache: no blob, .incomplete or .lock escaped
    assert not any("escaped" in p for p in everything_under(tmp_path) - before)
    assert not list(
        (hostile_hub.cache / f"models--{REPO.replace('/', '--')}").glob(f"snapshots/{COMMIT}/*.safetensors")
    )


def test_a_blob_that_does_not_match_its_hash_is_removed(tmp_path, hostile_hub):
    """The bytes (from wherever the Hub's Location sent the client) must be what the Hub's ETag says."""
    shard = next(name for name in hostile_hub.files if name.endswith(".safetensors"))
    forged = bytearray(hostile_hub.files[shard])
    forged[-1] ^= 1
    hostile_hub.bodies[shard] = bytes(forged)
    out = tmp_path / "pulled"
    result = run_cli("graftmerge", "fisher", "pull", REPO, "-o", str(out), "-q")
    assert result.returncode == 2, result.stderr
    lines = lines_of(result)
    assert len(lines) == 1 and "does not match the Hub's hash" in lines[0], result.stderr
    assert not out.exists()
    blob = (
        hostile_hub.cache
        / f"models--{REPO.replace('/', '--')}"
        / "blobs"
        / hashlib.sha256(hostile_hub.files[shard]).hexdigest()
    )
    assert not blob.exists()


def test_an_honest_hostile_hub_pull_works(tmp_path, hostile_hub, tied_models):
    """The same server, answering honestly: the pull publishes the cache (the checks refuse only what they should)."""
    out = tmp_path / "pulled"
    result = run_cli("graftmerge", "fisher", "pull", REPO, "-o", str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert open_fisher_cache(out).names() == open_fisher_cache(tmp_path / "source-cache").names()
