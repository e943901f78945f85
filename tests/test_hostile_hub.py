"""Artifacts from strangers: nothing pulled can run code, escape its folder, or follow a planted link.

Through the real CLI (click's runner on ``graftmerge.cli.main``, and real ``graftmerge``
processes), against the fake Hub of tests/helpers/fake_hub.py behind huggingface_hub's own client. Every
refusal is one ``error: ...`` line with exit status 2, and the test folder's tree is
compared before and after: nothing appears outside the intended folders, nothing
half-written in ``-o``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.errors import GraftError
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.hub.kinds import FISHER
from graftmerge.hub.models import cached_model_folder
from graftmerge.hub.pull import resolve_artifact
from graftmerge.hub.references import HubReference, hub_reference_or_none, parse_hub_reference
from graftmerge.hub.untrusted import without_remote_code
from tests.helpers.estimation import make_model, random_rollouts, write_jsonl
from tests.helpers.fake_hub import REPO, offline, place_in_hf_cache
from tests.helpers.fisher_caches import write_sharded_cache
from tests.helpers.models import tree
from tests.helpers.runners import BIN, REMOTE_CODE_PROMPT, cli, refused

pytestmark = pytest.mark.usefixtures("plain_argv")  # pytest's own flags must not reach report_errors' -v


@pytest.fixture
def fake(hub):
    """The FakeHub (the ``hub`` fixture), online, behind huggingface_hub's client, with a temporary HF cache."""
    return hub


def pushed_cache(fake, tmp_path: Path, tied_models, repo: str = REPO) -> Path:
    """A sharded Fisher cache pushed to ``repo`` on the fake Hub; its local folder."""
    cache = write_sharded_cache(tmp_path / "local-cache", tied_models["post"], source="acme/tiny-post")
    assert cli("fisher", "push", cache, repo).exit_code == 0
    return cache


def hub_repo(fake, repo: str, files: dict[str, bytes]) -> str:
    """A repo on the fake Hub holding exactly ``files`` (a stranger's upload); its commit."""
    fake.branches[repo] = {}
    return fake.new_commit(repo, "main", files, "a stranger's upload")


def snapshot_of(fake, repo: str) -> Path:
    return fake.cache / ("models--" + repo.replace("/", "--")) / "snapshots" / fake.branches[repo]["main"]


# -- 2. references and file names ---------------------------------------------------------

GOOD_REVISIONS = ["main", "v1.2", "refs/pr/1", "a" * 40, "feature/x-y_z+1", "release-2024.10"]
BAD_REVISIONS = [
    "..", "../../../escaped", "a/../b", "refs/../../x", "/abs", "a//b", "main/", "a\\b", "a\x00b",
    "a\nb", "a\x7fb", ".hidden", "refs/.x", "mäin", "a b", "x" * 256,
]
BAD_REPO_IDS = [
    "acme", "acme/x/y", "../acme/x", "acme/..", "acme/x.git", "acme/-x", "acme/x-", "ácme/x", "acme/x\n",
    "acme/x\x00", "acme/a--b", "acme/a..b", "acme/" + "x" * 97, "acme/x\\y",
]


@pytest.mark.parametrize("revision", GOOD_REVISIONS)
def test_valid_revisions_parse(revision):
    assert parse_hub_reference(f"acme/x@{revision}") == HubReference("acme/x", revision)
    assert parse_hub_reference(f"hf://acme/x@{revision}").revision == revision


@pytest.mark.parametrize("revision", BAD_REVISIONS)
def test_revisions_that_could_escape_a_folder_are_refused_everywhere(revision):
    for text in (f"acme/x@{revision}", f"hf://acme/x@{revision}"):
        with pytest.raises(GraftError) as error:
            parse_hub_reference(text)
        message = str(error.value)
        assert "\n" not in message and repr(text) in message
    with pytest.raises(GraftError):
        HubReference("acme/x", revision)
    with pytest.raises(GraftError):  # never taken as a local path either
        hub_reference_or_none(f"acme/x@{revision}")


@pytest.mark.parametrize("repo_id", BAD_REPO_IDS)
def test_bad_repo_ids_are_refused(repo_id):
    with pytest.raises(GraftError) as error:
        parse_hub_reference(repo_id)
    assert "\n" not in str(error.value)
    with pytest.raises(GraftError):
        HubReference(repo_id)


