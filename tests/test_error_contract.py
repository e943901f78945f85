"""The error contract at every boundary: one ``error:`` line, exit 2, OUT absent, inputs untouched.

Issue 24, class 7. Each hostile input is run through ``mergekit-yaml`` and ``graftmerge
merge`` (in process) and through mergekit's Python API (``run_merge``, GraftError):

* a JSON or YAML integer past Python's 4300-digit conversion limit (json and yaml raise
  a plain ValueError), in a merge config, a Fisher manifest, a delta manifest, a shard
  index, a safetensors header, an adapter_config.json and an input's config.json;
  and an integer under the limit but past float's range in a graft parameter;
* a Fisher manifest whose entries name a tensor of another shape or another weight
  (found only in the global pass before);
* inputs mergekit itself cannot load: no config.json, or another architecture's
  config.json (accepted with mergekit's own ``--allow-crimes``, with the post model's
  architecture);
* click's own usage errors, which print ``error:`` like every other refusal.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from graftmerge.adapter import import_hook
from graftmerge.demo.tiny_models import tiny_config
from graftmerge.errors import GraftError
from graftmerge.pipeline.config_files import read_merge_config
from graftmerge.pipeline.delta_extract import extract_delta, extract_lora
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import copy_model, read_model, tree_digest
from tests.helpers.runners import run_cli, run_process

HUGE = "1" + "0" * 5000  # past Python's 4300-digit int/str conversion limit
WIDE = "1" + "0" * 400  # an int Python reads, float cannot hold


def inject_huge(file: Path) -> Path:
    """``file`` (a JSON object) with a 5000-digit integer as its first member."""
    text = file.read_text().lstrip()
    assert text.startswith("{")
    file.write_text('{"hostile": ' + HUGE + ", " + text[1:])
    return file


def inject_huge_header(shard: Path) -> Path:
    """A safetensors shard whose JSON header holds a 5000-digit integer (its data unchanged)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = b'{"hostile": ' + HUGE.encode() + b", " + data[8 : 8 + length].lstrip()[1:]
    shard.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length :])
    return shard


def edit_manifest(cache: Path, edit) -> Path:
    """Apply ``edit`` to a Fisher cache's manifest in place."""
    file = cache / "fisher_manifest.json"
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest))
    return cache


def delta_config(post: Path, delta: Path) -> str:
    """A graft of one ``role: delta`` input onto ``post``."""
    return (f"merge_method: graft\nbase_model: {post}\nmodels:\n  - model: {delta}\n    parameters: {{role: delta}}\n"
            "dtype: float32\nout_dtype: float32\n")


@pytest.fixture(scope="module")
def hostile(tied_models, tied_diag_cache, tmp_path_factory) -> dict[str, Path]:
    """Hostile copies of the tied inputs, made once."""
    root = tmp_path_factory.mktemp("contract")
    m = tied_models
    paths: dict[str, Path] = {}
    delta = extract_delta(m["donor"], m["donor_ft"], root / "delta", progress=False)
    paths["delta"] = Path(delta)
    paths["lora"] = Path(extract_lora(m["donor"], m["donor_ft"], root / "lora", rank=2, progress=False).path)

    paths["delta_huge"] = copy_model(paths["delta"], root / "delta_huge")
    inject_huge(paths["delta_huge"] / "delta_manifest.json")
    paths["lora_huge"] = copy_model(paths["lora"], root / "lora_huge")
    inject_huge(paths["lora_huge"] / "adapter_config.json")
    paths["lora_wide"] = copy_model(paths["lora"], root / "lora_wide")
    _replace_number(paths["lora_wide"] / "adapter_config.json", "lora_alpha", WIDE)
    paths["delta_wide"] = copy_model(paths["delta"], root / "delta_wide")
    _replace_number(paths["delta_wide"] / "delta_manifest.json", "weight", WIDE)
    paths["index_huge"] = copy_model(m["donor_ft"], root / "index_huge")
    inject_huge(paths["index_huge"] / "model.safetensors.index.json")
    paths["header_huge"] = copy_model(m["donor_ft"], root / "header_huge")
    inject_huge_header(sorted(paths["header_huge"].glob("*.safetensors"))[0])
    paths["config_huge"] = copy_model(m["donor_ft"], root / "config_huge")
    inject_huge(paths["config_huge"] / "config.json")
    paths["fisher_huge"] = Path(shutil.copytree(tied_diag_cache, root / "fisher_huge"))
    inject_huge(paths["fisher_huge"] / "fisher_manifest.json")

    # a weight's diagonal naming another weight's tensor (another shape); two factor sides sharing a tensor
    paths["fisher_foreign_diag"] = edit_manifest(Path(shutil.copytree(tied_diag_cache, root / "foreign_diag")),
                                                 lambda e: e["entries"]["model.layers.0.input_layernorm.weight"]
                                                 ["diagonal"].update(key="model.layers.0.mlp.gate_proj.weight"))
    paths["fisher_shared_tensor"] = edit_manifest(write_mixed_cache(root / "shared_tensor", m["post"]),
                                                  _share_eigenvalues)

    paths["delta_configless"] = copy_model(paths["delta"], root / "delta_configless")
    (paths["delta_configless"] / "config.json").unlink()
    paths["donor_configless"] = copy_model(m["donor"], root / "donor_configless")
    (paths["donor_configless"] / "config.json").unlink()
    gpt2 = tiny_config("gpt2").to_dict()
    gpt2["architectures"] = ["GPT2LMHeadModel"]
    for name, source in (("ft_gpt2", m["donor_ft"]), ("delta_gpt2", paths["delta"])):
        paths[name] = copy_model(source, root / name)
        (paths[name] / "config.json").write_text(json.dumps(gpt2))
    return paths


