"""Reused scratch buffers: the Fisher average with a workspace equals the float64 formula, and cache reads
into a buffer equal ordinary reads; buffers are reused, grown and kept apart per thread."""

from __future__ import annotations

import threading

import pytest
import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from graftmerge.math.fisher_average import FisherAverage
from graftmerge.math.workspace import Workspace


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


def test_a_diagonal_read_into_a_buffer_equals_the_ordinary_read(diagonal_cache) -> None:
    path, tensors = diagonal_cache
    cache, workspace = open_fisher_cache(path), Workspace()
    for name, tensor in tensors.items():
        out = workspace.take("fisher", tensor.shape, torch.float32).fill_(float("nan"))
        assert cache.diagonal(name, out=out) is out
        assert torch.equal(out, tensor) and torch.equal(out, cache.diagonal(name))
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="contiguous float32 tensor of shape"):
        cache.diagonal(name, out=torch.empty(tensors[name].shape, dtype=torch.float64))


def test_a_bad_value_read_into_a_buffer_is_still_refused(diagonal_cache) -> None:
    """What the buffer receives is checked as an ordinary read is: a NaN written into the file is refused."""
    path, tensors = diagonal_cache
    cache = open_fisher_cache(path)
    name = max(tensors, key=lambda n: tensors[n].numel())
    key = cache.entries[name]["diagonal"]["key"]
    layout = cache._layouts[cache._files[key]]
    begin, _ = layout.offsets[key]
    with open(layout.file, "r+b") as handle:  # same size: the file's identity check is not what catches it
        handle.seek(layout.data_start + begin)
        handle.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())
    with pytest.raises(GraftError, match=f"{name}.*contains NaN or Inf"):
        cache.diagonal(name, out=torch.empty(tensors[name].shape))
