"""`graftmerge suggest`: the knee and KL-budget rules as pure functions, and the command against a
whole-model brute force on generated tiny models."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.math.suggestion import (
    default_rho_grid,
    kl_budget_lambda,
    kneedle_differences,
    predicted_kl,
    removed_share_knee,
)
from graftmerge.pipeline.suggest import mean_completion_tokens, suggest_graft
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import read_model, tree_digest
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import one_line_error

TINY = torch.finfo(torch.float32).tiny
DECADES = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]  # x_norm = 0, 0.25, 0.5, 0.75, 1


# -- the knee rule -----------------------------------------------------------------------------


def test_default_grid_is_1_2_5_per_decade():
    grid = default_rho_grid()
    assert grid[:4] == [1e-5, 2e-5, 5e-5, 1e-4] and grid[-3:] == [0.1, 0.2, 0.5] and len(grid) == 15
    assert all(b > a for a, b in zip(grid, grid[1:]))
    assert [repr(r) for r in grid][6] == "0.001"  # round values paste as typed


def test_knee_of_a_concave_curve_is_the_point_farthest_above_the_chord():
    removed = [0.1, 0.8, 0.9, 0.95, 1.0]
    # by hand: R_norm = (R − 0.1)/0.9 = 0, .778, .889, .944, 1; minus x_norm = 0, .528, .389, .194, 0
    differences = kneedle_differences(DECADES, removed)
    assert differences == pytest.approx([0, 0.7 / 0.9 - 0.25, 0.8 / 0.9 - 0.5, 0.85 / 0.9 - 0.75, 0], abs=1e-12)
    knee = removed_share_knee(DECADES, removed)
    assert (knee.rho, knee.index, knee.found) == (1e-4, 1, True)
    # normalisation: scaling R, or a grid spanning other decades with the same spacing, moves nothing
    assert removed_share_knee(DECADES, [0.5 * r for r in removed]).index == 1
    assert removed_share_knee([1e-6, 1e-5, 1e-4, 1e-3, 1e-2], removed).rho == 1e-5


def test_knee_of_a_saturating_curve_on_a_dense_grid():
    # R(ρ) = 1 − exp(−ρ/ρ0) saturates around ρ0: the knee sits just above ρ0 on the log axis
    grid = [10 ** (e / 8) for e in range(-40, -2)]
    rho0 = 1e-3
    removed = [1 - math.exp(-rho / rho0) for rho in grid]
    knee = removed_share_knee(grid, removed)
    differences = kneedle_differences(grid, removed)
    assert knee.found and knee.index == max(range(len(grid)), key=lambda i: differences[i])
    assert rho0 <= knee.rho <= 10 * rho0


def test_knee_of_a_step_takes_the_top_of_the_step():
    knee = removed_share_knee(DECADES, [0.0, 0.0, 0.9, 0.95, 1.0])
    assert (knee.index, knee.found) == (2, True)


def test_knee_ties_go_to_the_smaller_rho():
    # differences 0, .25, .25, 0, 0
    knee = removed_share_knee(DECADES, [0.0, 0.5, 0.75, 0.75, 1.0])
    assert kneedle_differences(DECADES, [0.0, 0.5, 0.75, 0.75, 1.0])[1:3] == pytest.approx([0.25, 0.25])
    assert knee.index == 1


def test_knee_edge_cases():
    nothing = removed_share_knee(DECADES, [0.0] * 5)
    assert (nothing.rho, nothing.index, nothing.found) == (0.0, None, False) and "nothing" in nothing.reason
    single = removed_share_knee([0.01], [0.3])
    assert (single.rho, single.index, single.found) == (0.01, 0, False) and "single" in single.reason
    assert removed_share_knee([0.01], [0.0]).rho == 0.0
    saturated = removed_share_knee(DECADES, [1 - 1e-8, 1.0, 1.0, 1.0, 1.0])
    assert (saturated.rho, saturated.found) == (1e-5, False) and "extend the grid downward" in saturated.reason
    flat = removed_share_knee(DECADES, [0.3] * 5)
    assert (flat.rho, flat.found) == (1e-5, False) and "flat" in flat.reason
    straight = removed_share_knee(DECADES, [0.0, 0.25, 0.5, 0.75, 1.0])  # linear in log ρ: on the chord
    assert (straight.rho, straight.found) == (1e-5, False) and "not concave" in straight.reason
    convex = removed_share_knee(DECADES, [0.001, 0.01, 0.1, 0.4, 1.0])
    assert (convex.rho, convex.found) == (1e-5, False)


@pytest.mark.parametrize(
    "rhos, removed",
    [
        ([], []),
        ([0.0, 0.1], [0.0, 0.5]),
        ([0.1, 1.0], [0.0, 0.5]),
        ([0.1, 0.01], [0.1, 0.5]),
        ([0.01, 0.01], [0.1, 0.5]),
        ([0.01, 0.1], [0.1]),
        ([0.01, 0.1], [0.1, 1.5]),
        ([0.01, 0.1], [0.1, float("nan")]),
    ],
)
def test_knee_refuses_bad_grids_and_curves(rhos, removed):
    with pytest.raises(ValueError):
        removed_share_knee(rhos, removed)


# -- the λ rule --------------------------------------------------------------------------------


def test_lambda_from_kl_budget_by_hand():
    # T̄ = 100, Δ'ᵀFΔ' = 0.8, κ = 0.05: λ = sqrt(2·0.05 / (100·0.8)) = sqrt(0.00125)
    choice = kl_budget_lambda(0.8, 100.0, 0.05, max_lambda=1.0)
    assert choice.lam == pytest.approx(0.035355339059327376, rel=1e-15) and choice.bound == "budget"
    assert choice.predicted_kl == pytest.approx(0.05, rel=1e-14)
    assert choice.predicted_kl == 0.5 * 100 * choice.lam * choice.lam * 0.8
    assert predicted_kl(0.5, 0.8, 100.0) == pytest.approx(10.0)
    capped = kl_budget_lambda(1e-4, 10.0, 0.05, max_lambda=1.0)  # budget allows sqrt(100) = 10
    assert (capped.lam, capped.bound) == (1.0, "cap") and capped.unclamped == pytest.approx(10.0)
    assert capped.predicted_kl == pytest.approx(0.5 * 10 * 1e-4) and capped.predicted_kl < 0.05
    assert kl_budget_lambda(1e-4, 10.0, 0.05, max_lambda=20.0).lam == pytest.approx(10.0)
    nothing = kl_budget_lambda(0.0, 10.0, 0.05, max_lambda=0.7)
    assert (nothing.lam, nothing.unclamped, nothing.predicted_kl) == (0.7, math.inf, 0.0)
    for bad in [(0.8, 1.0, -0.05, 1.0), (0.8, 1.0, 0.0, 1.0), (0.8, 1.0, 0.05, 0.0), (0.8, 0.0, 0.05, 1.0),
                (-1.0, 1.0, 0.05, 1.0), (float("nan"), 1.0, 0.05, 1.0)]:
        with pytest.raises(ValueError):
            kl_budget_lambda(*bad)


def test_mean_tokens_from_manifest_counts():
    assert mean_completion_tokens({"sequences": 8, "completion_tokens": 200})[:2] == (
        25.0, "200 completion tokens / N = 8 rollouts (cache manifest)")
    assert mean_completion_tokens({"sequences": 8, "completion_tokens": 200})[2] is None
    for counts in [None, {}, {"sequences": 8}, {"sequences": 0, "completion_tokens": 5}, {"tokens": 100}]:
        mean, _, note = mean_completion_tokens(counts)
        assert mean == 1.0 and "T̄ = 1" in note


# -- end to end on tiny models -----------------------------------------------------------------

COUNTS = {"sequences": 8, "tokens": 320, "completion_tokens": 200, "prompt_tokens": 120}  # T̄ = 25


def write_heavy_cache(path: Path, post: Path, seed: int = 1) -> Path:
    """A diagonal cache with a heavy-tailed Fisher (R(ρ) has a knee) and token counts in the manifest."""
    generator = torch.Generator().manual_seed(seed)
    with FisherCacheWriter(path, model=post, counts=COUNTS, overwrite=True) as writer:
        for name, info in Checkpoint(post).tensors.items():
            writer.add_diagonal(name, torch.rand(info.shape, generator=generator) ** 30)
    return path


@pytest.fixture(scope="module")
def caches(tied_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("suggest-fisher")
    return {"heavy": write_heavy_cache(root / "heavy", tied_models["post"]),
            "mixed": write_mixed_cache(root / "mixed", tied_models["post"], seed=4)}


def brute_fisher(cache_path: Path, names) -> dict[str, tuple]:
    """Per ranked tensor: ('diagonal', F) or ('kfac', P, Q) as dense float64 factors."""
    cache = open_fisher_cache(cache_path)
    out = {}
    for n in names:
        if cache.representation(n) == "kfac":
            f = cache.kfac(n)
            P = torch.diag(f.S.double()) if f.U is None else f.U.double() @ torch.diag(f.S.double()) @ f.U.double().T
            Q = torch.diag(f.D.double()) if f.V is None else f.V.double() @ torch.diag(f.D.double()) @ f.V.double().T
            out[n] = ("kfac", P, Q)
        elif cache.representation(n) == "diagonal":
            out[n] = ("diagonal", cache.diagonal(n).double())
    return out


def quadratic(fisher: dict[str, tuple], delta: dict[str, torch.Tensor]) -> float:
    """vec(δ)ᵀ F vec(δ) over the ranked tensors: Σ F δ², or tr(δᵀ P δ Q) for Q ⊗ P."""
    total = 0.0
    for n, entry in fisher.items():
        d = delta[n].double()
        total += (
            float((entry[1] * d * d).sum())
            if entry[0] == "diagonal"
            else float(torch.trace(d.T @ entry[1] @ d @ entry[2]))
        )
    return total


def brute_shares(models, weight: float, fisher: dict[str, tuple], rhos) -> list[float]:
    """R(ρ) for every ρ: the whole model's scores at lambda 1, one stable sort, top ⌈ρ·D⌉ (docs/math.md#the-threshold)."""
    donor, ft = read_model(models["donor"]), read_model(models["donor_ft"])
    scores = []
    for n, entry in fisher.items():
        delta = weight * (ft[n].float() - donor[n].float())
        if entry[0] == "diagonal":
            scores.append((entry[1].float() * delta.square()).reshape(-1))
        else:
            eigen = kfac_pair_scores(entry)
            scores.append(eigen(delta).reshape(-1))
    flat = torch.cat(scores)
    order = torch.sort(flat, descending=True, stable=True)
    total = float(flat.double().sum())
    shares = []
    for rho in rhos:
        k = math.ceil(Fraction(repr(rho)) * flat.numel())
        top = order.values[:k]
        shares.append(float(top[top >= TINY].double().sum()) / total)
    return shares