@pytest.mark.parametrize("command", [("fisher", "pull"), ("delta", "pull")])
@pytest.mark.parametrize("revision", ["../../../escaped", "..", "a/../../escaped", "/tmp/x", "a//b", "a\\b"])
def test_pull_with_a_climbing_revision_writes_nothing(fake, tmp_path, command, revision):
    before = tree(tmp_path)
    message = refused(cli(*command, f"acme/tiny-fisher@{revision}", "-o", tmp_path / "out"))
    assert repr(f"acme/tiny-fisher@{revision}") in message
    assert tree(tmp_path) == before and fake.downloads == []


def test_pull_with_a_nul_in_the_reference_is_one_line(fake, tmp_path):
    before = tree(tmp_path)
    for text in ("acme/tiny-fisher@ma\x00in", "acme/tiny\x00fisher", "hf://acme/x\x00@main"):
        message = refused(cli("fisher", "pull", text, "-o", tmp_path / "out"))
        assert "\\x00" in message
    assert tree(tmp_path) == before


def test_push_to_a_climbing_revision_commits_nothing(fake, tmp_path, tied_models):
    cache = write_sharded_cache(tmp_path / "c", tied_models["post"])
    for revision in ("../escaped", "a//b", "x\x01y"):
        assert "not a valid revision" in refused(cli("fisher", "push", cache, REPO, "--revision", revision,))
    assert "not a Hub reference" in refused(cli("fisher", "push", cache, "acme/../x",))
    assert fake.commits == []


def test_a_model_revision_in_a_merge_config_cannot_climb(fake, monkeypatch):
    offline(monkeypatch)
    with pytest.raises(GraftError, match="not a valid revision"):
        cached_model_folder("acme/tiny-post", "../../../etc")


BAD_FILE_NAMES = [
    "shard\x00.safetensors", "../escape.safetensors", "a/../../escape.safetensors", "/etc/passwd",
    "/abs/shard.safetensors", "sub\\shard.safetensors", "a//shard.safetensors", "./shard.safetensors",
    "evil.py", "custom_generate/generate.py", "C:shard.safetensors", "s\nhard.safetensors", 5, None,
]


@pytest.mark.parametrize("name", BAD_FILE_NAMES)
def test_a_fisher_manifest_naming_a_bad_file_is_refused_before_use(fake, tmp_path, name):
    manifest = {"format": "graftmerge.fisher", "format_version": 1, "files": {"diag/x": name}, "entries": {}}
    hub_repo(fake, "acme/hostile", {"fisher_manifest.json": json.dumps(manifest).encode()})
    before = tree(tmp_path, skip=fake.cache)
    message = refused(cli("fisher", "pull", "acme/hostile", "-o", tmp_path / "out"))
    assert "names a file graftmerge will not pull" in message or "does not name its files" in message
    assert tree(tmp_path, skip=fake.cache) == before
    assert fake.downloads == ["fisher_manifest.json"]  # read to plan; nothing named in it was fetched


@pytest.mark.parametrize(
    "name", ["../../escape.safetensors", "x\x00.safetensors", "modeling_evil.py", "/abs.safetensors"]
)
def test_a_delta_index_naming_a_bad_file_is_refused_before_use(fake, tmp_path, name):
    manifest = {"format": "graftmerge.delta", "format_version": 1}
    index = {"metadata": {}, "weight_map": {"w": name}}
    hub_repo(fake, "acme/hostile-delta", {"delta_manifest.json": json.dumps(manifest).encode(),
                                        "model.safetensors.index.json": json.dumps(index).encode()})
    before = tree(tmp_path, skip=fake.cache)
    assert "names a file graftmerge will not pull" in refused(
        cli("delta", "pull", "acme/hostile-delta", "-o", tmp_path / "out"))
    assert tree(tmp_path, skip=fake.cache) == before
    assert set(fake.downloads) <= {"delta_manifest.json", "model.safetensors.index.json"}


def test_a_corrupt_manifest_pulled_by_layers_is_one_line(fake, tmp_path):
    for manifest in ({"format": "graftmerge.fisher", "files": {}},  # no entries
                     {"format": "graftmerge.fisher", "files": {}, "entries": {"w": {"kfac": 3}}},
                     {"format": "graftmerge.fisher", "files": {}, "entries": [1, 2]}):
        hub_repo(fake, "acme/odd-layers", {"fisher_manifest.json": json.dumps(manifest).encode()})
        refused(cli("fisher", "pull", "acme/odd-layers", "-o", tmp_path / "out", "--layers", "w*"))
        assert not (tmp_path / "out").exists()


