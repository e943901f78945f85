"""The §3 minimal model: Eq. 1 against autograd and a closed form, and the demo's contracts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from graftmerge.demo.gated_experts import (
    METHODS,
    GatedExpertsConfig,
    expert_gradients,
    format_gated_experts,
    gate,
    loss_a_at,
    make_tasks,
    pareto_frontier,
    plot_gated_experts,
    run_gated_experts,
    split,
)

SMALL = GatedExpertsConfig(seed=3, n_train=128, n_test=256, pretrain_steps=400, pretrain_restarts=2,
                           posttrain_steps=200, finetune_lrs=(0.03,), finetune_steps=(5, 20),
                           lambdas=(0.0, 0.5, 1.0))


@pytest.fixture(scope="module")
def default_result() -> dict:
    return run_gated_experts(GatedExpertsConfig())


def _random_problem(seed: int, d: int = 7, n: int = 50):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(3 * d, generator=gen, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) + 1.0
    beta = torch.randn(d, generator=gen, dtype=torch.float64)
    return theta, x, beta


@pytest.mark.parametrize("eps", [0.0, 0.03, 0.25, 0.5, 0.9])
def test_eq1_ratio_exact_with_constant_gate(eps: float) -> None:
    theta, x, beta = _random_problem(0)
    g_a, g_b = expert_gradients(theta, x, x @ beta, constant_gate=eps)
    assert float(g_a.norm() / g_b.norm()) == pytest.approx(eps / (1 - eps), rel=1e-12, abs=1e-15)


def test_constant_gate_gradients_match_closed_form() -> None:
    """∇_{w_A} L_B = ε Σ_B r_B, ∇_{w_B} L_B = (1 − ε) Σ_B r_B with r_B = ε w_A + (1 − ε) w_B − β_B."""
    eps = 0.2
    theta, x, beta = _random_problem(1)
    w_a, w_b, _ = split(theta)
    sigma = x.T @ x / x.shape[0]
    r = eps * w_a + (1 - eps) * w_b - beta
    g_a, g_b = expert_gradients(theta, x, x @ beta, constant_gate=eps)
    torch.testing.assert_close(g_a, eps * sigma @ r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_b, (1 - eps) * sigma @ r, rtol=1e-12, atol=1e-12)


def test_learned_gate_gradients_match_per_sample_sum() -> None:
    """With g_φ(x) learned, the same routing holds per sample: ∇_{w_A} = mean g·(ŷ − y)·x."""
    theta, x, beta = _random_problem(2)
    w_a, w_b, phi = split(theta)
    y = x @ beta
    g_a = torch.zeros_like(w_a)
    g_b = torch.zeros_like(w_b)
    for xi, yi in zip(x, y):
        g = 1 / (1 + torch.exp(-(phi @ xi)))
        err = g * (w_a @ xi) + (1 - g) * (w_b @ xi) - yi
        g_a += g * err * xi / len(x)
        g_b += (1 - g) * err * xi / len(x)
    auto_a, auto_b = expert_gradients(theta, x, y)
    torch.testing.assert_close(auto_a, g_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(auto_b, g_b, rtol=1e-12, atol=1e-12)


def test_frontier_and_interpolation() -> None:
    points = [{"loss_a": a, "loss_b": b} for a, b in [(1, 5), (2, 3), (3, 4), (4, 1), (0.5, 9)]]
    front = pareto_frontier(points)
    assert [(p["loss_a"], p["loss_b"]) for p in front] == [(0.5, 9), (1, 5), (2, 3), (4, 1)]
    assert loss_a_at(front, 9) == 0.5
    assert loss_a_at(front, 2) == pytest.approx(3.0)
    assert loss_a_at(front, 0.5) is None


def test_graft_at_lambda_zero_is_post_exactly() -> None:
    result = run_gated_experts(SMALL)
    post = result["post_losses"]
    for method in ("graft", "sft_merge"):
        zero = [p for p in result["curves"][method] if p["lam"] == 0.0]
        assert zero
        for point in zero:
            assert (point["loss_a"], point["loss_b"]) == (post["loss_a"], post["loss_b"])


def test_deterministic_for_a_seed() -> None:
    assert run_gated_experts(SMALL) == run_gated_experts(SMALL)
    assert run_gated_experts(SMALL) != run_gated_experts(replace(SMALL, seed=4))


def test_default_post_training_raises_task_b_gate(default_result: dict) -> None:
    assert 0 < default_result["eps_donor"] < default_result["eps_post"] < 0.5
    assert default_result["gate_on_a_donor"] > 0.5  # pretraining learned the assignment
    tasks = make_tasks(GatedExpertsConfig())
    assert tasks.x_b.shape == (GatedExpertsConfig().n_train, GatedExpertsConfig().dim)
    for eq in default_result["eq1"].values():
        assert eq["rel_error_constant_gate"] < 1e-12


def test_result_is_json_and_summarised(default_result: dict) -> None:
    assert json.loads(json.dumps(default_result)) == default_result
    assert set(default_result["curves"]) == set(METHODS)
    text = format_gated_experts(default_result)
    assert "ε_D" in text and "Eq. 1" in text and "50%" in text


def test_plot_written(default_result: dict, tmp_path) -> None:
    path = plot_gated_experts(default_result, tmp_path / "sub" / "gated.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gate_is_sigmoid_of_phi() -> None:
    theta, x, _ = _random_problem(5)
    torch.testing.assert_close(gate(theta, x), torch.sigmoid(x @ split(theta)[2]))
