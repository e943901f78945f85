"""PEFT LoRA adapters from the Hub: ``graftmerge delta pull`` and ``role: delta`` with a Hub id, offline.

A stranger's adapter repo holds far more than the adapter (a pickle of it, base weights,
code, a card); the pull takes exactly ``adapter_config.json`` and
``adapter_model.safetensors``, checks the config field by field before the weights are
fetched, and validates the weights as a graft opens them before ``-o`` is published or the
cached snapshot counts as complete. Against the fake Hub of tests/helpers/fake_hub.py behind huggingface_hub's
own client; grafts from the pulled adapter equal grafts from the local folder bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from graftmerge.demo.tiny_models import make_graft_inputs
from graftmerge.errors import GraftError
from graftmerge.hub.kinds import DELTA_KINDS, LORA_ADAPTER
from graftmerge.hub.pull import pull_first_kind
from graftmerge.hub.push import push_artifact
from tests.helpers.configs import graft_config
from tests.helpers.fake_hub import offline, place_in_hf_cache
from tests.helpers.lora import load_model, make_adapter, peft_deltas
from tests.helpers.models import assert_identical, read_model, tree
from tests.helpers.runners import cli, mergekit_yaml_model, refused, run_cli

pytestmark = pytest.mark.usefixtures("plain_argv")  # pytest's own flags must not reach report_errors' -v

REPO = "acme/tiny-lora"
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture
def fake(hub):
    """The FakeHub (the ``hub`` fixture), online, behind huggingface_hub's client, with a temporary HF cache."""
    return hub


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3 post and base, and a PEFT adapter of the base (q/v/up, r = 4)."""
    root = tmp_path_factory.mktemp("lora-pull")
    paths = make_graft_inputs(root, seed=0)
    paths["adapter"] = make_adapter(paths["donor"], root / "adapter", seed=3, r=4, lora_alpha=8,
                                    target_modules=["q_proj", "v_proj", "up_proj"])
    return paths


def repo_files(adapter: Path, **changes) -> dict[str, bytes]:
    """What a stranger's adapter repo holds: the adapter, and much that a pull must leave alone."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    return {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": (adapter / "adapter_model.safetensors").read_bytes(),
        "adapter_model.bin": b"\x80\x04 a pickle: never fetched",
        "model.safetensors": b"base weights: never fetched",
        "modeling_evil.py": b"raise SystemExit('never fetched')",
        "training_args.bin": b"\x80\x04 another pickle",
        "README.md": b"---\nbase_model: acme/tiny-base\n---\nan adapter card\n",
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }


def upload(fake, files: dict[str, bytes], repo: str = REPO, branch: str = "main") -> str:
    """``files`` as a commit on ``repo``'s ``branch`` of the fake Hub; the commit."""
    fake.branches.setdefault(repo, {})
    return fake.new_commit(repo, branch, files, "a stranger's upload")


def snapshot(fake, repo: str = REPO, branch: str = "main") -> Path:
    return fake.cache / ("models--" + repo.replace("/", "--")) / "snapshots" / fake.branches[repo][branch]


def graft(tmp_path: Path, lora: dict[str, Path], adapter: str, name: str, *tool: str) -> dict[str, torch.Tensor]:
    """The adapter (a folder or a Hub id) grafted as role delta onto the post model, weight 0.7."""
    config = graft_config(lora["post"], [(adapter, "delta", 0.7)])
    if not tool:
        return mergekit_yaml_model(tmp_path, config, name)
    (tmp_path / f"{name}.yml").write_text(config)
    result = run_cli(*tool, str(tmp_path / f"{name}.yml"), str(tmp_path / name))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_model(tmp_path / name)


# -- pulling ---------------------------------------------------------------------------------------