# -- 1a. configs never name code ------------------------------------------------------------

HOSTILE_CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "auto_map": {"AutoConfig": "stranger/repo--evil.Config", "AutoModelForCausalLM": "evil.Model"},
    "custom_pipelines": {"text-generation": {"impl": "evil.Pipeline", "pt": ["AutoModelForCausalLM"]}},
    "text_config": {"hidden_size": 8, "auto_map": {"AutoConfig": "evil.Inner"}},
    "hidden_size": 64,
}


def test_remote_code_fields_are_stripped_at_any_depth():
    raw = json.dumps(HOSTILE_CONFIG).encode()
    cleaned, removed = without_remote_code(raw, "config.json")
    assert sorted(removed) == ["auto_map", "custom_pipelines", "text_config.auto_map"]
    assert json.loads(cleaned) == {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                   "text_config": {"hidden_size": 8}, "hidden_size": 64}
    plain = json.dumps({"model_type": "qwen3"}).encode()
    assert without_remote_code(plain, "config.json") == (plain, [])  # untouched, byte for byte
    for bad in (b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000):
        with pytest.raises(GraftError):
            without_remote_code(bad, "config.json")


@pytest.fixture
def delta(tied_models, tmp_path) -> Path:
    from graftmerge.pipeline.delta_extract import extract_delta

    return extract_delta(tied_models["donor"], tied_models["donor_ft"], tmp_path / "delta",
                         shard_bytes=60_000, progress=False)


def test_delta_pull_drops_auto_map_from_config_in_output_and_snapshot(fake, delta, tmp_path):
    assert cli("delta", "push", delta, "acme/d").exit_code == 0
    files = dict(fake.files("acme/d"))
    files["config.json"] = json.dumps(HOSTILE_CONFIG).encode()  # a stranger re-uploads the config
    fake.new_commit("acme/d", "main", files, "add remote code")
    out = tmp_path / "pulled"
    result = cli("delta", "pull", "acme/d", "-o", out,)
    assert result.exit_code == 0, result.output
    assert "config.json: removed auto_map, custom_pipelines, text_config.auto_map" in result.output
    for config in (out / "config.json", snapshot_of(fake, "acme/d") / "config.json"):
        data = json.loads(config.read_text())
        assert "auto_map" not in data and "custom_pipelines" not in data and "auto_map" not in data["text_config"]
        assert data["model_type"] == "qwen3"
    assert not (snapshot_of(fake, "acme/d") / "config.json").is_symlink()  # replaced, the blob untouched
    for name in os.listdir(delta):
        if name != "config.json":
            assert (out / name).read_bytes() == (delta / name).read_bytes(), name
    # again, offline, from the cache: still clean, nothing left to strip
    again = cli("delta", "pull", "acme/d", "-o", tmp_path / "again",)
    assert again.exit_code == 0 and "removed" not in again.output
    assert "auto_map" not in (tmp_path / "again" / "config.json").read_text()


