"""Shared fixtures: tiny generated checkpoints, an isolated graftmerge cache dir, and the
command-line runners: :func:`run_cli` (in this process) and :func:`run_process` (a real one)."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import traceback
from fractions import Fraction
from math import ceil
from pathlib import Path
from typing import NamedTuple

# Offline before huggingface_hub is imported (it reads the variable once, at import), so
# in-process merges are offline even in a plain `pytest` run without scripts/test.sh.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from graftmerge.formats.checkpoint import Checkpoint  # noqa: E402
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache  # noqa: E402
from graftmerge.testing.tiny_models import make_graft_inputs, save_tiny_model  # noqa: E402

BIN = Path(sys.executable).parent


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


def write_diagonal_cache(path: Path, post: Path, seed: int = 0, transform=None) -> Path:
    """A diagonal Fisher cache with random non-negative entries for every post tensor."""
    generator = torch.Generator().manual_seed(seed)
    checkpoint = Checkpoint(post)
    with FisherCacheWriter(path, model=post, overwrite=True) as writer:
        for name, info in checkpoint.tensors.items():
            values = torch.rand(info.shape, generator=generator)
            writer.add_diagonal(name, transform(name, values) if transform else values)
    return path


@pytest.fixture(scope="session")
def tied_diag_cache(tied_models, tmp_path_factory) -> Path:
    return write_diagonal_cache(tmp_path_factory.mktemp("fisher") / "post-diag", tied_models["post"])


def spd(n: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """A well-conditioned random symmetric positive definite matrix."""
    a = torch.randn(n, n, generator=generator, dtype=dtype)
    return a @ a.T / n + 0.05 * torch.eye(n, dtype=dtype)


def write_mixed_cache(path: Path, post: Path, seed: int = 0) -> Path:
    """KFAC (random SPD factors) for attention/MLP weights and the embedding, diagonal for the rest."""
    g = torch.Generator().manual_seed(seed)
    checkpoint = Checkpoint(post)
    shared: dict[int, torch.Tensor] = {}
    with FisherCacheWriter(path, model=post, overwrite=True) as writer:
        for name, info in sorted(checkpoint.tensors.items()):
            if len(info.shape) == 2 and "proj" in name:
                Q = shared.setdefault(info.shape[1], spd(info.shape[1], g))
                writer.add_kfac(name, P=spd(info.shape[0], g) / 10, Q=Q)
            elif name == "model.embed_tokens.weight":  # one-hot rows: a diagonal side (U = I)
                writer.add_kfac(name, P=torch.rand(info.shape[0], generator=g, dtype=torch.float64), Q=spd(info.shape[1], g))
            else:
                writer.add_diagonal(name, torch.rand(info.shape, generator=g) ** 2)
    return path


class BruteForceGraft(NamedTuple):
    """What a whole-model brute force expects: outputs, and which directions it masked."""

    expected: dict[str, torch.Tensor]  # θpost + Δ' (float32)
    masks: dict[str, torch.Tensor]  # ranked tensors only: bool, shape of Δ (Δ̃ for KFAC)
    kinds: dict[str, str]  # ranked tensors only: "diagonal" or "kfac"


def brute_force_graft(
    post: Path, donor: Path, fine_tunes, fisher: Path, rho: float, scope: str = "global", mask: str = "auto",
) -> BruteForceGraft:
    """The whole model flattened at once: every ranked direction scored, one stable sort, top ⌈ρ·D⌉.

    Written from SPEC §2 and the README's tie rule, independently of graftmerge's
    streaming threshold: diagonal scores F⊙Δ², KFAC scores σ_i d_j Δ̃² with
    Δ̃ = UᵀΔV; tensors in name order, row-major coordinates; scores below
    float32's smallest normal never masked; tensors without a usable Fisher entry
    unranked and unmasked. KFAC: Δ' = Δ − U(1_S ⊙ Δ̃)Vᵀ.
    """
    post_w, donor_w = read_model(post), read_model(donor)
    ft_w = [(read_model(p), w) for p, w in fine_tunes]
    cache = open_fisher_cache(fisher)
    names = sorted(post_w)
    deltas = {n: sum(w * (ft[n].float() - donor_w[n].float()) for ft, w in ft_w) for n in names}
    kinds: dict[str, str] = {}
    for n in names:
        if mask == "auto":
            kind = cache.representation(n)
        elif mask == "kfac" and cache.has(n, "kfac"):
            kind = "kfac"
        else:
            kind = "diagonal" if cache.has(n, "diagonal") else None
        if kind:
            kinds[n] = kind
    ranked = [n for n in names if n in kinds]
    rotated, scores = {}, {}
    for n in ranked:
        if kinds[n] == "kfac":
            f = cache.kfac(n)
            left = deltas[n] if f.U is None else f.U.T @ deltas[n]
            rotated[n] = left if f.V is None else left @ f.V
            scores[n] = rotated[n].square() * f.S[:, None] * f.D[None, :]
        else:
            scores[n] = cache.diagonal(n) * deltas[n].square()

    def top(flat: torch.Tensor) -> torch.Tensor:
        k = ceil(Fraction(repr(rho)) * flat.numel())
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
        return chosen & (flat >= torch.finfo(torch.float32).tiny)

    if scope == "global":
        flat_mask = top(torch.cat([scores[n].reshape(-1) for n in ranked]))
        flat_masks = dict(zip(ranked, torch.split(flat_mask, [scores[n].numel() for n in ranked])))
    else:
        flat_masks = {n: top(scores[n].reshape(-1)) for n in ranked}
    masks = {n: flat_masks[n].reshape(scores[n].shape) for n in ranked}
    expected = {}
    for n in names:
        applied = deltas[n]
        if kinds.get(n) == "kfac":
            f = cache.kfac(n)
            part = torch.where(masks[n], rotated[n], 0.0)
            part = part if f.V is None else part @ f.V.T
            applied = applied - (part if f.U is None else f.U @ part)
        elif n in kinds:
            applied = applied.masked_fill(masks[n], 0)
        expected[n] = post_w[n].float() + applied
    return BruteForceGraft(expected, masks, kinds)


def graft_yaml(
    post, donor, fine_tunes, *, rho=0.0, fisher=None, scope="global", lam=1.0, mask=None,
    dtype="float32", out_dtype="float32", extra_global="",
) -> str:
    models = f"  - model: {donor}\n    parameters: {{role: donor}}\n"
    for path, weight in fine_tunes:
        models += f"  - model: {path}\n    parameters: {{role: donor_ft, weight: {weight}}}\n"
    params = f"  lambda: {lam}\n  rho: {rho}\n  rho_scope: {scope}\n"
    if fisher:
        params += f"  fisher: {fisher}\n"
    if mask:
        params += f"  mask: {mask}\n"
    params += extra_global
    return (
        f"merge_method: graft\nbase_model: {post}\nmodels:\n{models}parameters:\n{params}"
        f"dtype: {dtype}\nout_dtype: {out_dtype}\n"
    )


# Console scripts run in this process by run_cli: name → (module, click command).
IN_PROCESS = {
    "mergekit-yaml": ("mergekit.scripts.run_yaml", "main"),
    "mergekit-multi": ("mergekit.scripts.multimerge", "main"),
    "graftmerge": ("graftmerge.cli", "main"),
}


def forget_process_state() -> None:
    """Drop what a merge leaves in memory, so the next in-process run starts like a fresh
    process: mergekit's loaders. (graftmerge keeps nothing of a merge in the process; the
    on-disk threshold cache, $GRAFTMERGE_CACHE_DIR, is kept: that is what persists between
    real runs.)"""
    from mergekit.io.tasks import LoaderCache

    LoaderCache().flush_all()
    LoaderCache().loaders.clear()


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a console script of this environment (mergekit-yaml, mergekit-multi, graftmerge)
    in this process, through its click command, as if it were a fresh process.

    The graft import hook is installed here as graftmerge_hook.pth installs it at start-up.
    ``env`` is set for the run only; ``cwd`` is entered for the run only. The result reads
    like a subprocess's: exit status, stdout, stderr (an uncaught exception's traceback is
    appended to stderr, as the interpreter would print it). Tests whose subject is the
    process itself (start-up, the .pth hook, signals, torchrun) use :func:`run_process`.
    """
    from click.testing import CliRunner

    from graftmerge.adapter import import_hook

    import_hook.install()
    module, attribute = IN_PROCESS[args[0]]
    command = getattr(importlib.import_module(module), attribute)
    forget_process_state()
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(command, list(args[1:]), env=env, prog_name=args[0])
    finally:
        os.chdir(previous)
        forget_process_state()
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, stderr)


