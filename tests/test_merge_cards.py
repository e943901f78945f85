"""Every model folder graftmerge writes has a card the Hub reads into its model tree.

Each card is parsed by huggingface_hub's own ``ModelCard`` (offline, from the file), and
its facts are checked against what the merge really read: the inputs' Hub ids (a cached
snapshot's repo, a Hub id as written, none for a plain folder), ``base_model_relation:
merge``, the Fisher cache's origin and the sha256 of its manifest (hashed here
independently), λ and ρ. Merges through mergekit-yaml, graftmerge merge and run_merge;
sweep folders; sweep --eval's best/; delta extract --rank adapters.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from huggingface_hub import ModelCard
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from graftmerge.adapter import import_hook
from graftmerge.cli import main
from graftmerge.hub.cache_layout import snapshot_origin
from graftmerge.hub.models import model_hub_id
from graftmerge.pipeline.card_writer import DataInputs, merge_card
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.sweep_eval import Evaluation, Judge, run_sweep_eval
from tests.helpers.configs import graft_yaml
from tests.helpers.hf_cache import place_in_hf_cache
from tests.helpers.runners import forget_process_state, run_cli, run_process


@pytest.fixture(scope="module")
def hf_cache(tied_models, tied_diag_cache, tmp_path_factory) -> Path:
    """A Hugging Face cache holding the post model, the donor and the Fisher cache as Hub repos."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    place_in_hf_cache(cache, "acme/tiny-post", tied_models["post"])
    place_in_hf_cache(cache, "acme/tiny-base", tied_models["donor"])
    place_in_hf_cache(cache, "acme/tiny-fisher", tied_diag_cache)
    return cache


