"""``graftmerge delta extract --rank K``: a delta written as a PEFT LoRA adapter.

PEFT itself is the reference: the extracted folder is loaded with
``PeftModel.from_pretrained`` onto the donor (no missing or unexpected keys) and merged
with ``merge_and_unload()``. At full rank the merge gives back donor + Δ on every weight
LoRA can express (up to float32 SVD rounding); at rank K it gives donor + Δ_K, the
brute-force float64 truncated SVD of Δ; the kept shares in lora_manifest.json equal
Σ_{i≤K} σ_i² / Σ σ_i² from torch.linalg.svd. Tensors LoRA has no form for (norms,
biases) are dropped, listed and counted. The adapter grafts as ``role: delta`` bit for
bit like a delta folder holding its truncated Δ. Bad K and failures leave no OUTPUT.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from graftmerge.cli import main
from graftmerge.demo.tiny_models import ARCHITECTURES, make_graft_inputs
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.lora_adapter import CONFIG_NAME, WEIGHTS_NAME, open_lora_adapter
from graftmerge.formats.lora_writer import LORA_MANIFEST_NAME
from graftmerge.pipeline import delta_extract
from tests.helpers.fisher_caches import write_diagonal_cache
from tests.helpers.models import assert_identical, read_model
from tests.helpers.runners import mergekit_yaml_model, one_line_error

PREFIX = "base_model.model."
# architecture -> model options: tied Llama and Qwen3, Qwen2 with q/k/v biases and an untied lm_head,
# GPT-2 with Conv1D layers (stored in × out), tied wte and a position embedding wpe
MODELS = {
    "llama": {"tie_word_embeddings": True},
    "qwen3": {},
    "qwen2": {"tie_word_embeddings": False},
    "gpt2": {"tie_word_embeddings": True},
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def extract(donor: Path, ft: Path, out: Path, *extra) -> Path:
    result = invoke("delta", "extract", donor, ft, "-o", out, "-q", *extra)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """post / base / base-ft of one architecture, made once per module on first use."""
    made: dict[str, dict[str, Path]] = {}

    def models(architecture: str) -> dict[str, Path]:
        if architecture not in made:
            root = tmp_path_factory.mktemp(f"extract-{architecture}")
            made[architecture] = make_graft_inputs(root, seed=3, architecture=architecture, **MODELS[architecture])
        return made[architecture]

    return models


def load_model(folder: Path, architecture: str):
    return getattr(transformers, ARCHITECTURES[architecture][1]).from_pretrained(folder, dtype=torch.float32)


def peft_merged(base: Path, adapter: Path, architecture: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """PEFT's merge_and_unload() of ``adapter`` on a float32 ``base``, and the warnings PEFT raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = PeftModel.from_pretrained(load_model(base, architecture), adapter).merge_and_unload()
    messages = [str(w.message) for w in caught if "/peft/" in w.filename]
    return {name: tensor.detach() for name, tensor in merged.state_dict().items()}, messages


def manifest_of(adapter: Path) -> dict:
    return json.loads((adapter / LORA_MANIFEST_NAME).read_text())


def deltas_of(paths: dict[str, Path], weight: float = 1.0) -> dict[str, torch.Tensor]:
    """weight·(ft − base) in float32, every tensor."""
    base, ft = read_model(paths["donor"]), read_model(paths["donor_ft"])
    return {name: torch.sub(ft[name].float(), base[name].float()).mul_(weight) for name in base}


