"""Bad fisher / regmean configs: one ``error:`` line, exit 2, nothing written to OUT, inputs untouched."""

from __future__ import annotations

import pytest
import torch

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter
from tests.helpers.data_aware import config, make_models, write_both_cache
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import cli, error_line, refused, run_cli


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two Llama models with their caches (kind both), diagonal-only and rank-deficient caches, and a cache of a
    model of another shape."""
    root = tmp_path_factory.mktemp("bad")
    models = make_models(root, "llama-untied", count=2)
    caches = [root / "f0", root / "f1"]
    for index, (model, cache) in enumerate(zip(models, caches)):
        write_both_cache(cache, model, seed=index)
        write_both_cache(root / f"diag{index}", model, seed=index, only_diagonal=True)
        write_both_cache(root / f"singular{index}", model, seed=index, singular=True)
    save_tiny_model(root / "other", seed=3, architecture="llama", hidden_size=32, tie_word_embeddings=False)
    write_both_cache(root / "f-other", root / "other", seed=3, only_diagonal=True)
    write_truncated_cache(root / "truncated", models[1])
    digests = {p: tree_digest(p) for p in root.iterdir() if p.is_dir()}
    yield root, models, caches
    assert {p: tree_digest(p) for p in digests} == digests


def write_truncated_cache(path, model) -> None:
    """Every 2-D weight with KFAC whose column (input) side keeps 2 eigenvectors (as fisher compress writes)."""
    generator = torch.Generator().manual_seed(5)
    with FisherCacheWriter(path, model=model) as writer:
        for name, info in Checkpoint(model).tensors.items():
            writer.add_diagonal(name, torch.rand(info.shape, generator=generator))
            if len(info.shape) == 2:
                rows, columns = info.shape
                basis, _ = torch.linalg.qr(torch.randn(columns, columns, generator=generator, dtype=torch.float64))
                writer.add_kfac_eigen(name, U=None, S=torch.rand(rows, dtype=torch.float64, generator=generator),
                                      V=basis[:, :2], D=torch.linspace(2, 1, columns, dtype=torch.float64))


def refuse(tmp_path, text: str, expected: str) -> str:
    (tmp_path / "c.yml").write_text(text)
    result = run_cli("mergekit-yaml", str(tmp_path / "c.yml"), str(tmp_path / "out"))
    line = error_line(result)
    assert expected in line, line
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging or lock left
    return line


def with_caches(root, models, names, method="regmean", weights=(1.0, 1.0), **parameters) -> str:
    return config(method, models, [root / n for n in names], list(weights), **parameters)


CASES = {
    "cache of the other fine-tune": (("f1", "f0"), "fisher", {}, "was estimated on other weights than"),
    "cache of a model of another shape": (("f0", "f-other"), "fisher", {}, "was made for another model"),
    "cache that does not exist": (("f0", "nowhere"), "fisher", {}, "does not exist"),
    "alpha above 1": (("f0", "f1"), "regmean", {"alpha": 1.5}, "alpha must be a number in [0, 1]"),
    "alpha below 0": (("f0", "f1"), "regmean", {"alpha": -0.1}, "alpha must be a number in [0, 1]"),
    "alpha as a gradient list": (("f0", "f1"), "regmean", {"alpha": "[0.1, 0.9]"}, "alpha must be a single value"),
    "negative epsilon": (("f0", "f1"), "fisher", {"epsilon": -1}, "epsilon must be a finite number ≥ 0"),
    "alpha given to fisher": (("f0", "f1"), "fisher", {"alpha": 0.5}, "unknown fisher parameter(s) alpha"),
    "unknown fallback": (("f0", "f1"), "regmean", {"regmean_fallback": "skip"}, "regmean_fallback must be one of"),
    "no KFAC entries": (("diag0", "diag1"), "regmean", {}, "has no KFAC entry for linear weight"),
    "truncated input factor": (("f0", "truncated"), "regmean", {}, "truncated input factor"),
    "singular Gram sum": (("singular0", "singular1"), "regmean", {"alpha": 1.0}, "raise"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line(tmp_path, setup, case):
    root, models, _ = setup
    names, method, parameters, expected = CASES[case]
    if case == "singular Gram sum":
        expected = "is singular: lower alpha to add more ridge"
    refuse(tmp_path, with_caches(root, models, names, method, **parameters), expected)


def test_a_model_without_its_cache(tmp_path, setup):
    root, models, caches = setup
    text = config("fisher", models, caches, [1.0, 1.0]).replace(f"{{fisher: {caches[1]}, weight: 1.0}}",
                                                                "{weight: 1.0}")
    line = refuse(tmp_path, text, "has no Fisher cache")
    assert str(models[1]) in line


@pytest.mark.parametrize("weights, expected", [((1.0, -1.0), "must be a finite number ≥ 0"),
                                               ((0.0, 0.0), "weights sum to 0")])
def test_bad_weights(tmp_path, setup, weights, expected):
    root, models, _ = setup
    refuse(tmp_path, with_caches(root, models, ("f0", "f1"), "fisher", weights), expected)


def test_a_base_model_is_refused(tmp_path, setup):
    root, models, caches = setup
    refuse(tmp_path, f"base_model: {models[0]}\n" + config("fisher", models, caches, [1.0, 1.0]), "has no base")


@pytest.mark.parametrize("method, change, expected", [
    ("fisher", ("dtype:", "dtyp:"), "c.yml: unknown key dtyp (did you mean dtype?)"),
    ("regmean", ("models:", "model:"), "c.yml: unknown key model (did you mean models?)"),
    ("regmean", ("dtype: float32", "dtype: float32\nalpha: 0.5"),
     "unknown key alpha (alpha is a parameter of the method: put it under `parameters:`)"),
    ("fisher", ("    parameters:", "    parameter:"), "unknown key parameter in model 1 of `models:` "
                                                         "(did you mean parameters?)"),
])
def test_a_misspelt_key_is_named(tmp_path, setup, method, change, expected):
    """mergekit drops keys it does not know; a fisher or regmean config names them, with the key meant."""
    root, models, caches = setup
    text = config(method, models, caches, [1.0, 1.0]).replace(*change, 1)
    refuse(tmp_path, text, expected)


def test_out_among_the_inputs_is_refused(tmp_path, setup):
    root, models, caches = setup
    (tmp_path / "c.yml").write_text(config("fisher", models, caches, [1.0, 1.0]))
    line = error_line(run_cli("mergekit-yaml", str(tmp_path / "c.yml"), str(caches[0])))
    assert str(caches[0].name) in line


def test_regmean_fallback_average_averages_what_has_no_gram(tmp_path, setup):
    root, models, _ = setup
    (tmp_path / "c.yml").write_text(with_caches(root, models, ("diag0", "diag1"), regmean_fallback="average"))
    result = run_cli("mergekit-yaml", str(tmp_path / "c.yml"), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    got, states = read_model(tmp_path / "out"), [read_model(m) for m in models]
    for name in got:
        assert torch.allclose(got[name], (states[0][name] + states[1][name]) / 2, rtol=1e-6, atol=1e-7), name


def test_graftmerge_merge_refuses_in_one_line(tmp_path, setup):
    root, models, _ = setup
    (tmp_path / "c.yml").write_text(with_caches(root, models, ("f0", "f1"), alpha=2))
    assert "alpha" in refused(cli("merge", str(tmp_path / "c.yml"), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_state_dicts_without_what_regmean_needs(setup):
    from mergekit.merge_methods.api import merge_state_dicts

    root, models, caches = setup
    states = {"a": read_model(models[0]), "b": read_model(models[1])}
    fisher = {"a": str(caches[0]), "b": str(caches[1])}
    with pytest.raises(GraftError, match="needs the shared parameter model_config"):
        merge_state_dicts(states, "regmean", parameters={"fisher": fisher})
    with pytest.raises(GraftError, match=r"input\(s\) 'b' have no Fisher cache"):
        merge_state_dicts(states, "fisher", parameters={"fisher": {"a": fisher["a"], "b": None}})
    swapped = {"a": read_model(root / "other"), "b": states["b"]}
    with pytest.raises((GraftError, ValueError)):
        merge_state_dicts(swapped, "fisher", parameters={"fisher": fisher})


def test_state_dicts_without_any_cache_are_the_plain_average_with_a_warning(setup):
    """mergekit's contract: a registered method merges state dicts given only its defaults (its own suite
    checks every method so); with no data at all, every tensor is one without a Fisher entry."""
    from mergekit.merge_methods.api import merge_state_dicts

    root, models, _ = setup
    states = [read_model(models[0]), read_model(models[1])]
    for method in ("fisher", "regmean"):
        with pytest.warns(UserWarning, match="no input has a Fisher cache"):
            merged = merge_state_dicts(states, method, parameters={"weight": [1.0, 3.0]})
        for name, tensor in merged.items():
            assert torch.allclose(tensor, (states[0][name] + 3 * states[1][name]) / 4, rtol=1e-6, atol=1e-7)


def test_a_singular_gram_sum_is_refused_before_the_first_tensor(setup):
    """Opening the run (every check before mergekit merges a tensor) already solves nothing but finds Σ G̃ singular."""
    import yaml
    from mergekit.config import MergeConfiguration

    from graftmerge.pipeline.data_aware_merge import open_file_run
    from graftmerge.pipeline.data_aware_plan import plan_from_merge_config

    root, models, _ = setup
    parsed = MergeConfiguration.model_validate(yaml.safe_load(
        with_caches(root, models, ("singular0", "singular1"), "regmean", alpha=1.0)))
    with pytest.raises(GraftError, match="is singular: lower alpha"):
        open_file_run(plan_from_merge_config(parsed, ""), None)
    parsed = MergeConfiguration.model_validate(yaml.safe_load(
        with_caches(root, models, ("singular0", "singular1"), "regmean", alpha=0.5)))
    assert open_file_run(plan_from_merge_config(parsed, ""), None).weighted  # the ridge makes it solvable