@pytest.fixture
def offline_cache(hf_cache, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    return hf_cache


def snapshot(cache: Path, repo_id: str) -> Path:
    return next((cache / ("models--" + repo_id.replace("/", "--")) / "snapshots").iterdir())


def card_of(folder: Path) -> ModelCard:
    """The folder's README.md as the Hub's own parser reads it (ignore_metadata_errors off: it must be valid)."""
    return ModelCard.load(folder / "README.md")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def settings_row(card: ModelCard, name: str) -> str:
    """The value cell of parameter ``name`` in the card's settings table."""
    rows = [line for line in card.text.splitlines() if line.startswith(f"| `{name}`")]
    assert len(rows) == 1, card.text
    return rows[0].rsplit("|", 2)[1].strip()


def test_model_hub_id_names_cached_snapshots_and_hub_ids_only(offline_cache, tied_models, tmp_path):
    post = snapshot(offline_cache, "acme/tiny-post")
    assert model_hub_id(str(post)) == "acme/tiny-post"
    assert snapshot_origin(post) == ("acme/tiny-post", post.name)
    (tmp_path / "link").symlink_to(post)
    assert model_hub_id(str(tmp_path / "link")) == "acme/tiny-post"  # seen through a link
    assert model_hub_id(str(tied_models["post"])) is None  # a plain local folder
    assert model_hub_id("acme/elsewhere") == "acme/elsewhere"  # a Hub id as written, used as is
    assert model_hub_id("acme/elsewhere@v2") == "acme/elsewhere"
    assert model_hub_id("hf://acme/elsewhere@v2") == "acme/elsewhere"
    assert model_hub_id("./acme/elsewhere") is None and model_hub_id("no-slash") is None
    # a folder named like a snapshot but not in a cache's shape, or with a name the Hub refuses
    fake = tmp_path / "models--a--b" / "snapshots" / "not-a-sha"
    fake.mkdir(parents=True)
    assert model_hub_id(str(fake)) is None
    bad = tmp_path / "models--a--b..c" / "snapshots" / ("0" * 40)
    bad.mkdir(parents=True)
    assert model_hub_id(str(bad)) is None


def test_mergekit_yaml_graft_card_names_snapshot_inputs_and_the_fisher_cache(
        offline_cache, tied_models, tied_diag_cache, tmp_path):
    """A cached snapshot folder is named by its Hub id; a plain folder is not; the cache's facts are its own.

    A real process: mergekit imports its card module, its registry and graft's hook in its own order."""
    post = snapshot(offline_cache, "acme/tiny-post")
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(post, tied_models["donor"], [(tied_models["donor_ft"], 0.5)], rho=0.02, lam=0.75,
                                 fisher=tied_diag_cache, scope="tensor"))
    result = run_process("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    card = card_of(tmp_path / "out")
    data = card.data.to_dict()
    assert data["base_model"] == ["acme/tiny-post"]  # donor and donor_ft are plain local folders
    assert data["base_model_relation"] == "merge" and data["library_name"] == "transformers"
    assert {"graftmerge", "graft", "merge"} <= set(data["tags"])
    assert settings_row(card, "lambda") == "0.75" and settings_row(card, "rho") == "0.02"
    assert settings_row(card, "rho_scope") == "tensor" and settings_row(card, "mask") == "auto"  # the default
    text = card.text
    assert f"local folder `{os.path.abspath(tied_diag_cache)}`" in text
    assert f"`{sha256(tied_diag_cache / 'fisher_manifest.json')}`" in text
    assert "λ = 0.75, ρ = 0.02" in text and "the same share in every tensor" in text
    assert f"`{tied_models['donor_ft']}` | — (local folder) | role: donor_ft, weight: 0.5 |" in text
    assert yaml.safe_load(text.split("```yaml\n")[1].split("```")[0]) == yaml.safe_load(config.read_text())
    assert "graft_run" not in (tmp_path / "out" / "README.md").read_text()


def test_graftmerge_merge_card_with_hub_ids_and_a_hub_fisher_cache(offline_cache, tied_models, tmp_path):
    """Hub ids as written (read from the cache offline) are the base models; the cache is named by repo and commit."""
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml("acme/tiny-post", "acme/tiny-base", [(tied_models["donor_ft"], 1.0)], rho=0.05,
                                 fisher="acme/tiny-fisher@main"))
    result = run_cli("graftmerge", "merge", str(config), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    card = card_of(tmp_path / "out")
    assert card.data.base_model == ["acme/tiny-post", "acme/tiny-base"]
    assert card.data.base_model_relation == "merge"
    commit = snapshot(offline_cache, "acme/tiny-fisher").name
    assert (f"Hub repo [acme/tiny-fisher](https://huggingface.co/acme/tiny-fisher), revision `main`, "
            f"commit `{commit}`") in card.text
    manifest = snapshot(offline_cache, "acme/tiny-fisher") / "fisher_manifest.json"
    assert sha256(manifest) in card.text and "kind: diagonal" in card.text
    assert "one threshold over the whole model" in card.text


def test_run_merge_writes_the_card_only_when_mergekit_would(offline_cache, tied_models, tmp_path):
    """run_merge from Python: write_model_card off writes no README.md (as mergekit), on writes graftmerge's;
    ρ = 0 reads no cache, and the card says the cache was not read."""
    import_hook.install()
    from mergekit.merge import run_merge

    config = MergeConfiguration.model_validate(yaml.safe_load(graft_yaml(
        tied_models["post"], tied_models["donor"], [(tied_models["donor_ft"], 1.0)], rho=0.0,
        fisher="./nowhere")))
    forget_process_state()
    run_merge(config, str(tmp_path / "plain"), options=MergeOptions(quiet=True, write_model_card=False))
    assert not (tmp_path / "plain" / "README.md").exists()
    forget_process_state()
    run_merge(config, str(tmp_path / "carded"), options=MergeOptions(quiet=True))
    card = card_of(tmp_path / "carded")
    data = card.data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data  # nothing on the Hub to relate to
    assert data["library_name"] == "transformers"
    assert "`./nowhere`\n  - named by the config but not read by this merge" in card.text
    assert "no mask (ρ = 0" in card.text


def test_sweep_folders_each_carry_their_own_point(offline_cache, tied_models, tied_diag_cache, tmp_path):
    post = snapshot(offline_cache, "acme/tiny-post")
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(post, tied_models["donor"], [(tied_models["donor_ft"], 1.0)], rho=0.3,
                                 fisher=tied_diag_cache))
    result = run_cli("graftmerge", "sweep", str(config), "--lambda", "0,0.5", "--rho", "0,0.02", "-o",
                     str(tmp_path / "sweep"))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest_sha = sha256(tied_diag_cache / "fisher_manifest.json")
    for lam in (0.0, 0.5):
        for rho in (0.0, 0.02):
            folder = tmp_path / "sweep" / f"lambda-{lam!r}_rho-{rho!r}"
            card = card_of(folder)
            assert card.data.base_model == ["acme/tiny-post"] and card.data.base_model_relation == "merge"
            assert (settings_row(card, "lambda"), settings_row(card, "rho")) == (repr(lam), repr(rho))
            assert f"# {folder.name}\n" in card.content
            assert (manifest_sha in card.text) == (rho > 0), card.text  # a mask read the cache
            if lam == 0:
                assert "λ = 0: no update was grafted" in card.text


