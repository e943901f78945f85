"""Masking any update: the post model listed again as the donor grafts Δ = θft − θpost.

That is SFT + merge + mask through the same code and the same Fisher as a graft (the
control that separates "an earlier donor" from "a mask", issue 16). Checked against the
whole-model brute force of tests.helpers.references, through the stock mergekit-yaml, graftmerge merge,
sweep and merge_state_dicts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mergekit.merge_methods import merge_state_dicts

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats.checkpoint import Checkpoint
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import assert_identical, read_model
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import mergekit_yaml_model, run_cli


@pytest.fixture(scope="module")
def sft(tied_models, tmp_path_factory) -> Path:
    """θpost fine-tuned (θpost + noise): the update plain SFT would make."""
    post = Checkpoint(tied_models["post"])
    folder = tmp_path_factory.mktemp("sft") / "post-sft"
    save_tiny_model(folder, seed=11, base={n: post.read(n) for n in post.tensors}, noise=0.03, tie_word_embeddings=True)
    return folder


@pytest.fixture(scope="module")
def mixed_cache(tied_models, tmp_path_factory) -> Path:
    return write_mixed_cache(tmp_path_factory.mktemp("masked-fisher") / "mixed", tied_models["post"])


@pytest.mark.parametrize("cache_kind", ["diag", "mixed"])
@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_masked_update_equals_brute_force(tmp_path, tied_models, tied_diag_cache, mixed_cache, sft, cache_kind, scope):
    post = tied_models["post"]
    fisher = {"diag": tied_diag_cache, "mixed": mixed_cache}[cache_kind]
    fine_tunes = [(sft, 0.8)]
    got = mergekit_yaml_model(tmp_path, graft_yaml(post, post, fine_tunes, rho=0.02, fisher=fisher, scope=scope),
                              "masked")
    brute = brute_force_graft(post, post, fine_tunes, fisher, 0.02, scope)
    assert any(mask.any() for mask in brute.masks.values())  # the mask did something
    for name, expected in brute.expected.items():
        if brute.kinds.get(name) == "kfac":  # the same masked pairs, up to matmul rounding
            assert torch.allclose(got[name], expected, atol=1e-6, rtol=0), name
        else:
            assert torch.equal(got[name], expected), name


def test_unmasked_update_is_post_plus_lambda_sft_delta(tmp_path, tied_models, sft):
    post, ft = read_model(tied_models["post"]), read_model(sft)
    got = mergekit_yaml_model(tmp_path, graft_yaml(tied_models["post"], tied_models["post"], [(sft, 0.5)]), "plain")
    for name in post:
        assert torch.equal(got[name], post[name] + 0.5 * (ft[name] - post[name])), name


def test_graftmerge_merge_and_sweep_take_the_post_as_donor(tmp_path, tied_models, tied_diag_cache, sft):
    post = tied_models["post"]
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(post, post, [(sft, 1.0)], rho=0.01, fisher=tied_diag_cache))
    assert run_cli("graftmerge", "merge", str(config), str(tmp_path / "merged")).returncode == 0
    sweep = run_cli(
        "graftmerge", "sweep", str(config), "-o", str(tmp_path / "grid"), "--lambda", "1.0", "--rho", "0.01"
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    (point,) = [p for p in (tmp_path / "grid").iterdir() if p.is_dir()]
    assert_identical(read_model(point), read_model(tmp_path / "merged"))


def test_merge_state_dicts_takes_the_post_state_dict_as_donor(tmp_path, tied_models, tied_diag_cache, sft):
    post = tied_models["post"]
    expected = mergekit_yaml_model(tmp_path, graft_yaml(post, post, [(sft, 0.7)], rho=0.01, fisher=tied_diag_cache),
                                   "yaml")
    post_weights = read_model(post)
    got = merge_state_dicts(
        {"post": post_weights, "donor": post_weights, "sft": read_model(sft)}, "graft", base="post",
        dtype=torch.float32,
        parameters={"role": {"donor": "donor", "sft": "donor_ft"}, "weight": {"donor": 1.0, "sft": 0.7},
                    "rho": 0.01, "fisher": str(tied_diag_cache)},
    )
    assert_identical(got, expected)


@pytest.mark.parametrize(
    "entries,message",
    [
        ("{donor}: donor\n{sft}: donor_ft\n{post}: donor_ft", "is listed twice (as base_model"),
        ("{sft}: donor_ft\n{post}: delta", "is listed twice (as base_model"),
        ("{post}: donor\n{sft}: donor_ft\n{donor}: donor", "duplicate role donor"),
    ],
    ids=["post as donor_ft", "post as delta", "a second donor"],
)
def test_the_post_appears_again_only_as_the_one_donor(tmp_path, tied_models, sft, entries, message):
    post = tied_models["post"]
    models = ""
    for line in entries.format(post=post, donor=tied_models["donor"], sft=sft).splitlines():
        path, role = line.split(": ")
        models += f"  - model: {path}\n    parameters: {{role: {role}}}\n"
    (tmp_path / "g.yml").write_text(f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}")
    result = run_cli("mergekit-yaml", str(tmp_path / "g.yml"), str(tmp_path / "out"))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line]
    assert message in lines[-1], lines[-1]
    assert not (tmp_path / "out").exists()