def test_pull_fetches_only_the_adapter_and_grafts_like_the_local_folder(fake, lora, tmp_path, monkeypatch):
    upload(fake, repo_files(lora["adapter"], base_model_name_or_path="acme/tiny-base"))
    out = tmp_path / "pulled"
    result = cli("delta", "pull", REPO, "-o", out)
    assert result.exit_code == 0, (result.output, result.stderr)
    assert set(fake.downloads) == ADAPTER_FILES  # the config read to plan, the weights, the config last
    assert {p.name for p in out.iterdir()} == ADAPTER_FILES
    assert {p.name for p in snapshot(fake).iterdir()} == ADAPTER_FILES
    for name in ADAPTER_FILES - {"adapter_config.json"}:
        assert (out / name).read_bytes() == (lora["adapter"] / name).read_bytes()
    assert "pulled PEFT LoRA adapter acme/tiny-lora" in result.output
    assert "(a LoRA of acme/tiny-base: graft it onto a model post-trained from that base)" in result.output
    # PEFT itself loads the pulled folder: the same deltas as the original
    pulled, original = peft_deltas(lora["donor"], out), peft_deltas(lora["donor"], lora["adapter"])
    assert pulled.keys() == original.keys() and all(torch.equal(pulled[n], original[n]) for n in pulled)

    offline(monkeypatch)
    fake.downloads.clear()
    again = cli("delta", "pull", REPO, "-o", tmp_path / "again")  # from the cache, offline
    assert again.exit_code == 0 and fake.downloads == []
    expected = graft(tmp_path, lora, str(lora["adapter"]), "local")
    assert_identical(graft(tmp_path, lora, REPO, "hub-id"), expected)  # mergekit-yaml, offline
    assert_identical(graft(tmp_path, lora, REPO, "hub-id-merge", "graftmerge", "merge"), expected)
    assert_identical(graft(tmp_path, lora, str(out), "pulled-folder"), expected)


def test_a_revision_pulls_and_resolves_offline(fake, lora, tmp_path, monkeypatch):
    upload(fake, {".gitattributes": b""})
    commit = upload(fake, repo_files(lora["adapter"]), branch="v1")
    assert cli("delta", "pull", f"{REPO}@v1").exit_code == 0
    assert (fake.cache / "models--acme--tiny-lora" / "refs" / "v1").read_text() == commit
    offline(monkeypatch)
    expected = graft(tmp_path, lora, str(lora["adapter"]), "local")
    assert_identical(graft(tmp_path, lora, f"{REPO}@v1", "at-v1"), expected)
    _, result = pull_first_kind(DELTA_KINDS, f"{REPO}@v1", progress=False)
    assert result.folder == snapshot(fake, branch="v1")


def test_an_adapter_downloaded_whole_into_the_cache_grafts_offline(fake, lora, tmp_path, monkeypatch):
    """role: delta with a Hub id works from any complete cached copy (e.g. `hf download`), extra files and all."""
    shutil.copytree(lora["adapter"], tmp_path / "whole")
    (tmp_path / "whole" / "README.md").write_text("an adapter card\n")
    place_in_hf_cache(fake.cache, "acme/whole-lora", tmp_path / "whole")
    offline(monkeypatch)
    expected = graft(tmp_path, lora, str(lora["adapter"]), "local")
    assert_identical(graft(tmp_path, lora, "acme/whole-lora", "cached"), expected)
    assert_identical(graft(tmp_path, lora, "acme/whole-lora", "cached-merge", "graftmerge", "merge"), expected)


def test_a_graftmerge_delta_repo_still_pulls_as_a_delta(fake, lora, tmp_path):
    from graftmerge.pipeline.delta_extract import extract_delta

    folder = extract_delta(lora["donor"], lora["donor_ft"], tmp_path / "delta", progress=False)
    assert cli("delta", "push", folder, "acme/tiny-delta").exit_code == 0
    result = cli("delta", "pull", "acme/tiny-delta", "-o", tmp_path / "pulled")
    assert result.exit_code == 0 and "pulled delta acme/tiny-delta" in result.output
    assert "adapter_config.json" not in fake.downloads  # a delta repo is never asked for an adapter


# -- refusals: one line, nothing published, the snapshot never complete ----------------------------------------