class ConstantJudge:
    """Scores that make the rule choose by its tie-break (smaller λ, then ρ) among the grafted points."""

    def score(self, model, splits) -> dict:
        return {"keep": dict.fromkeys(splits, 1.0), "learn": dict.fromkeys(splits, 1.0)}

    @staticmethod
    def roles(scores: dict, split: str) -> dict:
        return {"old": scores["keep"][split], "new": scores["learn"][split]}


def test_sweep_eval_best_and_kept_folders_have_cards(offline_cache, tied_models, tied_diag_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    post = snapshot(offline_cache, "acme/tiny-post")
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(post, tied_models["donor"], [(tied_models["donor_ft"], 1.0)], rho=0.0,
                                 fisher=tied_diag_cache))
    tasks = tmp_path / "tasks.yml"
    tasks.write_text("tasks: []\n")
    import_hook.install()
    forget_process_state()
    loaded, source, plan = read_graft_config(str(config))
    judge = ConstantJudge()

    def make_judge() -> Judge:
        return Judge(lambda: AutoModelForCausalLM.from_pretrained(post).eval(), judge.score, judge.roles)

    try:
        run_sweep_eval(loaded, source, plan, [1.0], [0.0, 0.02], str(tmp_path / "out"), MergeOptions(quiet=True),
                       Evaluation((str(tasks),), "tasks", {}), make_judge, keep="all")
    finally:
        forget_process_state()
    chosen = json.loads((tmp_path / "out" / "chosen.json").read_text())["chosen"]
    best = card_of(tmp_path / "out" / "best")
    assert best.data.base_model == ["acme/tiny-post"] and best.data.base_model_relation == "merge"
    assert (settings_row(best, "lambda"), settings_row(best, "rho")) == (repr(chosen["lambda"]), repr(chosen["rho"]))
    kept = card_of(tmp_path / "out" / "lambda-1.0_rho-0.02")
    assert settings_row(kept, "rho") == "0.02" and sha256(tied_diag_cache / "fisher_manifest.json") in kept.text


def test_delta_extract_rank_adapter_card(offline_cache, tied_models, tmp_path):
    """The donor's Hub id (its folder a cached snapshot) is the adapter's base_model; a plain donor gives none."""
    donor = snapshot(offline_cache, "acme/tiny-base")
    for name, source in (("cached", donor), ("plain", tied_models["donor"])):
        out = tmp_path / name
        result = CliRunner().invoke(main, ["delta", "extract", str(source), str(tied_models["donor_ft"]), "-o",
                                           str(out), "--rank", "2"])
        assert result.exit_code == 0, result.output
        card = card_of(out)
        assert card.data.library_name == "peft" and "lora" in card.data.tags
        assert card.data.base_model == ("acme/tiny-base" if name == "cached" else None)
        manifest = json.loads((out / "lora_manifest.json").read_text())
        assert f"| rank (at most) | {manifest['rank']} |" in card.text
        assert f"{100 * manifest['total']['kept_share']:.3f}%" in card.text


def test_card_is_generic_over_method_and_per_input_caches(tied_models, tied_diag_cache, tmp_path):
    """A method whose inputs each name a cache (as fisher/regmean merges do): one entry per cache, with its users;
    a schedule's gradient list is shown as written."""
    other = tmp_path / "other-cache"
    shutil.copytree(tied_diag_cache, other)
    config = MergeConfiguration.model_validate({
        "merge_method": "linear", "dtype": "float32",
        "models": [{"model": str(tied_models["donor_ft"]), "parameters": {"weight": [0, 0.5, 1],
                                                                           "fisher": str(tied_diag_cache)}},
                   {"model": "acme/tiny-ft", "parameters": {"weight": 1.0, "fisher": str(other)}},
                   {"model": str(tied_models["donor"]), "parameters": {"weight": 1.0, "fisher": str(other)}}],
    })
    text = merge_card(config, config.to_yaml(), "m", DataInputs({str(tied_diag_cache): tied_diag_cache,
                                                                 str(other): other}, ("a note.",)))
    (tmp_path / "README.md").write_text(text)
    card = card_of(tmp_path)
    assert card.data.base_model == ["acme/tiny-ft"] and card.data.base_model_relation == "merge"
    assert "## Fisher caches" in text and "a note." in text
    assert f"(for `{tied_models['donor_ft']}`)" in text
    assert f"(for `acme/tiny-ft`, `{tied_models['donor']}`)" in text
    assert text.count(sha256(tied_diag_cache / "fisher_manifest.json")) == 2  # the copy has the same manifest
    assert "weight: [0, 0.5, 1]" in text and "| `normalize` | true |" in text  # linear's default