def _replace_number(file: Path, key: str, digits: str) -> None:
    """The top-level number ``key`` of a JSON file rewritten as ``digits`` (json cannot write such an integer)."""
    value = json.loads(file.read_text())
    assert isinstance(value[key], int | float)
    value[key] = "@@number@@"
    file.write_text(json.dumps(value).replace('"@@number@@"', digits))


def _share_eigenvalues(manifest: dict) -> None:
    """One factor side's eigenvalues key names another side's tensor, of another size."""
    factors = manifest["factors"]
    sizes = {record["size"] for record in factors.values()}
    assert len(sizes) > 1
    first = next(key for key, record in factors.items() if record["size"] == min(sizes))
    other = next(key for key, record in factors.items() if record["size"] != min(sizes))
    factors[first]["eigenvalues"] = factors[other]["eigenvalues"]


def _configs(m: dict[str, Path], h: dict[str, Path], diag: Path) -> dict[str, tuple[str, str, Path | None]]:
    """case → (config YAML, a fragment of its one-line error, the hostile input whose digest must not change)."""
    plain = lambda **kw: graft_yaml(m["post"], kw.get("donor", m["donor"]),  # noqa: E731
                                    [(kw.get("ft", m["donor_ft"]), kw.get("weight", 1.0))],
                                    rho=kw.get("rho", 0.0), fisher=kw.get("fisher"))
    return {
        "yaml parameter past float": (plain(weight=WIDE), "must be a finite number", None),
        "fisher manifest huge int": (plain(rho=0.1, fisher=h["fisher_huge"]), "integer of more than 4300 digits",
                                     h["fisher_huge"]),
        "delta manifest huge int": (delta_config(m["post"], h["delta_huge"]), "integer of more than 4300 digits",
                                    h["delta_huge"]),
        "adapter_config huge int": (delta_config(m["post"], h["lora_huge"]), "integer of more than 4300 digits",
                                    h["lora_huge"]),
        "adapter lora_alpha past float": (delta_config(m["post"], h["lora_wide"]), "lora_alpha must be a number",
                                          h["lora_wide"]),
        "delta weight past float": (delta_config(m["post"], h["delta_wide"]), "not a finite number", h["delta_wide"]),
        "shard index huge int": (plain(ft=h["index_huge"]), "integer of more than 4300 digits", h["index_huge"]),
        "safetensors header huge int": (plain(ft=h["header_huge"]), "integer of more than 4300 digits",
                                        h["header_huge"]),
        "config.json huge int": (plain(ft=h["config_huge"]), "integer of more than 4300 digits", h["config_huge"]),
        "diagonal names another weight": (plain(rho=0.1, fisher=h["fisher_foreign_diag"]),
                                          "model.layers.0.input_layernorm.weight", h["fisher_foreign_diag"]),
        "factor sides share a tensor": (plain(rho=0.1, fisher=h["fisher_shared_tensor"]), "names tensor",
                                        h["fisher_shared_tensor"]),
        "configless delta": (delta_config(m["post"], h["delta_configless"]), "has no config.json",
                             h["delta_configless"]),
        "configless donor": (plain(donor=h["donor_configless"]), "has no config.json", h["donor_configless"]),
        "gpt2 donor_ft": (plain(ft=h["ft_gpt2"]), "GPT2LMHeadModel", h["ft_gpt2"]),
        "gpt2 delta": (delta_config(m["post"], h["delta_gpt2"]), "--allow-crimes", h["delta_gpt2"]),
    }