def refused_pull(fake, tmp_path: Path, repo: str = REPO, cached_before: bool = False) -> str:
    """``delta pull REPO -o out`` refused: nothing outside the HF cache changed, no -o, and (unless
    it was cached before) no complete snapshot, so the Hub id never resolves to what was refused."""
    before = tree(tmp_path, skip=fake.cache)
    message = refused(cli("delta", "pull", repo, "-o", tmp_path / "out"))
    assert tree(tmp_path, skip=fake.cache) == before and not (tmp_path / "out").exists()
    if repo in fake.branches and not cached_before:
        assert not (snapshot(fake, repo) / "adapter_config.json").exists()
    return message


CONFIG_REFUSALS = {
    "DoRA": ({"use_dora": True}, "use_dora = true (DoRA"),
    "LoHa": ({"peft_type": "LOHA"}, "peft_type is 'LOHA'"),
    "code to import": ({"auto_map": {"AutoModel": "evil.Model"}}, "unknown field auto_map"),
    "a pattern without layers": ({"layers_pattern": "layers"}, "layers_pattern is set without layers_to_transform"),
    "r not a number": ({"r": "8"}, "r must be a positive integer"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_a_config_graft_cannot_reproduce_is_refused_before_the_weights_are_fetched(fake, lora, tmp_path, case):
    changes, expected = CONFIG_REFUSALS[case]
    upload(fake, repo_files(lora["adapter"], **changes))
    message = refused_pull(fake, tmp_path)
    assert expected in message and f"{REPO}@" in message
    assert set(fake.downloads) == {"adapter_config.json"}


def adapter_with(lora: dict[str, Path], tmp_path: Path, edit) -> dict[str, bytes]:
    """The repo files with the adapter's tensors edited by ``edit`` (a dict of tensors, changed in place)."""
    tensors = load_file(lora["adapter"] / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "edited.safetensors")
    files = repo_files(lora["adapter"])
    files["adapter_model.safetensors"] = (tmp_path / "edited.safetensors").read_bytes()
    return files


def _nan(tensors: dict) -> None:
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")


def _rank(tensors: dict) -> None:
    key = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:, :2].contiguous()


def _prefix(tensors: dict) -> None:
    key = sorted(tensors)[0]
    tensors[key.removeprefix("base_model.model.")] = tensors.pop(key)


WEIGHT_REFUSALS = {
    "NaN": (_nan, "contains NaN or Inf"),
    "ranks disagree": (_rank, "are not r × in and out × r with one r"),
    "not PEFT's keys": (_prefix, "does not start with 'base_model.model.'"),
}


@pytest.mark.parametrize("case", list(WEIGHT_REFUSALS))
def test_weights_a_graft_would_refuse_are_refused_by_the_pull(fake, lora, tmp_path, case, monkeypatch):
    edit, expected = WEIGHT_REFUSALS[case]
    upload(fake, adapter_with(lora, tmp_path, edit))
    message = refused_pull(fake, tmp_path)
    assert message.startswith("error: pull refused: ") and expected in message and f"{REPO}@" in message
    # without -o: the snapshot completed by this pull is undone, so it never resolves offline
    assert expected in refused(cli("delta", "pull", REPO))
    assert not (snapshot(fake) / "adapter_config.json").exists()
    offline(monkeypatch)
    assert "not in the local Hugging Face cache" in refused(cli("delta", "pull", REPO))


def test_a_corrupt_safetensors_header_is_refused(fake, lora, tmp_path):
    files = repo_files(lora["adapter"])
    files["adapter_model.safetensors"] = (2**40).to_bytes(8, "little") + b"{}"
    upload(fake, files)
    assert "corrupt or truncated safetensors header" in refused_pull(fake, tmp_path)


def test_a_pickle_only_adapter_is_refused_with_what_to_do(fake, lora, tmp_path):
    files = repo_files(lora["adapter"])
    del files["adapter_model.safetensors"]
    upload(fake, files)
    message = refused_pull(fake, tmp_path)
    assert "acme/tiny-lora is not a PEFT LoRA adapter (the repo has no adapter_model.safetensors; graftmerge " \
           "pulls safetensors only: re-save an adapter_model.bin" in message
    assert "adapter_model.bin" not in fake.downloads


def test_config_that_is_not_an_object_or_nested_too_deep(fake, lora, tmp_path):
    files = repo_files(lora["adapter"])
    for config, expected in ((b"[1, 2]", "adapter_config.json is not a JSON object"),
                             (b"{\"x\": " * 40 + b"1" + b"}" * 40, "nested deeper than 32 levels"),
                             (b"{\"r\": 4, \"r\": 8}", "key 'r' appears twice")):
        files["adapter_config.json"] = config
        upload(fake, files)
        assert expected in refused_pull(fake, tmp_path)
    assert "adapter_model.safetensors" not in fake.downloads


def test_a_repo_that_is_neither_names_both_manifests(fake, tmp_path, monkeypatch):
    upload(fake, {"config.json": b"{}"}, repo="acme/model")
    message = refused_pull(fake, tmp_path, "acme/model")
    assert ("acme/model is not a graftmerge delta (the repo has no delta_manifest.json), nor a PEFT LoRA adapter "
            "(no adapter_config.json)") in message
    assert "no Hub repo acme/missing" in refused(cli("delta", "pull", "acme/missing"))
    offline(monkeypatch)
    message = refused(cli("delta", "pull", "acme/never-pulled@v2"))
    assert "not in the local Hugging Face cache" in message and "graftmerge delta pull acme/never-pulled@v2" in message


def test_a_planted_link_in_a_pulled_adapter_is_refused(fake, lora, tmp_path, monkeypatch):
    upload(fake, repo_files(lora["adapter"]))
    assert cli("delta", "pull", REPO).exit_code == 0
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes((lora["adapter"] / "adapter_model.safetensors").read_bytes())
    weights = snapshot(fake) / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(secret)
    assert "outside this repo's blobs" in refused_pull(fake, tmp_path, cached_before=True)
    offline(monkeypatch)
    assert "outside this repo's blobs" in refused(cli("delta", "pull", REPO))
    (tmp_path / "g.yml").write_text(graft_config(lora["post"], [(REPO, "delta", 0.7)]))
    for tool in (("mergekit-yaml",), ("graftmerge", "merge")):  # the Hub id in a config: refused before a read
        result = run_cli(*tool, str(tmp_path / "g.yml"), str(tmp_path / "out"))
        assert result.returncode != 0 and "outside this repo's blobs" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_an_adapter_is_never_pushed_as_a_delta(fake, lora):
    assert "not a graftmerge delta (no delta_manifest.json)" in refused(cli("delta", "push", lora["adapter"], REPO))
    with pytest.raises(GraftError, match="graftmerge does not push a PEFT LoRA adapter"):
        push_artifact(LORA_ADAPTER, lora["adapter"], REPO)
    assert fake.commits == []


def test_the_pulled_folder_loads_in_peft_without_the_repos_other_files(fake, lora, tmp_path):
    upload(fake, repo_files(lora["adapter"]))
    out = tmp_path / "pulled"
    assert cli("delta", "pull", REPO, "-o", out).exit_code == 0
    merged = PeftModel.from_pretrained(load_model(lora["donor"], "qwen3"), out).merge_and_unload()
    reference = PeftModel.from_pretrained(load_model(lora["donor"], "qwen3"), lora["adapter"]).merge_and_unload()
    for (name, a), (_, b) in zip(merged.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    assert not any(name.endswith((".bin", ".py", ".md")) for name in os.listdir(out))


def test_a_strangers_base_model_name_is_not_echoed_to_the_terminal(fake, lora):
    upload(fake, repo_files(lora["adapter"], base_model_name_or_path="\x1b]0;pwned\x07acme/tiny-base"))
    result = cli("delta", "pull", REPO)
    assert result.exit_code == 0 and "use it: `- model: acme/tiny-lora`" in result.output
    assert "\x1b" not in result.output and "a LoRA of" not in result.output
