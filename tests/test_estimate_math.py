"""The estimator's numbers against brute force, in float64, on tiny Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.estimate.accumulator import FisherAccumulator
from tests.helpers.estimation import (
    accumulate,
    brute_force_diagonal,
    brute_force_kfac,
    load,
    make_model,
    random_rollouts,
    relative_error,
)

ROLLOUTS = random_rollouts(7, seed=3)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def case(request, tmp_path_factory):
    """(model, brute-force diagonal, brute-force KFAC) for a tied and an untied model."""
    folder = make_model(tmp_path_factory.mktemp("model") / "post", tied=request.param)
    model = load(folder)
    reference = brute_force_diagonal(model, ROLLOUTS), brute_force_kfac(model, ROLLOUTS)
    return request.param, model, *reference


def test_diagonal_equals_squared_per_sequence_gradients(case):
    tied, model, diagonal_reference, _ = case
    # a tiny chunk size forces the chunked per-sequence gradient path
    diagonal, _ = accumulate(model, ROLLOUTS, 3, kind="diagonal", max_chunk_elements=500)
    names = {n for n, _ in model.named_parameters()}
    assert set(diagonal) == names  # every floating parameter: embeddings, norms, lm_head
    for name, value in diagonal.items():
        assert relative_error(value, diagonal_reference[name]) < 1e-10, name
    assert ("lm_head.weight" in diagonal) != tied


def test_kfac_factors_equal_captured_activations_and_gradients(case):
    tied, model, diagonal_reference, kfac_reference = case
    diagonal, kfac = accumulate(model, ROLLOUTS, 4, kind="kfac")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    expected = {f"{n}.weight" for n in linears if not (tied and n == "lm_head")}
    if not tied:
        expected.add("model.embed_tokens.weight")
    assert set(kfac) == expected
    assert not any(t.requires_grad for pair in kfac.values() for t in pair)  # no graph kept
    for name, (P, Q) in kfac.items():
        reference = kfac_reference[name.removesuffix(".weight")]
        if name == "lm_head.weight":  # vocabulary side kept diagonal
            assert P.ndim == 1
            assert relative_error(P, reference["P"].diagonal()) < 1e-10
        else:
            assert relative_error(P, reference["P"]) < 1e-10, name
        assert relative_error(Q, reference["Q"]) < 1e-10, name
    # --kind kfac: everything without factors (norms, a tied embedding) stays diagonal
    assert set(diagonal).isdisjoint(kfac)
    assert all(n.endswith("norm.weight") or (tied and "embed" in n) for n in diagonal)
    for name, value in diagonal.items():
        assert relative_error(value, diagonal_reference[name]) < 1e-10, name


def test_padding_and_batch_size_do_not_change_numbers(case):
    _, model, _, _ = case
    one_diagonal, one_kfac = accumulate(model, ROLLOUTS, 1, kind="both")
    many_diagonal, many_kfac = accumulate(model, ROLLOUTS, 5, kind="both")
    for name in one_diagonal:
        assert relative_error(many_diagonal[name], one_diagonal[name]) < 1e-12, name
    for name in one_kfac:
        for x, y in zip(many_kfac[name], one_kfac[name], strict=True):
            assert relative_error(x, y) < 1e-12, name


def test_shared_inputs_give_bit_identical_input_factors(case):
    _, model, _, _ = case
    _, kfac = accumulate(model, ROLLOUTS, 4, kind="kfac")
    layer = "model.layers.0"
    q, k, v = (kfac[f"{layer}.self_attn.{p}_proj.weight"][1] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v)
    assert torch.equal(
        kfac[f"{layer}.mlp.gate_proj.weight"][1], kfac[f"{layer}.mlp.up_proj.weight"][1]
    )


def test_modules_glob_restricts_the_estimate(case):
    _, model, diagonal_reference, _ = case
    diagonal, kfac = accumulate(
        model, ROLLOUTS, 4, kind="both", modules=["*.mlp.*", "model.norm.*"]
    )
    assert set(kfac) == {
        f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")
    }
    assert set(diagonal) == set(kfac) | {"model.norm.weight"}
    for name, value in diagonal.items():
        assert relative_error(value, diagonal_reference[name]) < 1e-10, name
    with pytest.raises(GraftError, match="matches no floating parameter"):
        FisherAccumulator(model, modules=["nothing.*"])