CASES = ["yaml parameter past float", "fisher manifest huge int", "delta manifest huge int", "adapter_config huge int",
         "adapter lora_alpha past float", "delta weight past float",
         "shard index huge int", "safetensors header huge int", "config.json huge int",
         "diagonal names another weight", "factor sides share a tensor", "configless delta", "configless donor",
         "gpt2 donor_ft", "gpt2 delta"]


def one_line(result, fragment: str) -> str:
    """Exit 2, exactly one non-blank line of output, starting ``error:`` and holding ``fragment``; no traceback."""
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert result.returncode == 2, output[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), output[-3000:]
    assert "Traceback" not in output and fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_hostile_input_is_one_line_through_both_clis_and_python(tmp_path, tied_models, hostile, tied_diag_cache,
                                                                 case):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config, fragment, hostile_input = _configs(tied_models, hostile, tied_diag_cache)[case]
    (tmp_path / "graft.yml").write_text(config)
    before = tree_digest(hostile_input) if hostile_input is not None else None
    for command in (["mergekit-yaml"], ["graftmerge", "merge"]):
        one_line(run_cli(*command, str(tmp_path / "graft.yml"), str(tmp_path / "out")), fragment)
        assert not (tmp_path / "out").exists()
    import_hook.install()
    with pytest.raises(GraftError, match=fragment.replace(".", r"\.").replace("-", r"\-")):
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(config)), str(tmp_path / "out"),
                  options=MergeOptions(quiet=True))
    assert not (tmp_path / "out").exists()
    if hostile_input is not None:
        assert tree_digest(hostile_input) == before


def test_huge_integer_in_the_merge_config_itself(tmp_path, tied_models):
    m = tied_models
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]).replace("lambda: 1.0", f"lambda: {HUGE}")
    assert HUGE in config
    (tmp_path / "graft.yml").write_text(config)
    for command in (["mergekit-yaml"], ["graftmerge", "merge"]):
        one_line(run_cli(*command, str(tmp_path / "graft.yml"), str(tmp_path / "out")),
                 "integer of more than 4300 digits")
    one_line(run_cli("graftmerge", "plan", str(tmp_path / "graft.yml"), "--rho", "0.1"),
             "integer of more than 4300 digits")
    (tmp_path / "multi.yml").write_text("name: first\n" + config)
    one_line(run_cli("mergekit-multi", str(tmp_path / "multi.yml"), "-I", str(tmp_path / "inter")),
             "integer of more than 4300 digits")
    assert not (tmp_path / "out").exists()
    with pytest.raises(GraftError, match="integer of more than 4300 digits"):
        read_merge_config(str(tmp_path / "graft.yml"))