def brute_truncation(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """(Δ_K from a float64 SVD, Σ_{i≤K} σ_i² / Σ σ_i²)."""
    U, S, Vh = torch.linalg.svd(delta.double(), full_matrices=False)
    k = min(rank, S.numel())
    return (U[:, :k] * S[:k]) @ Vh[:k], float(S[:k].square().sum() / S.square().sum())


def assert_loads_cleanly(messages: list[str], tied_embedding: bool) -> None:
    """No warning about keys or fan_in_fan_out; the tie warnings only where an adapter sits on a tied embed_tokens."""
    assert not [m for m in messages if "keys" in m.lower() or "fan_in_fan_out" in m], messages
    assert bool([m for m in messages if "tie_word_embeddings" in m]) == tied_embedding, messages


@pytest.mark.parametrize("architecture", list(MODELS))
def test_full_rank_adapter_merges_back_to_donor_plus_delta_in_peft(tmp_path, zoo, architecture):
    """K ≥ min(m, n) keeps every weight exactly: PEFT's merge = donor + Δ (float32 SVD rounding); 1-D tensors are
    dropped, listed with their share, and stay the donor's."""
    paths = zoo(architecture)
    adapter = extract(paths["donor"], paths["donor_ft"], tmp_path / "lora", "--rank", 100000)
    merged, messages = peft_merged(paths["donor"], adapter, architecture)
    assert_loads_cleanly(messages, tied_embedding=architecture in ("llama", "qwen3"))
    manifest, base, deltas = manifest_of(adapter), read_model(paths["donor"]), deltas_of(paths)
    assert set(manifest["tensors"]) | set(manifest["dropped"]) == set(base) and not manifest["unchanged"]
    assert set(manifest["dropped"]) == {name for name, tensor in base.items() if tensor.dim() == 1}
    for name, record in manifest["tensors"].items():
        assert record["rank"] == min(base[name].shape) and record["kept_share"] == 1.0, name
        torch.testing.assert_close(merged[name], base[name] + deltas[name], rtol=0, atol=2e-6, msg=name)
    for name in manifest["dropped"]:
        assert torch.equal(merged[name], base[name]), name
    energy = {name: float(d.double().square().sum()) for name, d in deltas.items()}
    dropped_share = sum(energy[n] for n in manifest["dropped"]) / sum(energy.values())
    assert manifest["total"]["dropped_share"] == pytest.approx(dropped_share, rel=1e-5)
    assert manifest["total"]["kept_share"] == pytest.approx(1 - dropped_share, rel=1e-5)
    assert manifest["total"]["truncated_share"] == pytest.approx(0, abs=1e-6)
    adapted = {record["module"] for record in manifest["tensors"].values()}
    if architecture == "gpt2":  # Conv1D (fan_in_fan_out) and both embeddings, transposed
        assert {"transformer.h.0.attn.c_attn", "transformer.wte", "transformer.wpe"} <= adapted
    if architecture == "qwen2":  # the untied head is a Linear like any other
        assert "lm_head" in adapted


@pytest.mark.parametrize(("architecture", "rank", "weight"), [("llama", 3, 1.0), ("qwen2", 5, 0.5), ("gpt2", 4, 1.0),
                                                              ("qwen3", 1, 1.0)])
def test_rank_k_adapter_is_the_truncated_svd_and_reports_the_kept_share(tmp_path, zoo, architecture, rank, weight):
    """PEFT's merge = donor + brute-force Δ_K; each kept share = Σ_{i≤K} σ_i² / Σ σ_i²; the total counts the
    truncated and the dropped parts of the whole Δ."""
    paths = zoo(architecture)
    adapter = extract(paths["donor"], paths["donor_ft"], tmp_path / "lora", "--rank", rank, "--weight", weight)
    merged, messages = peft_merged(paths["donor"], adapter, architecture)
    assert_loads_cleanly(messages, tied_embedding=architecture in ("llama", "qwen3"))
    manifest, base, deltas = manifest_of(adapter), read_model(paths["donor"]), deltas_of(paths, weight)
    config = json.loads((adapter / CONFIG_NAME).read_text())
    assert config["r"] == config["lora_alpha"] == rank and not config["rank_pattern"] and not config["use_rslora"]
    kept_total = 0.0
    for name, record in manifest["tensors"].items():
        truncated, share = brute_truncation(deltas[name], rank)
        torch.testing.assert_close(merged[name], base[name] + truncated.float(), rtol=0, atol=1e-5, msg=name)
        assert not torch.allclose(merged[name], base[name] + deltas[name], atol=1e-3), name  # truly truncated
        assert record["rank"] == rank and record["kept_share"] == pytest.approx(share, rel=1e-5), name
        kept_total += share * float(deltas[name].double().square().sum())
    energy = sum(float(d.double().square().sum()) for d in deltas.values())
    assert manifest["total"]["kept_share"] == pytest.approx(kept_total / energy, rel=1e-5)
    total = manifest["total"]
    assert total["kept_share"] + total["truncated_share"] + total["dropped_share"] == pytest.approx(1, abs=1e-9)
    assert manifest["rank"] == rank and manifest["weight"] == weight


def truncated_delta_folder(adapter: Path, paths: dict[str, Path], root: Path) -> Path:
    """A graftmerge delta folder holding the adapter's Δ_K as PEFT computes it, (B @ A)ᵀ or B @ A, 0 elsewhere:
    extracted from a model of zeros to a model of Δ_K, so every stored value is Δ_K's exactly."""
    manifest, base = manifest_of(adapter), read_model(paths["donor"])
    with safe_open(str(adapter / WEIGHTS_NAME), framework="pt") as handle:
        factors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open has no iterator
    truncated = {name: torch.zeros_like(tensor) for name, tensor in base.items()}
    for name, record in manifest["tensors"].items():
        embedding = record["kind"] == "embedding"
        a = factors[f"{PREFIX}{record['module']}.{'lora_embedding_A' if embedding else 'lora_A.weight'}"]
        b = factors[f"{PREFIX}{record['module']}.{'lora_embedding_B' if embedding else 'lora_B.weight'}"]
        product = b.float() @ a.float()
        truncated[name] = product.T if record["kind"] in ("embedding", "conv1d") else product
    for folder, tensors in (("zero", {n: torch.zeros_like(t) for n, t in base.items()}), ("truncated", truncated)):
        (root / folder).mkdir()
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(root / folder / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copy(paths["donor"] / "config.json", root / folder / "config.json")
    return extract(root / "zero", root / "truncated", root / "delta")


def graft_config(post: Path, model: Path, rho: float, fisher: Path | None) -> str:
    fisher_line = f"  fisher: {fisher}\n" if fisher else ""
    return (f"merge_method: graft\nbase_model: {post}\nmodels:\n  - model: {model}\n"
            f"    parameters: {{role: delta, weight: 0.7}}\nparameters:\n  lambda: 1.5\n  rho: {rho}\n{fisher_line}"
            "dtype: float32\nout_dtype: float32\n")


@pytest.mark.parametrize("architecture", ["qwen3", "gpt2"])
@pytest.mark.parametrize("rho", [0.0, 0.05])
def test_extracted_adapter_grafts_like_its_truncated_delta(tmp_path, zoo, architecture, rho):
    """``role: delta`` on the extracted adapter = ``role: delta`` on a delta folder of its Δ_K, bit for bit
    (mergekit-yaml; ρ = 0 and a diagonal mask)."""
    paths = zoo(architecture)
    adapter = extract(paths["donor"], paths["donor_ft"], tmp_path / "lora", "--rank", 3)
    delta = truncated_delta_folder(adapter, paths, tmp_path)
    fisher = write_diagonal_cache(tmp_path / "fisher", paths["post"], transform=lambda n, v: v ** 4) if rho else None
    got = mergekit_yaml_model(tmp_path, graft_config(paths["post"], adapter, rho, fisher), "adapter-graft")
    expected = mergekit_yaml_model(tmp_path, graft_config(paths["post"], delta, rho, fisher), "delta-graft")
    assert_identical(got, expected)
    post = read_model(paths["post"])
    assert sum(not torch.equal(got[name], post[name]) for name in post) == len(manifest_of(adapter)["tensors"])


def rewrite_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    """Replace tensor ``name`` in the shard of ``folder`` that holds it."""
    file = Checkpoint(folder).tensors[name].file
    tensors = load_file(str(file))
    tensors[name] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unchanged_weight_gets_no_module_and_full_target_names(tmp_path, zoo):
    """A weight with Δ = 0 is listed as unchanged, not adapted; target_modules then names every module in full,
    so PEFT creates no layer without factors (no missing keys)."""
    paths = zoo("llama")
    ft = shutil.copytree(paths["donor_ft"], tmp_path / "ft")
    name = "model.layers.1.self_attn.q_proj.weight"
    rewrite_tensor(ft, name, Checkpoint(paths["donor"]).read(name))
    adapter = extract(paths["donor"], ft, tmp_path / "lora", "--rank", 2, "--no-embeddings")
    manifest, config = manifest_of(adapter), json.loads((adapter / CONFIG_NAME).read_text())
    assert manifest["unchanged"] == [name] and name not in manifest["tensors"]
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]
    assert "model.layers.1.self_attn.q_proj" not in config["target_modules"]
    assert manifest["dropped"]["model.embed_tokens.weight"]["reason"].endswith("--no-embeddings")
    merged, messages = peft_merged(paths["donor"], adapter, "llama")
    assert_loads_cleanly(messages, tied_embedding=False)
    assert not messages, messages
    assert torch.equal(merged[name], Checkpoint(paths["donor"]).read(name))


def test_bfloat16_factors_load_in_peft_and_graftmerge(tmp_path, zoo):
    paths = zoo("qwen2")
    adapter = extract(paths["donor"], paths["donor_ft"], tmp_path / "lora", "--rank", 2, "--dtype", "bfloat16")
    with safe_open(str(adapter / WEIGHTS_NAME), framework="pt") as handle:
        assert {handle.get_slice(key).get_dtype() for key in handle.keys()} == {"BF16"}  # noqa: SIM118
    assert open_lora_adapter(adapter).modules
    _, messages = peft_merged(paths["donor"], adapter, "qwen2")
    assert_loads_cleanly(messages, tied_embedding=False)


def test_cli_reports_what_was_kept_and_dropped(tmp_path, zoo):
    paths = zoo("qwen2")
    result = invoke("delta", "extract", paths["donor"], paths["donor_ft"], "-o", tmp_path / "lora", "-q", "--rank", 2)
    assert result.exit_code == 0, result.output
    manifest = manifest_of(tmp_path / "lora")
    lines = result.output.splitlines()
    assert lines[0].startswith(f"kept {100 * manifest['total']['kept_share']:.3f}% of ‖Δ‖²_F")
    assert lines[1].startswith(f"dropped {len(manifest['dropped'])} tensors LoRA cannot express "
                               f"({100 * manifest['total']['dropped_share']:.3f}% of ‖Δ‖²_F")
    assert "model.layers.0.self_attn.q_proj.bias" in manifest["dropped"]
    assert lines[-1] == f"wrote LoRA adapter {tmp_path / 'lora'}"


@pytest.mark.parametrize("rank", ["0", "-3", "1.5", "abc", "", "1e3"])
def test_bad_rank_is_one_line_and_writes_nothing(tmp_path, zoo, rank):
    paths = zoo("qwen3")
    result = invoke("delta", "extract", paths["donor"], paths["donor_ft"], "-o", tmp_path / "lora", "--rank", rank)
    assert "--rank must be a positive integer" in one_line_error(result)
    assert list(tmp_path.iterdir()) == []


def test_bad_rank_options_and_inputs(tmp_path, zoo):
    paths = zoo("qwen3")
    args = ("delta", "extract", paths["donor"], paths["donor_ft"], "-o", tmp_path / "lora")
    assert "--shard-size does not apply with --rank" in one_line_error(
        invoke(*args, "--rank", 2, "--shard-size", "1GB")
    )
    assert "--no-embeddings goes with --rank" in one_line_error(invoke(*args, "--no-embeddings"))
    with pytest.raises(GraftError, match="--rank must be a positive integer"):
        delta_extract.extract_lora(paths["donor"], paths["donor_ft"], tmp_path / "lora", rank=True)
    no_config = shutil.copytree(paths["donor"], tmp_path / "no-config")
    (no_config / "config.json").unlink()
    assert "has no config.json; --rank needs it" in one_line_error(
        invoke("delta", "extract", no_config, paths["donor_ft"], "-o", tmp_path / "lora", "--rank", 2))
    (tmp_path / "lora").mkdir()
    assert "already exists" in one_line_error(invoke(*args, "--rank", 2))


def test_failure_while_factoring_or_writing_leaves_no_output(tmp_path, zoo, monkeypatch):
    """OUT appears whole or not at all: a NaN in a late tensor, or a failure after the adapter file was written."""
    paths = zoo("qwen3")
    ft = shutil.copytree(paths["donor_ft"], tmp_path / "inputs" / "ft")
    name = "model.layers.1.mlp.up_proj.weight"
    bad = Checkpoint(ft).read(name).clone()
    bad[3, 4] = float("nan")
    rewrite_tensor(ft, name, bad)
    out_root = tmp_path / "out"
    out_root.mkdir()
    error = one_line_error(invoke("delta", "extract", paths["donor"], ft, "-o", out_root / "lora", "--rank", 2, "-q"))
    assert name in error and "NaN or Inf" in error
    assert list(out_root.iterdir()) == []

    def fails_after_writing(folder, *args, **kwargs):
        real(folder, *args, **kwargs)
        assert (folder / WEIGHTS_NAME).is_file() and (folder / CONFIG_NAME).is_file()
        raise GraftError("disk full (simulated)")

    real = delta_extract.write_lora_adapter
    monkeypatch.setattr(delta_extract, "write_lora_adapter", fails_after_writing)
    error = one_line_error(invoke("delta", "extract", paths["donor"], paths["donor_ft"], "-o", out_root / "lora",
                                  "--rank", 2, "-q"))
    assert "disk full" in error and list(out_root.iterdir()) == []