def kfac_pair_scores(entry):
    """KFAC scores σ_i d_j (UᵀΔV)² from dense P, Q (their own eigendecomposition: same pair scores)."""
    _, P, Q = entry
    sigma, U = torch.linalg.eigh(P)
    d, V = torch.linalg.eigh(Q)
    return lambda delta: ((U.T @ delta.double() @ V).square() * sigma[:, None] * d[None, :]).float()


@pytest.mark.parametrize("cache_kind", ["heavy", "mixed"])
def test_suggestion_equals_brute_force(tmp_path, tied_models, caches, cache_kind):
    m, weight = tied_models, 0.5
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], weight)], rho=0.01, lam=0.7,
                                 fisher=caches[cache_kind]))
    before = tree_digest(m["post"].parent), tree_digest(caches[cache_kind])
    s = suggest_graft(str(config), kl_budget=0.01, progress=False)
    assert (tree_digest(m["post"].parent), tree_digest(caches[cache_kind])) == before
    fisher = brute_fisher(caches[cache_kind], sorted(read_model(m["post"])))
    assert s.rho_grid == default_rho_grid() and s.config_lambda == 0.7 and s.config_rho == 0.01

    # R(ρ) against the whole flattened model (KFAC pair scores from a fresh eigendecomposition of P, Q)
    assert s.removed_share == pytest.approx(brute_shares(m, weight, fisher, s.rho_grid), rel=1e-4, abs=1e-7)
    assert all(b >= a - 1e-12 for a, b in zip(s.removed_share, s.removed_share[1:]))

    # the knee is the pure rule applied to that curve
    knee = removed_share_knee(s.rho_grid, s.removed_share)
    assert (s.rho, s.knee_index, s.knee_found) == (knee.rho, knee.index, knee.found)
    if cache_kind == "heavy":
        assert s.knee_found and 0 < s.rho < 0.5

    # Δ'ᵀFΔ' at ρ*, lambda 1: graft with the brute force of tests.helpers.references, dense Fisher quadratic of (θ − θpost)
    post = read_model(m["post"])
    grafted = brute_force_graft(m["post"], m["donor"], [(m["donor_ft"], weight)], caches[cache_kind], s.rho).expected
    delta_prime = {n: grafted[n].double() - post[n].double() for n in post}
    assert s.masked_quadratic == pytest.approx(quadratic(fisher, delta_prime), rel=1e-4)
    donor, ft = read_model(m["donor"]), read_model(m["donor_ft"])
    full = {n: weight * (ft[n].double() - donor[n].double()) for n in post}
    assert s.score_mass == pytest.approx(quadratic(fisher, full), rel=1e-4)
    assert s.masked_quadratic == pytest.approx(s.score_mass * (1 - s.removed_at_rho), rel=1e-9, abs=1e-12)

    # λ* and the KL it predicts; grafting with λ* reproduces that KL: (T̄/2)(θ − θpost)ᵀF(θ − θpost)
    mean_tokens = 25.0 if cache_kind == "heavy" else 1.0
    assert s.mean_tokens == mean_tokens
    assert any(note.startswith("the Fisher cache manifest records no token counts") for note in s.notes) == (
        cache_kind == "mixed")
    expected = min(1.0, math.sqrt(2 * 0.01 / (mean_tokens * s.masked_quadratic)))
    assert s.lam == pytest.approx(expected, rel=1e-12) and s.lam_bound == "budget"
    assert s.predicted_kl == pytest.approx(0.01, rel=1e-12)
    at_lambda = brute_force_graft(m["post"], m["donor"], [(m["donor_ft"], s.lam * weight)], caches[cache_kind],
                                  s.rho).expected
    delta = {n: at_lambda[n].double() - post[n].double() for n in post}
    assert mean_tokens / 2 * quadratic(fisher, delta) == pytest.approx(s.predicted_kl, rel=1e-3)


