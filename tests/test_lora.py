"""PEFT LoRA adapters as graft inputs: ``role: delta`` folders and mergekit's ``BASE+ADAPTER``.

The adapters are made by ``peft`` itself (get_peft_model, random factors, save_pretrained)
on tiny generated models, and the reference is PEFT's own float32 ``merge_and_unload()``:
``BASE+ADAPTER`` must graft bit for bit like the merged folder, through the stock
mergekit-yaml, for every mask and scope; an adapter as ``role: delta`` must graft exactly
``θpost + λ·Δ`` with PEFT's ``get_delta_weight`` as Δ. Everything refused is refused
before a tensor is merged, in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from graftmerge.adapter import import_hook
from graftmerge.cli import main
from graftmerge.demo.tiny_models import make_graft_inputs, save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.lora_adapter import CONFIG_NAME, WEIGHTS_NAME, open_lora_adapter
from graftmerge.formats.lora_sources import open_lora_delta
from graftmerge.math import projection
from graftmerge.math.low_rank import low_rank_rotate
from graftmerge.math.scores import kfac_rotate
from graftmerge.pipeline.lora_inputs import lora_delta_state_dict
from tests.helpers.configs import graft_config
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.lora import PREFIX, load_model, make_adapter, peft_deltas
from tests.helpers.models import assert_identical, read_model, tree_digest
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import mergekit_yaml_model, one_line_error, run_cli


def merge_with_peft(base: Path, adapter: Path, out: Path, architecture: str = "qwen3") -> Path:
    """The adapter merged into a float32 base by PEFT's merge_and_unload(), saved as a model folder."""
    PeftModel.from_pretrained(load_model(base, architecture), adapter).merge_and_unload().save_pretrained(out)
    return out


def invoke(*args):
    import_hook.install()  # as graftmerge_hook.pth does at start-up
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict[str, Path]:
    """Tied Qwen3 post / base / base-ft, two adapters of base (one with an embedding), merged copies, caches."""
    root = tmp_path_factory.mktemp("lora-qwen3")
    paths = make_graft_inputs(root, seed=0)
    paths["lora"] = make_adapter(
        paths["donor"], root / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj",
                                                                           "embed_tokens"],
        rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    paths["merged"] = merge_with_peft(paths["donor"], paths["lora"], root / "merged")
    paths["plain"] = make_adapter(paths["donor"], root / "plain", seed=2, r=8, lora_alpha=16, use_rslora=True,
                                  target_modules=["q_proj", "o_proj", "up_proj"])
    paths["plain-merged"] = merge_with_peft(paths["donor"], paths["plain"], root / "plain-merged")
    paths["diag"] = write_diagonal_cache(root / "fisher-diag", paths["post"], transform=lambda n, v: v ** 4)
    paths["mixed"] = write_mixed_cache(root / "fisher-mixed", paths["post"])
    return paths


MASKS = {
    "rho 0, donor implied": (0.0, None, "global", False),
    "diagonal, global": (0.05, "diag", "global", True),
    "diagonal, tensor": (0.05, "diag", "tensor", False),
    "kfac, global": (0.02, "mixed", "global", True),
    "kfac, tensor": (0.02, "mixed", "tensor", True),
}