def test_a_misspelt_top_level_key_is_named_by_every_command_that_reads_a_config(tmp_path, tied_models):
    """``base_modle:`` is named with the key meant, not reported as a missing base_model; mergekit-multi's own
    ``name:`` is a key it reads; a stock method's config is left to mergekit, which ignores unknown keys."""
    m = tied_models
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]).replace("base_model:", "base_modle:")
    (tmp_path / "graft.yml").write_text(config)
    fragment = "graft.yml: unknown key base_modle (did you mean base_model?)"
    for command in (["mergekit-yaml", "graft.yml", "out"], ["graftmerge", "merge", "graft.yml", "out"],
                    ["graftmerge", "plan", "graft.yml", "--rho", "0.1"],
                    ["graftmerge", "sweep", "graft.yml", "--lambda", "1", "--rho", "0", "-o", "out"]):
        one_line(run_cli(*command, cwd=tmp_path), fragment)
        assert not (tmp_path / "out").exists()
    (tmp_path / "multi.yml").write_text("name: first\n" + config)
    one_line(run_cli("mergekit-multi", "multi.yml", "-I", "inter", cwd=tmp_path), fragment.replace("graft", "multi"))
    (tmp_path / "linear.yml").write_text(f"merge_method: linear\nmodels:\n  - model: {m['post']}\n"
                                         "    parameters: {weight: 1.0}\nnotes: mergekit ignores this\n")
    assert read_merge_config(str(tmp_path / "linear.yml"))[0].merge_method == "linear"


def test_foreign_architecture_is_merged_with_allow_crimes_as_the_post_architecture(tmp_path, tied_models, hostile):
    """mergekit's own switch lets it through; the post model's architecture plans the merge, whatever the set order."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    m = tied_models
    honest = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)])
    crime = graft_yaml(m["post"], m["donor"], [(hostile["ft_gpt2"], 1.0)])
    (tmp_path / "honest.yml").write_text(honest)
    (tmp_path / "crime.yml").write_text(crime)
    assert run_cli("mergekit-yaml", str(tmp_path / "honest.yml"), str(tmp_path / "honest")).returncode == 0
    result = run_cli("graftmerge", "merge", str(tmp_path / "crime.yml"), str(tmp_path / "crime"), "--allow-crimes")
    assert result.returncode == 0, result.stderr[-3000:]
    expected = read_model(tmp_path / "honest")
    got = read_model(tmp_path / "crime")
    assert got.keys() == expected.keys() and all(got[n].equal(expected[n]) for n in expected)
    assert json.loads((tmp_path / "crime" / "config.json").read_text())["model_type"] == "qwen3"
    import_hook.install()
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(crime)), str(tmp_path / "py"),
              options=MergeOptions(quiet=True, allow_crimes=True))
    got = read_model(tmp_path / "py")
    assert all(got[n].equal(expected[n]) for n in expected)


@pytest.mark.parametrize("arguments, fragment", [
    (["graftmerge", "merge"], "Missing argument 'CONFIG_FILE'"),
    (["graftmerge", "merge", "graft.yml", "a-file"], "is a file"),
    (["graftmerge", "merge", "graft.yml", "out", "--no-such-option"], "No such option"),
    (["graftmerge", "no-such-command"], "No such command"),
    (["graftmerge", "fisher", "estimate"], "Missing argument"),
    (["mergekit-yaml"], "Missing argument 'CONFIG_FILE'"),
    (["mergekit-multi", "graft.yml", "--no-such-option"], "No such option"),
])
def test_usage_errors_are_one_error_line_too(tmp_path, tied_models, arguments, fragment):
    m = tied_models
    (tmp_path / "graft.yml").write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)]))
    (tmp_path / "a-file").write_text("not a folder")
    line = one_line(run_cli(*arguments, cwd=tmp_path), fragment)
    assert "--help" in line
    assert not (tmp_path / "out").exists()


def test_sweep_and_a_real_mergekit_yaml_process_check_inputs_too(tmp_path, tied_models, hostile):
    """``graftmerge sweep`` checks what mergekit loads; the stock console script (hook from the .pth) says one line."""
    m = tied_models
    config = graft_yaml(m["post"], hostile["donor_configless"], [(m["donor_ft"], 1.0)])
    (tmp_path / "graft.yml").write_text(config)
    one_line(run_cli("graftmerge", "sweep", str(tmp_path / "graft.yml"), "--lambda", "0.5,1", "--rho", "0",
                     "-o", str(tmp_path / "grid")), "has no config.json")
    assert not (tmp_path / "grid").exists()
    (tmp_path / "huge.yml").write_text(config.replace("lambda: 1.0", f"lambda: {HUGE}"))
    one_line(run_process("mergekit-yaml", str(tmp_path / "huge.yml"), str(tmp_path / "out")),
             "integer of more than 4300 digits")
    assert not (tmp_path / "out").exists()  # the configless donor through the CLIs: the hostile cases above