def test_cli_prints_table_snippet_and_json(tmp_path, tied_models, caches):
    m = tied_models
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5)], rho=0.01, fisher=caches["heavy"]))
    result = CliRunner().invoke(main, ["suggest", str(config), "--no-progress", "--kl-budget", "0.02",
                                       "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data == json.loads(json.dumps(suggest_graft(str(config), kl_budget=0.02, progress=False).to_dict()))
    lines = result.output.splitlines()
    marked = [line for line in lines if line.endswith("<- knee")]
    assert len(marked) == 1 and float(marked[0].split()[0]) == data["rho"]
    assert any("Δ'ᵀFΔ'" in line and format(data["masked_quadratic"], ".6g") in line for line in lines)
    assert any(line.startswith("  T̄") and "25" in line for line in lines)
    snippet = yaml.safe_load(result.output[result.output.index("parameters:"):])["parameters"]
    assert snippet["rho"] == data["rho"] and snippet["lambda"] == pytest.approx(data["lam"], rel=1e-5)
    assert snippet["fisher"] == str(caches["heavy"]) and data["snippet"].startswith("parameters:")
    # the pasted snippet is a valid graft config
    pasted = yaml.safe_load(config.read_text())
    pasted["parameters"] = snippet
    (tmp_path / "pasted.yml").write_text(yaml.safe_dump(pasted))
    again = CliRunner().invoke(
        main, ["plan", str(tmp_path / "pasted.yml"), "--rho", repr(data["rho"]), "--no-progress"]
    )
    assert again.exit_code == 0, again.output


def test_custom_grid_and_fisher_for_an_unmasked_config(tmp_path, tied_models, caches):
    m = tied_models
    config = tmp_path / "plain.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]))  # rho 0, no fisher
    result = CliRunner().invoke(main, ["suggest", str(config), "--no-progress", "--fisher", str(caches["heavy"]),
                                       "--rho-grid", "0.1,0.001,0.01", "--max-lambda", "2",
                                       "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["rho_grid"] == [0.001, 0.01, 0.1] and data["fisher"] == str(caches["heavy"])
    assert data["max_lambda"] == 2.0 and data["lam"] <= 2.0
    with pytest.raises(GraftError, match="suggest needs a Fisher cache"):
        suggest_graft(str(config), progress=False)


def test_a_zero_delta_suggests_no_mask(tmp_path, tied_models, caches):
    m = tied_models
    config = tmp_path / "zero.yml"  # donor_ft = donor: Δ = 0, nothing to remove, nothing to spend
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.0)], rho=0.01, fisher=caches["heavy"]))
    s = suggest_graft(str(config), progress=False)
    assert (s.rho, s.knee_index, s.removed_share) == (0.0, None, [0.0] * len(s.rho_grid))
    assert (s.masked_quadratic, s.lam, s.lam_bound, s.predicted_kl) == (0.0, 1.0, "cap", 0.0)
    assert s.to_dict()["lam_unclamped"] is None and "rho: 0.0" in s.snippet() and "fisher" not in s.snippet()