@pytest.mark.parametrize("case", list(MASKS))
def test_lora_reference_grafts_like_the_peft_merged_folder(tmp_path, qwen, case):
    """``BASE+ADAPTER`` as donor_ft = the folder PEFT merged in float32, bit for bit (every mask, both scopes)."""
    rho, cache, scope, donor_listed = MASKS[case]
    fisher = qwen[cache] if cache else None
    donor = [(qwen["donor"], "donor", None)]
    lora = f"{qwen['donor']}+{qwen['lora']}"
    expected = mergekit_yaml_model(tmp_path, graft_config(
        qwen["post"], [*donor, (qwen["merged"], "donor_ft", 0.7)], lam=1.5, rho=rho, fisher=fisher, scope=scope),
        "merged")
    got = mergekit_yaml_model(tmp_path, graft_config(
        qwen["post"], [*(donor if donor_listed else []), (lora, "donor_ft", 0.7)], lam=1.5, rho=rho, fisher=fisher,
        scope=scope), "lora")
    assert_identical(got, expected)
    post, base, merged = read_model(qwen["post"]), read_model(qwen["donor"]), read_model(qwen["merged"])
    unmasked = {name: post[name] + 1.05 * (merged[name] - base[name]) for name in post}
    changed = [name for name in post if not torch.equal(got[name], post[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed
    assert any(not torch.allclose(got[name], unmasked[name], atol=1e-6) for name in changed) == (rho > 0)


OTHER_ARCHITECTURES = {
    # GPT-2: Conv1D weights stored in × out (Δ transposed), fused c_attn, a LoRA on the embedding
    "gpt2": ({"tie_word_embeddings": True}, {"target_modules": ["c_attn", "c_proj", "c_fc", "wte"],
                                             "fan_in_fan_out": True, "r": 4, "lora_alpha": 16}),
    # Qwen2: q/k/v biases pass through; an untied lm_head saved whole (modules_to_save)
    "qwen2": ({"tie_word_embeddings": False}, {"target_modules": ["q_proj", "k_proj", "up_proj"], "r": 4,
                                               "lora_alpha": 8, "modules_to_save": ["lm_head"]}),
    # Llama, tied: rsLoRA scaling alpha/√r
    "llama": ({"tie_word_embeddings": True}, {"target_modules": ["q_proj", "o_proj", "gate_proj"], "r": 8,
                                              "lora_alpha": 4, "use_rslora": True}),
}


@pytest.mark.parametrize("architecture", list(OTHER_ARCHITECTURES))
@pytest.mark.parametrize("rho", [0.0, 0.05])
def test_lora_reference_on_other_architectures(tmp_path, architecture, rho):
    model_options, lora_options = OTHER_ARCHITECTURES[architecture]
    paths = make_graft_inputs(tmp_path / "models", seed=4, architecture=architecture, **model_options)
    adapter = make_adapter(paths["donor"], tmp_path / "lora", architecture, **lora_options)
    merged = merge_with_peft(paths["donor"], adapter, tmp_path / "merged", architecture)
    fisher = write_diagonal_cache(tmp_path / "fisher", paths["post"], transform=lambda n, v: v ** 4) if rho else None
    donor = (paths["donor"], "donor", None)
    expected = mergekit_yaml_model(tmp_path, graft_config(paths["post"], [donor, (merged, "donor_ft", 1.0)],
                                                          rho=rho, fisher=fisher), "merged-graft")
    got = mergekit_yaml_model(tmp_path, graft_config(paths["post"], [donor, (f"{paths['donor']}+{adapter}",
                                                                             "donor_ft", 1.0)],
                                                     rho=rho, fisher=fisher), "lora-graft")
    assert_identical(got, expected)


@pytest.mark.parametrize("adapter", ["plain", "lora"])
def test_adapter_as_role_delta_is_theta_post_plus_lambda_peft_delta(tmp_path, qwen, adapter):
    """role: delta takes the adapter folder: θ = θpost + λ·Δ with Δ = PEFT's get_delta_weight, exactly;
    every weight the adapter leaves alone passes through from θpost bit for bit."""
    lam = 0.6
    entries = [(qwen[adapter], "delta", lam)]
    if adapter == "lora":  # it saves the embedding's own weight: Δ = saved − donor + B·A needs the donor
        entries.insert(0, (qwen["donor"], "donor", None))
    got = mergekit_yaml_model(tmp_path, graft_config(qwen["post"], entries), "out")
    post, deltas = read_model(qwen["post"]), peft_deltas(qwen["donor"], qwen[adapter])
    expected = {name: torch.mul(deltas[name], lam).add_(tensor) if name in deltas else tensor
                for name, tensor in post.items()}
    assert_identical(got, expected)
    assert len(deltas) >= 6 and len(post) - len(deltas) >= 10


def test_masked_adapter_grafts_through_every_entry_point(tmp_path, qwen):
    """A config with both forms (BASE+ADAPTER with an implied donor, and an adapter as role delta):
    mergekit-yaml, graftmerge merge, plan, sweep and suggest all take it; sweep equals mergekit-yaml."""
    def config(lam: float, rho: float) -> str:
        return graft_config(qwen["post"], [(f"{qwen['donor']}+{qwen['lora']}", "donor_ft", 1.0),
                                           (qwen["plain"], "delta", 0.5)], lam=lam, rho=rho, fisher=qwen["diag"])
    single = mergekit_yaml_model(tmp_path, config(0.5, 0.05), "single")
    (tmp_path / "grid.yml").write_text(config(1.0, 0.0))
    result = invoke("merge", tmp_path / "single.yml", tmp_path / "merged-by-graftmerge")
    assert result.exit_code == 0, result.output
    assert_identical(read_model(tmp_path / "merged-by-graftmerge"), single)
    result = invoke("sweep", tmp_path / "grid.yml", "--lambda", "0.5,1", "--rho", "0,0.05", "-o", tmp_path / "sweep")
    assert result.exit_code == 0, result.output
    assert_identical(read_model(tmp_path / "sweep" / "lambda-0.5_rho-0.05"), single)
    result = invoke("plan", tmp_path / "grid.yml", "--rho", "0.01,0.05", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "0.05" in result.output
    result = invoke("suggest", tmp_path / "grid.yml", "--no-progress", "--json", tmp_path / "suggest.json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "suggest.json").read_text())


@pytest.mark.parametrize("sides", ["both", "rows diagonal", "columns diagonal", "neither"])
def test_low_rank_rotation_equals_the_dense_one(sides):
    generator = torch.Generator().manual_seed(3)
    left, right = torch.randn(48, 6, generator=generator), torch.randn(6, 40, generator=generator)
    U = torch.linalg.qr(torch.randn(48, 48, generator=generator))[0] if sides in ("both", "columns diagonal") else None
    V = torch.linalg.qr(torch.randn(40, 30, generator=generator))[0] if sides in ("both", "rows diagonal") else None
    dense = kfac_rotate(left @ right * 0.37, U, V)
    torch.testing.assert_close(low_rank_rotate(left, right, 0.37, U, V), dense, rtol=1e-5, atol=1e-5)
    assert low_rank_rotate(torch.zeros(48, 0), torch.zeros(0, 40), 1.0, U, V).eq(0).all()


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_adapter_alone_is_rotated_from_its_factors(tmp_path, qwen, scope, monkeypatch):
    """Δ = one adapter: every KFAC weight's Δ̃ is λ·s·(UᵀB)(AV) (no dense rotation at all); the graft
    matches the dense brute force on the merged adapter, and sweep matches mergekit-yaml bit for bit."""
    monkeypatch.setattr(projection, "KFAC_ROTATIONS", projection.KFAC_ROTATIONS.__class__())
    config = graft_config(qwen["post"], [(qwen["plain"], "delta", 0.8)], rho=0.02, fisher=qwen["mixed"], scope=scope)
    got = mergekit_yaml_model(tmp_path, config, "single")
    assert sum(projection.KFAC_ROTATIONS.values()) == 0
    brute = brute_force_graft(qwen["post"], qwen["donor"], [(qwen["plain-merged"], 0.8)], qwen["mixed"], 0.02, scope)
    assert any(mask.any() for mask in brute.masks.values())
    for name, expected in brute.expected.items():
        torch.testing.assert_close(got[name], expected, rtol=0, atol=2e-6)
    (tmp_path / "grid.yml").write_text(config)
    result = invoke("sweep", tmp_path / "grid.yml", "--lambda", "1", "--rho", "0.02", "-o", tmp_path / "sweep")
    assert result.exit_code == 0, result.output
    assert_identical(read_model(tmp_path / "sweep" / "lambda-1.0_rho-0.02"), got)
    assert sum(projection.KFAC_ROTATIONS.values()) == 0


def test_rows_of_an_adapter_read_equal_the_whole(qwen):
    post, donor = Checkpoint(qwen["post"]), Checkpoint(qwen["donor"])
    delta = open_lora_delta(qwen["lora"], post, donor, qwen["post"])
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        whole = delta.read(name)
        rows = whole.shape[0]
        blocks = [delta.read(name, (start, min(start + 7, rows))) for start in range(0, rows, 7)]
        assert torch.equal(torch.cat(blocks), whole)
    assert not delta.read("model.norm.weight").any()


def test_delta_stats_takes_an_adapter(tmp_path, qwen):
    result = invoke("delta", "stats", qwen["plain"], "--base", qwen["donor"], "--fisher", qwen["diag"],
                    "--json", tmp_path / "stats.json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads((tmp_path / "stats.json").read_text())["tensors"]}
    deltas = peft_deltas(qwen["donor"], qwen["plain"])
    for name, delta in deltas.items():
        assert rows[name]["l2"] == pytest.approx(float(delta.double().norm()), rel=1e-5)
    assert all(rows[name]["l2"] == 0 for name in rows if name not in deltas)
    assert "--base" in one_line_error(invoke("delta", "stats", qwen["plain"]))


# -- refusals ---------------------------------------------------------------------------------------------------

def edited_adapter(source: Path, target: Path, config_changes: dict | None = None, rename=None,
                   drop_safetensors: bool = False) -> Path:
    shutil.copytree(source, target)
    if config_changes:
        config = json.loads((target / CONFIG_NAME).read_text())
        config.update(config_changes)
        (target / CONFIG_NAME).write_text(json.dumps(config))
    if rename:
        tensors = load_file(target / WEIGHTS_NAME)
        save_file({rename(k): v for k, v in tensors.items()}, target / WEIGHTS_NAME)
    if drop_safetensors:
        (target / WEIGHTS_NAME).rename(target / "adapter_model.bin")
    return target


REFUSED = {
    "DoRA": ({"use_dora": True}, "use_dora"),
    "bias all": ({"bias": "all"}, "bias = 'all'"),
    "LoHa": ({"peft_type": "LOHA"}, "peft_type is 'LOHA'"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "layer_replication": ({"layer_replication": [[0, 1]]}, "layer_replication"),
    "PiSSA init": ({"init_lora_weights": "pissa"}, "init_lora_weights = 'pissa'"),
    "LoftQ": ({"loftq_config": {"loftq_bits": 4}}, "loftq_config"),
    "QA-LoRA": ({"use_qalora": True}, "use_qalora"),
    "trainable tokens": ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    "target_parameters": ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
    "unknown field": ({"shiny_new_field": 3}, "unknown field shiny_new_field"),
    "rank disagrees with r": ({"r": 16}, "has rank 8 but the config gives it r = 16"),
    "rank_pattern disagrees": ({"rank_pattern": {"q_proj": 2}}, "r = 2"),
    "target_modules leave a module out": ({"target_modules": ["q_proj"]}, "target_modules"),
    "layers_to_transform leaves a layer out": ({"layers_to_transform": [0]}, "layers_to_transform leave it out"),
    "layers_to_transform not indices": ({"layers_to_transform": ["0"]}, "layers_to_transform must be a layer index"),
    "layers_to_transform a bool": ({"layers_to_transform": True}, "layers_to_transform must be a layer index"),
    "layers_pattern not names": ({"layers_to_transform": [0, 1], "layers_pattern": 3},
                                 "layers_pattern must be a name, a list of names or null, got 3"),
    "layers_pattern alone": ({"layers_pattern": "layers"}, "layers_pattern is set without layers_to_transform"),
    "layers with a regex target": ({"target_modules": ".*proj", "layers_to_transform": [0]},
                                   "with target_modules a string (a regular expression, or all-linear)"),
    "layers with all-linear": ({"target_modules": "all-linear", "layers_pattern": "layers",
                                "layers_to_transform": [0]}, "PEFT refuses that config"),
    "bad layers_pattern": ({"layers_to_transform": [0], "layers_pattern": "("},
                           "layers_pattern '(' is not a valid regular expression"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_config_fields_name_the_field(tmp_path, qwen, case):
    changes, expected = REFUSED[case]
    adapter = edited_adapter(qwen["plain"], tmp_path / "adapter", changes)
    with pytest.raises(GraftError) as error:
        open_lora_adapter(adapter)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_off_unknown_fields_and_ignored_fields_are_accepted(tmp_path, qwen):
    adapter = edited_adapter(qwen["plain"], tmp_path / "adapter", {"future_flag": None, "lora_dropout": 0.3,
                                                                   "layers_to_transform": None})
    assert len(open_lora_adapter(adapter).modules) == 6
    every_layer = edited_adapter(qwen["plain"], tmp_path / "every-layer", {"layers_to_transform": [1, 0],
                                                                           "layers_pattern": ["blocks", "layers"]})
    assert len(open_lora_adapter(every_layer).modules) == 6


REFUSED_FILES = {
    "adapter name in keys": (dict(rename=lambda k: k.replace("lora_A.weight", "lora_A.default.weight")),
                             "not a plain LoRA factor"),
    "no PEFT prefix": (dict(rename=lambda k: k.removeprefix(PREFIX)), "does not start with 'base_model.model.'"),
    "lora_B missing": (dict(rename=lambda k: k.replace("layers.0.self_attn.q_proj.lora_B", "layers.0.x.lora_B")),
                       "has lora_A but no lora_B"),
    "a tensor outside modules_to_save": (dict(rename=lambda k: k.replace(
        "layers.1.mlp.up_proj.lora_A.weight", "layers.1.mlp.up_proj.weight")), "neither a LoRA factor"),
    "pickle only": (dict(drop_safetensors=True), "re-save it with safe_serialization=True"),
}


@pytest.mark.parametrize("case", list(REFUSED_FILES))
def test_refused_adapter_files(tmp_path, qwen, case):
    options, expected = REFUSED_FILES[case]
    adapter = edited_adapter(qwen["plain"], tmp_path / "adapter", **options)
    with pytest.raises(GraftError) as error:
        open_lora_adapter(adapter)
    assert expected in str(error.value)


@pytest.fixture(scope="module")
def misfits(qwen, tmp_path_factory) -> dict[str, Path]:
    """Adapters that do not fit the Qwen3 post model: narrower, another architecture, DoRA."""
    root = tmp_path_factory.mktemp("misfits")
    save_tiny_model(root / "narrow-base", seed=5, hidden_size=32)
    save_tiny_model(root / "llama-base", seed=5, architecture="llama")
    return {
        "narrow": make_adapter(root / "narrow-base", root / "narrow", r=4, target_modules=["q_proj", "v_proj"]),
        "llama": make_adapter(root / "llama-base", root / "llama", "llama", r=4, target_modules=["q_proj"]),
        "dora": edited_adapter(qwen["plain"], root / "dora", {"use_dora": True}),
        "quantised-base": _quantised_copy(qwen["donor"], root / "quantised-base"),
    }


def _quantised_copy(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (target / "config.json").write_text(json.dumps(config))
    return target


BAD_GRAFTS = {
    "adapter of other shapes": (lambda q, m: [(m["narrow"], "delta", 1.0)], "so Δ is 32×32, but"),
    "adapter of another architecture": (lambda q, m: [(m["llama"], "delta", 1.0)],
                                        "was trained on a LlamaForCausalLM, but post model"),
    "DoRA adapter": (lambda q, m: [(m["dora"], "delta", 1.0)], "use_dora = true (DoRA"),
    "whole tensors without a donor": (lambda q, m: [(q["lora"], "delta", 1.0)],
                                      "stores whole tensors (model.embed_tokens.weight"),
    "LoRA reference as the donor": (lambda q, m: [(f"{q['donor']}+{q['lora']}", "donor", None),
                                                  (q["donor_ft"], "donor_ft", 1.0)], "so its role is donor_ft"),
    "LoRA reference on another donor": (lambda q, m: [(q["donor_ft"], "donor", None),
                                                      (f"{q['donor']}+{q['lora']}", "donor_ft", 1.0)],
                                        "the adapter was trained on"),
    "LoRA reference on the post model": (lambda q, m: [(f"{q['post']}+{q['plain']}", "donor_ft", 1.0)],
                                         "its base is the post model"),
    "LoRA reference to a folder without adapter": (lambda q, m: [(f"{q['donor']}+{q['donor_ft']}", "donor_ft",
                                                                  1.0)], "has no adapter_config.json"),
    "quantised base": (lambda q, m: [(f"{m['quantised-base']}+{q['plain']}", "donor_ft", 1.0)], "is quantised"),
}


@pytest.mark.parametrize("case", list(BAD_GRAFTS))
def test_bad_lora_graft_is_one_line_before_any_tensor_is_merged(tmp_path, qwen, misfits, case):
    entries, expected = BAD_GRAFTS[case]
    config = tmp_path / "graft.yml"
    config.write_text(graft_config(qwen["post"], entries(qwen, misfits)))
    watched = [qwen["post"], qwen["donor"], qwen["lora"], qwen["plain"], *misfits.values()]
    before = [tree_digest(p) for p in watched]
    out = tmp_path / "out"
    line = one_line_error(invoke("merge", config, out))
    assert expected in line, line
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert [tree_digest(p) for p in watched] == before


def test_bad_adapter_through_stock_mergekit_yaml(tmp_path, qwen, misfits):
    config = tmp_path / "graft.yml"
    config.write_text(graft_config(qwen["post"], [(misfits["narrow"], "delta", 1.0)]))
    result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: delta ")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# -- layers_to_transform / layers_pattern: PEFT's rule, reproduced ------------------------------------------------

LAYER_CONFIGS = [
    {"target_modules": targets, "layers_to_transform": layers, "layers_pattern": pattern, "exclude_modules": exclude}
    for targets in (["q_proj", "v_proj", "c_attn", "up_proj", "experts.0.w1"], ["model.layers.1.self_attn.q_proj",
                                                                              "q_proj"])
    for layers in (None, 0, 1, [0, 2], [], [5, 12])
    for pattern in (None, "layers", ["blocks", "layers"], "h", "", [], "dec.*")
    for exclude in (None, ["v_proj"])
    if layers is not None or not pattern
]
EXTRA_MODULE_NAMES = ["layers.0.q_proj", "model.blocks.2.layers.5.q_proj", "model.layers.12.self_attn.q_proj",
                      "model.layers.1.experts.0.w1", "model.decoder.layers.2.self_attn.v_proj", "q_proj",
                      "model.layers.1", "model.1.layers.0.up_proj"]


def test_which_modules_an_adapter_may_adapt_is_peft_s_own_rule(tmp_path):
    """For every module of real (tiny) Qwen3 and GPT-2 models and some odd names, with and without
    layers_to_transform / layers_pattern / exclude_modules: graftmerge and PEFT agree."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from graftmerge.formats.peft_rules import check_adapter_config, peft_adapts

    names = list(EXTRA_MODULE_NAMES)
    for architecture in ("qwen3", "gpt2"):
        save_tiny_model(tmp_path / architecture, seed=0, architecture=architecture)
        names += [name for name, _ in load_model(tmp_path / architecture, architecture).named_modules() if name]
    adapted = 0
    for config in LAYER_CONFIGS:
        ours = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
        check_adapter_config(ours, "config")
        theirs = LoraConfig(r=4, lora_alpha=8, **config)
        for name in names:
            expected = bool(check_target_module_exists(theirs, name))
            assert peft_adapts(ours, name, "config") == expected, (config, name)
            adapted += expected
    assert adapted > 500 and len(LAYER_CONFIGS) > 100


@pytest.mark.parametrize("layers,adapted", [
    ({"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
     ["model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj"]),
    ({"target_modules": ["q_proj", "up_proj"], "layers_to_transform": 0},
     ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"]),
    ({"layers_to_transform": [1]},  # no target_modules: PEFT's names for the model type, then the layer rule
     ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]),
])
def test_an_adapter_of_some_layers_grafts_like_peft(tmp_path, qwen, layers, adapted):
    adapter = make_adapter(qwen["donor"], tmp_path / "lora", r=4, lora_alpha=8, **layers)
    deltas = peft_deltas(qwen["donor"], adapter)
    assert sorted(deltas) == [f"{module}.weight" for module in adapted]
    got = mergekit_yaml_model(tmp_path, graft_config(qwen["post"], [(adapter, "delta", 0.5)]), "out")
    post = read_model(qwen["post"])
    assert_identical(got, {n: torch.mul(deltas[n], 0.5).add_(t) if n in deltas else t for n, t in post.items()})
    other_layer = edited_adapter(adapter, tmp_path / "other-layer", {"layers_to_transform": [2]})
    with pytest.raises(GraftError, match="layers_to_transform leave it out"):
        open_lora_adapter(other_layer)


def test_factors_outside_layers_to_transform_are_refused_as_peft_ignores_them(tmp_path, qwen):
    adapter = edited_adapter(qwen["plain"], tmp_path / "adapter", {"layers_to_transform": [0],
                                                                   "layers_pattern": "layers"})
    with pytest.raises(GraftError, match=r"module 'model\.layers\.1\.[a-z_.]+' has LoRA factors but target_modules "
                                         r"/ exclude_modules / layers_to_transform leave it out"):
        open_lora_adapter(adapter)
    loaded = PeftModel.from_pretrained(load_model(qwen["donor"], "qwen3"), adapter)  # PEFT: no layer-1 adapters
    layers = {name.split(".layers.")[1][0] for name, m in loaded.named_modules() if isinstance(m, LoraLayer)}
    assert layers == {"0"}


# -- in memory: merge_state_dicts ----------------------------------------------------------------------------------

def adapter_in_memory(adapter: Path, model, **options) -> dict[str, torch.Tensor]:
    """lora_delta_state_dict of an adapter folder's own tensors and config (as a user holding them would call it)."""
    config = json.loads((adapter / CONFIG_NAME).read_text())
    return lora_delta_state_dict(load_file(adapter / WEIGHTS_NAME), config, model, **options)


@pytest.mark.parametrize("case", list(MASKS))
def test_merge_state_dicts_takes_an_adapter_and_grafts_like_its_folder(tmp_path, qwen, case, monkeypatch):
    """role: delta in memory = role: delta from the folder, bit for bit, KFAC included (rotated from the factors)."""
    from mergekit.merge_methods import merge_state_dicts

    rho, cache, scope, _ = MASKS[case]
    fisher = qwen[cache] if cache else None
    expected = mergekit_yaml_model(tmp_path, graft_config(qwen["post"], [(qwen["plain"], "delta", 0.8)], lam=1.5,
                                                          rho=rho, fisher=fisher, scope=scope), "folder")
    post = read_model(qwen["post"])
    model_config = json.loads((qwen["post"] / "config.json").read_text())
    parameters = {"role": {"lora": "delta"}, "weight": {"lora": 0.8}, "lambda": 1.5, "rho": rho, "rho_scope": scope}
    parameters |= {"fisher": str(fisher)} if fisher else {}
    monkeypatch.setattr(projection, "KFAC_ROTATIONS", projection.KFAC_ROTATIONS.__class__())
    got = merge_state_dicts({"post": post, "lora": adapter_in_memory(qwen["plain"], post, model_config=model_config)},
                            "graft", base="post", parameters=parameters, dtype=torch.float32, out_dtype=torch.float32)
    assert_identical(got, expected)
    assert sum(projection.KFAC_ROTATIONS.values()) == 0  # no dense rotation: the factors were found


def test_a_peft_model_in_memory_grafts_like_its_saved_folder(tmp_path, qwen):
    """PEFT's own in-memory objects (get_peft_model_state_dict, the LoraConfig with its sets), with
    state dicts (masked) and with transformers models (ρ = 0; a tied model's state dict also names
    lm_head); an adapter with a saved embedding needs the donor, in memory too."""
    from mergekit.merge_methods import merge_state_dicts
    from peft import get_peft_model_state_dict

    peft_model = PeftModel.from_pretrained(load_model(qwen["donor"], "qwen3"), qwen["lora"])
    state_dict, config = get_peft_model_state_dict(peft_model), peft_model.peft_config["default"]
    assert state_dict.keys() == load_file(qwen["lora"] / WEIGHTS_NAME).keys()
    roles = {"role": {"donor": "donor", "lora": "delta"}, "weight": {"donor": 1.0, "lora": 0.6}}
    for rho, fisher in ((0.05, qwen["diag"]), (0.0, None)):
        entries = [(qwen["donor"], "donor", None), (qwen["lora"], "delta", 0.6)]
        expected = mergekit_yaml_model(tmp_path, graft_config(qwen["post"], entries, rho=rho, fisher=fisher),
                                       f"folder-{rho}")
        if fisher:
            post, donor = read_model(qwen["post"]), read_model(qwen["donor"])
            model_config = json.loads((qwen["post"] / "config.json").read_text())
        else:  # the models' own config is used
            post, donor, model_config = load_model(qwen["post"], "qwen3"), load_model(qwen["donor"], "qwen3"), None
        with torch.no_grad():
            delta = lora_delta_state_dict(state_dict, config, post, model_config=model_config, donor=donor)
            got = merge_state_dicts({"post": post, "donor": donor, "lora": delta}, "graft", base="post",
                                    parameters={**roles, "rho": rho, **({"fisher": str(fisher)} if fisher else {})},
                                    dtype=torch.float32)
        assert_identical({name: got[name] for name in expected}, expected)


def test_a_plain_delta_state_dict_takes_role_delta_in_memory(qwen):
    """Any Δ state dict is a role: delta input: ft − donor as a delta grafts like donor and donor_ft."""
    from mergekit.merge_methods import merge_state_dicts

    post, donor, ft = (read_model(qwen[k]) for k in ("post", "donor", "donor_ft"))
    delta = {name: ft[name].float() - donor[name].float() for name in post}
    parameters = {"rho": 0.05, "fisher": str(qwen["diag"]), "lambda": 0.7}
    expected = merge_state_dicts([post, donor, ft], "graft", base=0, parameters=parameters, dtype=torch.float32)
    got = merge_state_dicts({"post": post, "d": delta}, "graft", base="post", dtype=torch.float32,
                            parameters={**parameters, "role": {"d": "delta"}})
    assert_identical(got, expected)


def _nan_delta(qwen) -> dict:
    delta = {name: torch.zeros(t.shape) for name, t in read_model(qwen["post"]).items()}
    delta["model.norm.weight"][0] = float("nan")
    return delta


IN_MEMORY_REFUSALS = {
    "no model config": (lambda q, post: adapter_in_memory(q["plain"], post), "needs the model's config (model_config="),
    "another shape": (lambda q, post: adapter_in_memory(q["narrow"], post, model_config={}), "so Δ is 32×32, but"),
    "whole tensors, no donor": (lambda q, post: adapter_in_memory(q["lora"], post, model_config={}),
                                "stores whole tensors (model.embed_tokens.weight"),
    "DoRA": (lambda q, post: adapter_in_memory(q["dora"], post, model_config={}), "use_dora = true"),
    "not tensors": (lambda q, post: lora_delta_state_dict({"x": 1}, {"peft_type": "LORA", "r": 2, "lora_alpha": 2},
                                                          post, model_config={}),
                    "must map PEFT's key names to tensors, got 'x': int"),
    "config not a dict": (lambda q, post: lora_delta_state_dict({}, "adapter_config.json", post, model_config={}),
                          "the adapter config must be a dict"),
    "model not a state dict": (lambda q, post: adapter_in_memory(q["plain"], [post], model_config={}),
                               "model must be a state dict (name -> tensor) or a torch module, got list"),
    "quantised model": (lambda q, post: adapter_in_memory(q["plain"], post, model_config={
        "quantization_config": {"load_in_4bit": True}}), "is quantised"),
}


@pytest.mark.parametrize("case", list(IN_MEMORY_REFUSALS))
def test_bad_adapters_in_memory_are_one_line(qwen, misfits, case):
    make, expected = IN_MEMORY_REFUSALS[case]
    with pytest.raises(GraftError) as error:
        make({**qwen, **misfits}, read_model(qwen["post"]))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_nan_delta_in_memory_is_refused_before_any_work(qwen):
    from mergekit.merge_methods import merge_state_dicts

    with pytest.raises(GraftError, match=r"delta \(input 'd'\): delta tensor 'model.norm.weight' contains NaN or Inf"):
        merge_state_dicts({"post": read_model(qwen["post"]), "d": _nan_delta(qwen)}, "graft", base="post",
                          parameters={"role": {"d": "delta"}})
