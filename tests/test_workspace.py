"""The fisher merge's span-by-span path: reused scratch buffers (reused, grown, kept apart per thread),
cache reads span by span equal to ordinary reads and value-checked as they are, and merges over any
span length equal to the whole-tensor average and to the float64 formula."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.math.fisher_average import FisherAverage
from graftmerge.math.workspace import Workspace
from graftmerge.pipeline.data_aware_merge import in_memory_run, merge_tensor
from tests.helpers.data_aware import make_models, write_both_cache
from tests.helpers.models import read_model


def test_a_slot_is_reused_grown_and_per_thread() -> None:
    workspace = Workspace()
    big = workspace.take("a", (4, 5), torch.float32)
    small = workspace.take("a", (3,), torch.float32)
    assert small.data_ptr() == big.data_ptr() and small.shape == (3,)
    grown = workspace.take("a", (30,), torch.float32)
    assert grown.shape == (30,) and workspace.take("a", (2, 2), torch.float32).data_ptr() == grown.data_ptr()
    assert workspace.take("b", (2,), torch.float32).data_ptr() != grown.data_ptr()
    assert workspace.take("a", (2,), torch.float64).dtype == torch.float64  # another dtype: a new buffer
    pointers = []
    thread = threading.Thread(target=lambda: pointers.append(workspace.take("a", (2,), torch.float64).data_ptr()))
    thread.start()
    thread.join()
    assert pointers[0] != workspace.take("a", (2,), torch.float64).data_ptr()
    workspace.release()
    assert workspace.take("a", (1,), torch.float32).numel() == 1


def brute_force(tensors, fishers, weights, epsilon):
    """θ = Σ w max(F, ε) θ / Σ w max(F, ε) in float64; the plain weighted average where the sum is 0."""
    numerator = sum(w * f.double().clamp_min(epsilon) * t.double() for t, f, w in zip(tensors, fishers, weights))
    denominator = sum(w * f.double().clamp_min(epsilon) for f, w in zip(fishers, weights))
    plain = sum(w * t.double() for t, w in zip(tensors, weights)) / sum(weights)
    return torch.where(denominator == 0, plain, numerator / denominator)


@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fisher_average_in_a_workspace_is_the_formula_tensor_after_tensor(epsilon: float, dtype) -> None:
    """Several tensors of different sizes through one workspace (buffers reused and regrown): each result
    equals the float64 formula and the workspace-free average bit for bit."""
    generator = torch.Generator().manual_seed(0)
    workspace = Workspace()
    for shape in [(7, 5), (3,), (11, 13), (7, 5)]:
        tensors = [torch.randn(shape, generator=generator).to(dtype) for _ in range(3)]
        fishers = [torch.rand(shape, generator=generator) ** 3 for _ in range(3)]
        fishers[1].view(-1)[::3] = 0  # one input blind on some coordinates
        for f in fishers:
            f.view(-1)[:2] = 0  # every input blind on two: the fallback (ε = 0) or the floor (ε > 0)
        weights = [1.0, 0.5, 2.0]
        buffered, plain = FisherAverage(epsilon, workspace=workspace), FisherAverage(epsilon)
        for tensor, fisher, weight in zip(tensors, fishers, weights):
            buffered.add(tensor, workspace.take("fisher", shape, torch.float32).copy_(fisher), weight)
            plain.add(tensor, fisher.clone(), weight)
        got = buffered.result().clone()
        assert torch.equal(got, plain.result())
        assert torch.allclose(got.double(), brute_force(tensors, fishers, weights, epsilon), rtol=1e-6, atol=1e-7)


@pytest.fixture()
def diagonal_cache(tmp_path, tied_models):
    post = Checkpoint(tied_models["post"])
    tensors = {n: torch.rand(i.shape) for n, i in post.tensors.items()}
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"], max_shard_bytes=20_000) as writer:
        for name, tensor in tensors.items():
            writer.add_diagonal(name, tensor)
    return tmp_path / "c", tensors


def test_spans_of_a_diagonal_equal_slices_of_the_ordinary_read(diagonal_cache) -> None:
    """Every span, at any start and length (the first, a middle, the last, empty), is the flattened
    ordinary read's slice, read into the caller's buffer."""
    path, tensors = diagonal_cache
    cache = open_fisher_cache(path)
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        with cache.diagonal_spans(name) as spans:
            assert spans.numel == flat.numel()
            for start, stop in [(0, flat.numel()), (0, 1), (flat.numel() // 3, flat.numel() // 2 + 1),
                                (flat.numel() - 1, flat.numel()), (flat.numel(), flat.numel())]:
                out = torch.full((stop - start,), float("nan"))
                assert spans.read(start, out) is out
                assert torch.equal(out, flat[start:stop]), (name, start, stop)
            with pytest.raises(ValueError, match="outside"):
                spans.read(flat.numel() - 1, torch.empty(2))
            with pytest.raises(ValueError, match="1-D contiguous float32"):
                spans.read(0, torch.empty(1, dtype=torch.float64))


def test_spans_of_a_cache_stored_in_another_dtype_are_converted(tmp_path, tied_models) -> None:
    """A cache whose diagonal is stored in bfloat16 (not float32 bytes to read in place) still reads by span."""
    post = Checkpoint(tied_models["post"])
    name, info = max(post.tensors.items(), key=lambda item: item[1].numel)
    tensor = torch.rand(info.shape).to(torch.bfloat16)
    with FisherCacheWriter(tmp_path / "c", model=tied_models["post"]) as writer:
        writer.add_diagonal(name, tensor)
    cache = open_fisher_cache(tmp_path / "c")
    with cache.diagonal_spans(name) as spans:
        out = torch.empty(5)
        assert torch.equal(spans.read(3, out), tensor.float().reshape(-1)[3:8])


def corrupt(cache, name: str, position: int, data: bytes) -> None:
    """Overwrite bytes of ``name``'s stored diagonal at element ``position`` (same size: the file's identity
    check is not what catches it)."""
    key = cache.entries[name]["diagonal"]["key"]
    layout = cache._layouts[cache._files[key]]
    begin, _ = layout.offsets[key]
    with open(layout.file, "r+b") as handle:
        handle.seek(layout.data_start + begin + 4 * position)
        handle.write(data)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_bad_value_in_a_span_is_refused_naming_the_cache_and_tensor(diagonal_cache, value) -> None:
    """What the buffer receives is checked as an ordinary read is; the spans before the bad one read fine."""
    path, tensors = diagonal_cache
    cache = open_fisher_cache(path)
    name = max(tensors, key=lambda n: tensors[n].numel())
    corrupt(cache, name, 100, torch.tensor([value], dtype=torch.float32).numpy().tobytes())
    with cache.diagonal_spans(name) as spans:
        spans.read(0, torch.empty(100))
        with pytest.raises(GraftError, match=f"Fisher cache {path}.*{name}.*(NaN or Inf|negative)"):
            spans.read(96, torch.empty(8))


def test_a_file_truncated_after_opening_is_a_clear_error(diagonal_cache) -> None:
    path, tensors = diagonal_cache
    cache = open_fisher_cache(path)
    name = max(tensors, key=lambda n: tensors[n].numel())
    key = cache.entries[name]["diagonal"]["key"]
    layout = cache._layouts[cache._files[key]]
    begin, end = layout.offsets[key]
    with cache.diagonal_spans(name) as spans:
        os.truncate(layout.file, layout.data_start + begin + (end - begin) // 2)
        with pytest.raises(GraftError, match="file ends before the tensor's bytes"):
            spans.read(0, torch.empty(spans.numel))


@pytest.mark.parametrize("span", [48, 1 << 18])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_fisher_merge_span_by_span_is_the_formula(tmp_path, span: int, dtype) -> None:
    """merge_tensor with spans that split the tensors (48: no tensor's size is a multiple) or none: the same
    result bit for bit, equal to the float64 formula, with one input's Fisher zero on half of every tensor."""
    models = make_models(tmp_path, "llama-untied")
    caches = []
    for index, model in enumerate(models):
        caches.append(tmp_path / f"fisher{index}")
        write_both_cache(caches[-1], model, seed=100 + index, zero=zero_first_half if index == 0 else None,
                         only_diagonal=True)
    states = [read_model(model) for model in models]
    ids, weights = ["a", "b", "c"], [1.0, 2.0, 0.5]
    tensors = {name: [state[name].to(dtype) for state in states] for name in states[0]}
    run = in_memory_run("fisher", ids, tensors, {name: dtype for name in tensors},
                        {"fisher": dict(zip(ids, map(str, caches))), "weight": dict(zip(ids, weights))})
    run.span = span
    for name, group in tensors.items():
        fishers = [open_fisher_cache(cache).diagonal(name) for cache in caches]
        got = merge_tensor(run, name, group)
        assert got.dtype == dtype and got.shape == group[0].shape
        reference = FisherAverage(run.plan.epsilon, torch.promote_types(dtype, torch.float32))
        for tensor, fisher, weight in zip(group, fishers, weights):
            reference.add(tensor, fisher.clone(), weight)
        assert torch.equal(got, reference.result().to(dtype)), name
        exact = brute_force(group, fishers, weights, run.plan.epsilon)
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
        assert torch.allclose(got.double(), exact, rtol=tolerance, atol=tolerance * 1e-1), name


def zero_first_half(name: str, diagonal: torch.Tensor) -> torch.Tensor:
    diagonal.reshape(-1)[: diagonal.numel() // 2] = 0
    return diagonal


def test_a_weight_without_a_diagonal_entry_is_one_clear_error(diagonal_cache) -> None:
    path, _ = diagonal_cache
    cache = open_fisher_cache(path)
    for read in (lambda: cache.diagonal("no.such.weight"), lambda: cache.diagonal_spans("no.such.weight").__enter__()):
        with pytest.raises(GraftError, match=f"Fisher cache {path} has no diagonal entry for 'no.such.weight'"):
            read()