@pytest.mark.parametrize(
    "extra, config, fragment",
    [
        ([], "nofisher", "suggest needs a Fisher cache"),
        (["--fisher", "{missing}"], "nofisher", "does not exist"),
        (["--rho-grid", ""], "config", "comma-separated"),
        (["--rho-grid", "0.1,abc"], "config", "not a number"),
        (["--rho-grid", "0,0.1"], "config", "log grid"),
        (["--rho-grid", "0.1,1.5"], "config", "[0, 1)"),
        (["--rho-grid", "0.1,0.1"], "config", "twice"),
        (["--kl-budget", "-0.05"], "config", "--kl-budget must be a finite number > 0"),
        (["--kl-budget", "0"], "config", "--kl-budget must be a finite number > 0"),
        (["--kl-budget", "nan"], "config", "--kl-budget must be a finite number > 0"),
        (["--kl-budget", "lots"], "config", "not a number"),
        (["--max-lambda", "0"], "config", "--max-lambda must be a finite number > 0"),
        ([], "linear", "graft config"),
    ],
)
def test_bad_inputs_one_line_exit_2(tmp_path, tied_models, caches, extra, config, fragment):
    m = tied_models
    (tmp_path / "config.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.01,
                                                    fisher=caches["heavy"]))
    (tmp_path / "nofisher.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]))
    (tmp_path / "linear.yml").write_text(
        f"merge_method: linear\nmodels:\n  - model: {m['post']}\n    parameters: {{weight: 1.0}}\n"
        f"  - model: {m['donor']}\n    parameters: {{weight: 1.0}}\ndtype: float32\n")
    args = ["suggest", str(tmp_path / f"{config}.yml"), "--no-progress",
            *[part.format(missing=tmp_path / "no-such-cache") for part in extra]]
    line = one_line_error(CliRunner().invoke(main, args))
    assert fragment in line, line