def run_process(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a console script of this environment (or ``python``) as a real subprocess."""
    command = [str(BIN / args[0]), *args[1:]]
    environment = None if env is None else {**os.environ, **env}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=timeout)


def read_model(folder: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name) for name in checkpoint.tensors}


def tree_digest(folder: Path) -> str:
    """Content hash of every file under ``folder`` (inputs must never change)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def mergekit_yaml_model(tmp_path: Path, config: str, name: str) -> dict[str, torch.Tensor]:
    """Run ``config`` through the stock mergekit-yaml into ``tmp_path/name``; its tensors."""
    (tmp_path / f"{name}.yml").write_text(config)
    result = run_cli("mergekit-yaml", str(tmp_path / f"{name}.yml"), str(tmp_path / name))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_model(tmp_path / name)


def assert_identical(got: dict, expected: dict) -> None:
    """Same tensor names, dtypes and bits."""
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name


def error_line(result) -> str:
    """The contract for a finished process (``run_cli``/``run_process``): exit 2, exactly one ``error: ...``
    line, last on stderr (progress bars aside), no traceback; that line."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip() and "it/s]" not in line and "s/it]" not in line]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    return errors[0]


def one_line_error(result) -> str:
    """The CLI's contract for bad input: exit 2, one `error: ...` line, no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]
