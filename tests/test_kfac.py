"""KFAC eigenbasis masks: against the dense Fisher they approximate, the diagonal
special case, the laws of docs/math.md#laws-the-masks-satisfy, a mixed global ranking through mergekit-yaml,
and a cache estimated by `graftmerge fisher estimate` driving real grafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graftmerge.formats.fisher_cache import KfacFactors, open_fisher_cache
from graftmerge.math.projection import TensorFisher, remove_masked, score_delta
from graftmerge.math.selection import masked_count, top_k_mask
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import spd, write_mixed_cache
from tests.helpers.models import read_model
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import run_cli


def eigen_factors(P: torch.Tensor, Q: torch.Tensor) -> KfacFactors:
    S, U = torch.linalg.eigh(P)
    D, V = torch.linalg.eigh(Q)
    return KfacFactors(U=U, S=S, V=V, D=D)


def kfac_mask(delta: torch.Tensor, factors: KfacFactors, rho: float) -> torch.Tensor:
    fisher = TensorFisher(kfac=factors)
    scored = score_delta(delta.clone(), fisher)
    mask = top_k_mask(scored.scores, masked_count(rho, scored.scores.numel()))
    return remove_masked(scored, mask, fisher)


def vec(matrix: torch.Tensor) -> torch.Tensor:
    """Column-stacking vec: the convention in which the Fisher of W is Q ⊗ P."""
    return matrix.T.reshape(-1)


@pytest.mark.parametrize("rho", [0.05, 0.2, 0.5])
def test_kfac_equals_exact_projection_when_fisher_is_a_kronecker_product(rho):
    g = torch.Generator().manual_seed(0)
    d_out, d_in = 6, 5
    P, Q = spd(d_out, g), spd(d_in, g)
    delta = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    dense = torch.kron(Q, P)  # dense Fisher of vec(Δ)
    eigenvalues, eigenvectors = torch.linalg.eigh(dense)
    components = eigenvectors.T @ vec(delta)
    exact_scores = eigenvalues * components.square()
    factors = eigen_factors(P, Q)
    ours = score_delta(delta.clone(), TensorFisher(kfac=factors)).scores.double()
    assert torch.allclose(torch.sort(ours.reshape(-1)).values, torch.sort(exact_scores).values, rtol=1e-5)

    k = masked_count(rho, delta.numel())
    top = torch.argsort(exact_scores, descending=True)[:k]
    projected = vec(delta) - eigenvectors[:, top] @ components[top]
    assert torch.allclose(vec(kfac_mask(delta, factors, rho)), projected, atol=1e-10)


def test_identity_bases_give_the_diagonal_mask():
    g = torch.Generator().manual_seed(1)
    d_out, d_in = 8, 6
    S = torch.randint(0, 4, (d_out,), generator=g).float()  # small integers: σ dᵀ is exact
    D = torch.randint(0, 4, (d_in,), generator=g).float()
    delta = torch.randint(-3, 4, (d_out, d_in), generator=g).float() / 4  # ties included
    for rho in (0.0, 0.05, 0.3, 0.9):
        kfac = kfac_mask(delta, KfacFactors(U=torch.eye(d_out), S=S, V=torch.eye(d_in), D=D), rho)
        fisher = TensorFisher(diagonal=S[:, None] * D[None, :])
        scored = score_delta(delta.clone(), fisher)
        diagonal = remove_masked(scored, top_k_mask(scored.scores, masked_count(rho, delta.numel())), fisher)
        assert torch.equal(kfac, diagonal), rho


def test_rho_zero_is_bit_for_bit_and_retention_cost_is_non_increasing():
    g = torch.Generator().manual_seed(2)
    P, Q = spd(12, g, torch.float32), spd(7, g, torch.float32)
    delta = torch.randn(12, 7, generator=g)
    factors = eigen_factors(P.double(), Q.double())
    factors = KfacFactors(*(t.float() for t in (factors.U, factors.S, factors.V, factors.D)))
    assert torch.equal(kfac_mask(delta, factors, 0.0), delta)
    dense = torch.kron(Q.double(), P.double())
    costs = []
    for rho in (0.0, 0.01, 0.05, 0.1, 0.3, 0.6, 0.99):
        masked = vec(kfac_mask(delta, factors, rho)).double()
        costs.append(float(masked @ dense @ masked))
    assert all(a >= b - 1e-9 * costs[0] for a, b in zip(costs, costs[1:])), costs
    assert costs[-1] < 0.05 * costs[0]


@pytest.mark.parametrize("row_blocks", [False, True], ids=["whole tensors", "row blocks"])
def test_mixed_cache_global_graft_equals_brute_force(tmp_path, tied_models, row_blocks, monkeypatch):
    m = tied_models
    cache = write_mixed_cache(tmp_path / "fisher-mixed", m["post"])
    assert open_fisher_cache(cache).kind == "mixed"
    fine_tunes = [(m["donor_ft"], 0.5)]
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], fine_tunes, rho=0.02, fisher=cache))
    if row_blocks:  # in-process, so the tiny block size reaches the threshold pass and the kernel
        from click.testing import CliRunner
        from mergekit.scripts.run_yaml import main

        from graftmerge.adapter import import_hook
        from graftmerge.pipeline import graft_plan

        import_hook.install()
        monkeypatch.setattr(graft_plan, "BLOCK_ELEMENTS", 1000)
        monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "threshold-cache"))
        result = CliRunner().invoke(main, [str(config), str(tmp_path / "out")])
        assert result.exit_code == 0, result.output[-2000:]
    else:
        result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"))
        assert result.returncode == 0, result.stderr[-2000:]
    got = read_model(tmp_path / "out")
    expected = brute_force_graft(m["post"], m["donor"], fine_tunes, cache, 0.02).expected
    post = read_model(m["post"])
    for name in expected:
        # Same masked set ⇒ equal up to matmul rounding; a different set moves whole directions.
        assert torch.allclose(got[name], expected[name], atol=1e-6, rtol=0), name
        assert not torch.equal(got[name], post[name])


def rollouts_file(path: Path, vocab: int, count: int = 6, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    lines = []
    for n in range(count):
        prompt = torch.randint(0, vocab, (3 + n % 3,), generator=g).tolist()
        completion = torch.randint(0, vocab, (4 + n % 4,), generator=g).tolist()
        lines.append(json.dumps({"prompt_ids": prompt, "completion_ids": completion}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_estimated_cache_drives_kfac_and_diagonal_grafts(tmp_path, tied_models):
    m = tied_models
    rollouts = rollouts_file(tmp_path / "rollouts.jsonl", vocab=256)
    cache = tmp_path / "fisher" / "post-both"
    estimate = run_cli("graftmerge", "fisher", "estimate", str(m["post"]), "-o", str(cache), "--kind", "both",
                       "--rollouts", str(rollouts), "--no-progress")
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    fisher = open_fisher_cache(cache)
    assert fisher.names("kfac") and fisher.names("diagonal")
    post, donor, ft = read_model(m["post"]), read_model(m["donor"]), read_model(m["donor_ft"])
    outputs = {}
    for mask in ("kfac", "diagonal"):
        config = tmp_path / f"{mask}.yml"
        config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.01, fisher=cache, mask=mask))
        result = run_cli("mergekit-yaml", str(config), str(tmp_path / mask))
        assert result.returncode == 0, result.stderr[-2000:]
        outputs[mask] = read_model(tmp_path / mask)
    for name in post:
        full = ft[name] - donor[name]
        diagonal_applied = outputs["diagonal"][name] - post[name]
        if fisher.has(name, "diagonal"):
            diagonal = fisher.diagonal(name)
            assert float((diagonal * diagonal_applied.square()).sum()) <= float((diagonal * full.square()).sum()) * (
                1 + 1e-5
            )
    name = "model.layers.0.mlp.down_proj.weight"
    assert fisher.representation(name) == "kfac"
    f = fisher.kfac(name)
    kfac_cost = lambda d: float((((f.U.T @ d) @ f.V).square() * f.S[:, None] * f.D[None, :]).sum())  # noqa: E731
    full = ft[name] - donor[name]
    assert kfac_cost(outputs["kfac"][name] - post[name]) < kfac_cost(full)