def test_delta_push_never_uploads_auto_map(fake, delta):
    config = json.loads((delta / "config.json").read_text())
    (delta / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x--y.Z"}}))
    assert cli("delta", "push", delta, "acme/d2").exit_code == 0
    assert json.loads(fake.files("acme/d2")["config.json"]) == config
    assert "up to date" in cli("delta", "push", delta, "acme/d2",).output  # resume compares the stripped bytes
    assert "auto_map" in (delta / "config.json").read_text()  # the local folder is the user's, left as it is


def test_delta_with_a_config_that_is_not_json_is_one_line(fake, delta, tmp_path):
    assert cli("delta", "push", delta, "acme/d3").exit_code == 0
    files = dict(fake.files("acme/d3"))
    files["config.json"] = b"{\"auto_map\": "
    fake.new_commit("acme/d3", "main", files, "broken config")
    assert "config.json is not valid JSON" in refused(cli("delta", "pull", "acme/d3", "-o", tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_delta_card_says_configs_never_name_code(fake, delta):
    assert cli("delta", "push", delta, "acme/d4").exit_code == 0
    card = fake.files("acme/d4")["README.md"].decode()
    assert "without `auto_map` or `custom_pipelines`" in card


# -- 3. links planted in the cache ------------------------------------------------------------


def first_shard(snapshot: Path) -> Path:
    return sorted(snapshot.glob("*.safetensors"))[0]


def plant(link: Path, target: Path) -> None:
    link.unlink()
    link.symlink_to(target)


def assert_refused_link(fake, tmp_path, *args, skip_cache: bool = True) -> str:
    """A pull into ``-o out`` that must be refused, writing nothing outside the HF cache."""
    out = tmp_path / "out"
    before = tree(tmp_path, skip=fake.cache if skip_cache else None)
    message = refused(cli("fisher", "pull", *args, "-o", out,))
    assert tree(tmp_path, skip=fake.cache if skip_cache else None) == before
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    return message


def test_a_shard_linked_out_of_the_cache_is_refused_online_and_offline(fake, tmp_path, tied_models, monkeypatch):
    pushed_cache(fake, tmp_path, tied_models)
    assert cli("fisher", "pull", REPO).exit_code == 0
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"private data")
    shard = first_shard(snapshot_of(fake, REPO))
    plant(shard, secret)
    message = assert_refused_link(fake, tmp_path, REPO)
    assert "outside this repo's blobs" in message and shard.name in message
    offline(monkeypatch)
    assert "outside this repo's blobs" in assert_refused_link(fake, tmp_path, REPO)
    assert "outside this repo's blobs" in refused(cli("fisher", "pull", REPO))  # reading the snapshot itself
    with pytest.raises(GraftError, match="outside this repo's blobs"):
        resolve_artifact(FISHER, REPO, progress=False)  # as a merge's `fisher: org/name` reads it
    assert secret.read_bytes() == b"private data"


def test_a_manifest_linked_to_etc_passwd_is_refused(fake, tmp_path, tied_models):
    pushed_cache(fake, tmp_path, tied_models)
    assert cli("fisher", "pull", REPO).exit_code == 0
    plant(snapshot_of(fake, REPO) / "fisher_manifest.json", Path("/etc/passwd"))
    assert "/etc/passwd" in assert_refused_link(fake, tmp_path, REPO)


def test_a_shard_linked_to_another_repos_blob_is_refused(fake, tmp_path, tied_models):
    pushed_cache(fake, tmp_path, tied_models)
    assert cli("fisher", "pull", REPO).exit_code == 0
    place_in_hf_cache(fake.cache, "acme/other", tied_models["post"])
    other_blob = next((fake.cache / "models--acme--other" / "blobs").iterdir())
    shard = first_shard(snapshot_of(fake, REPO))
    plant(shard, Path("../../..") / "models--acme--other" / "blobs" / other_blob.name)
    assert shard.exists()  # a working link, just not this repo's
    assert "models--acme--other" in assert_refused_link(fake, tmp_path, REPO)


def test_a_snapshot_folder_linked_to_another_repo_is_refused(fake, tmp_path, tied_models):
    pushed_cache(fake, tmp_path, tied_models)
    pushed_cache(fake, tmp_path / "second", tied_models, repo="acme/second")
    assert cli("fisher", "pull", "acme/second").exit_code == 0
    commit = fake.branches[REPO]["main"]
    ours = fake.cache / "models--acme--tiny-fisher" / "snapshots" / commit
    ours.parent.mkdir(parents=True)
    ours.symlink_to(snapshot_of(fake, "acme/second"))
    assert "outside this repo's cache folder" in assert_refused_link(fake, tmp_path, REPO)


def test_a_blobs_folder_linked_out_of_the_cache_gets_nothing_written(fake, tmp_path, tied_models):
    pushed_cache(fake, tmp_path, tied_models)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    storage = fake.cache / "models--acme--tiny-fisher"
    storage.mkdir(parents=True)
    (storage / "blobs").symlink_to(elsewhere)
    assert "outside this repo's cache folder" in assert_refused_link(fake, tmp_path, REPO, skip_cache=False)
    assert list(elsewhere.iterdir()) == []


def test_a_ref_that_is_a_link_or_garbage_is_refused_offline(fake, tmp_path, tied_models, monkeypatch):
    pushed_cache(fake, tmp_path, tied_models)
    assert cli("fisher", "pull", f"{REPO}@main").exit_code == 0
    ref = fake.cache / "models--acme--tiny-fisher" / "refs" / "main"
    offline(monkeypatch)
    plant(ref, Path("/dev/zero"))  # reading it would never end
    assert "not a ref file" in assert_refused_link(fake, tmp_path, REPO)
    ref.unlink()
    ref.write_text("../../../../etc")
    assert "does not hold a commit sha" in assert_refused_link(fake, tmp_path, REPO)


def test_a_planted_link_in_a_cached_model_snapshot_is_refused(fake, tmp_path, tied_models, monkeypatch):
    commit = place_in_hf_cache(fake.cache, "acme/tiny-post", tied_models["post"])
    offline(monkeypatch)
    assert cached_model_folder("acme/tiny-post", None).endswith(commit)  # a clean snapshot is used
    snapshot = fake.cache / "models--acme--tiny-post" / "snapshots" / commit
    (snapshot / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(GraftError, match="outside this repo's blobs") as error:
        cached_model_folder("acme/tiny-post", None)
    assert "\n" not in str(error.value)


def test_clean_pull_after_refusals_still_works(fake, tmp_path, tied_models):
    cache = pushed_cache(fake, tmp_path, tied_models)
    out = tmp_path / "out"
    assert cli("fisher", "pull", REPO, "-o", out).exit_code == 0
    assert open_fisher_cache(out).names() == open_fisher_cache(cache).names()
    assert "already exists" in refused(cli("fisher", "pull", REPO, "-o", out))
    link = tmp_path / "link-out"
    link.symlink_to(tmp_path / "nowhere")
    assert "already exists" in refused(cli("fisher", "pull", REPO, "-o", link))


# -- 1b. fisher estimate never runs (or asks to run) a model folder's code -----------------------

EVIL_MODULE = '''from pathlib import Path

Path({marker!r}).write_text("the model folder's code ran")

from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = "evil_lm"


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


def remote_code_model(folder: Path, marker: Path, model_type: str = "evil_lm") -> Path:
    """A tiny Llama whose config.json asks transformers to import evil.py from the folder (it writes ``marker``)."""
    make_model(folder, tied=False, architecture="llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    return folder


def estimate_args(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    data = write_jsonl(tmp_path / "rollouts.jsonl", random_rollouts(3, seed=2, vocab=128))
    return ["fisher", "estimate", str(model), "-o", str(tmp_path / "fisher"), "--rollouts", str(data),
            "--batch-size", "2", "--no-progress", *extra]


def test_estimate_refuses_a_model_that_needs_its_own_code(tmp_path):
    marker = tmp_path / "marker"
    model = remote_code_model(tmp_path / "evil", marker)
    message = refused(CliRunner().invoke(main, estimate_args(model, tmp_path), input=""))
    assert "needs its own code" in message and "--trust-remote-code" in message
    assert not marker.exists() and not (tmp_path / "fisher").exists()


def test_estimate_ignores_auto_map_of_a_known_model_type(tmp_path):
    marker = tmp_path / "marker"
    model = remote_code_model(tmp_path / "known", marker, model_type="llama")
    result = CliRunner().invoke(main, estimate_args(model, tmp_path), input="")
    assert result.exit_code == 0, result.output
    assert not marker.exists() and open_fisher_cache(tmp_path / "fisher").names()


def run_graftmerge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ``graftmerge`` console script as a real process, stdin closed."""
    return subprocess.run([str(BIN / "graftmerge"), *args], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def assert_one_line_process_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and REMOTE_CODE_PROMPT not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_the_console_script_refuses_remote_code_and_a_climbing_revision_in_one_line(tmp_path):
    marker = tmp_path / "marker"
    model = remote_code_model(tmp_path / "evil", marker)
    modules = tmp_path / "hf-modules"
    before = tree(tmp_path)
    message = assert_one_line_process_error(
        run_graftmerge(*estimate_args(model, tmp_path), env={"HF_MODULES_CACHE": str(modules)}))
    assert "needs its own code" in message and not marker.exists() and not modules.exists()
    message = assert_one_line_process_error(
        run_graftmerge("fisher", "pull", "acme/x@../../../escaped", "-o", str(tmp_path / "out")))
    assert "not a valid revision" in message
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k not in before} == {"rollouts.jsonl": after["rollouts.jsonl"]}


def test_trust_remote_code_runs_the_users_own_model(tmp_path):
    marker = tmp_path / "marker"
    model = remote_code_model(tmp_path / "mine", marker)
    result = run_graftmerge(*estimate_args(model, tmp_path, "--trust-remote-code"),
                            env={"HF_MODULES_CACHE": str(tmp_path / "hf-modules")})
    assert "needs its own code" not in result.stderr and REMOTE_CODE_PROMPT not in result.stdout + result.stderr
    assert marker.exists()  # the user asked for it: the folder's code ran
    assert result.returncode == 0, result.stderr[-3000:]
    assert open_fisher_cache(tmp_path / "fisher").names()
