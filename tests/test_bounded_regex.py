"""Regular expressions from an adapter_config.json run in bounded time (issue 24, class 3).

PEFT matches ``rank_pattern`` / ``alpha_pattern`` keys, a string ``target_modules`` or
``exclude_modules`` and ``layers_pattern`` with Python's backtracking ``re``: a nested
quantifier such as ``([\\w.]+)+`` takes exponential time on a module name it fails to match
(``(.*\\.)?((.*)*\\.nothing)$`` does not finish in minutes on ``model.layers.0.self_attn.q_proj``).
graftmerge keeps Python's meaning and matches on RE2 (linear time): a backtracking pattern
RE2 runs merges exactly as PEFT would in well under the test's time bound, through every
entry point, and ``delta pull``; a pattern RE2 cannot express (backreference, lookaround)
is refused in one line naming the config file, the field and the pattern, before any
tensor is read or any weight fetched. Ordinary patterns match exactly as PEFT matches them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import transformers
from peft import LoraConfig
from safetensors.torch import load_file

from graftmerge.demo.tiny_models import ARCHITECTURES, make_graft_inputs, save_tiny_model
from graftmerge.errors import GraftError
from graftmerge.formats import bounded_regex
from graftmerge.formats.lora_adapter import CONFIG_NAME, WEIGHTS_NAME, open_lora_adapter
from graftmerge.formats.peft_rules import check_adapter_config, pattern_key, peft_adapts
from graftmerge.pipeline.lora_inputs import lora_delta_state_dict
from tests.helpers.configs import graft_yaml
from tests.helpers.lora import make_adapter as make_random_adapter
from tests.helpers.models import assert_identical, read_model, tree_digest
from tests.helpers.runners import run_cli, run_process

BOUND_S = 10.0  # what a run with hostile patterns may take at most (a backtracking one would take hours)

# Each field's hostile patterns mean, on every module name of the model, what the adapter's
# own config says; each is exponential in Python's re on the names it does not match.
HOSTILE = {
    "rank_pattern": ("lists", {"rank_pattern": {r"(.*)*\.nothing": 8, r"([\w.]+)+\.v_proj": 2}}),
    "alpha_pattern": ("lists", {"alpha_pattern": {r"(.*)*\.nothing": 100, r"([\w.]+)+\.down_proj": 3}}),
    "target_modules": ("lists", {"target_modules": r"(.*)*\.nothing|([\w.]+)+\.(q_proj|v_proj|down_proj)"}),
    "exclude_modules": ("lists", {"exclude_modules": r"([\w.]+)+\.nothing"}),
    "layers_pattern": ("layers", {"layers_pattern": [r"([\w.]+)+X", "layers"]}),
}
# Patterns RE2 cannot express (they need backtracking): refused, whatever they would match.
UNBOUNDED = {
    "rank_pattern": ({"rank_pattern": {r"(\w)\1_proj": 2}}, "rank_pattern key", "a backreference"),
    "alpha_pattern": ({"alpha_pattern": {r"(?=down)down_proj": 3}}, "alpha_pattern key", "lookahead"),
    "target_modules": ({"target_modules": r".*(?<!k)_proj"}, "target_modules", "lookbehind"),
    "exclude_modules": ({"exclude_modules": r"(.)\1.*"}, "exclude_modules", "a backreference"),
    "layers_pattern": ({"layers_pattern": [r"(?!blocks)layers"]}, "layers_pattern", "lookahead"),
}


def make_adapter(base: Path, out: Path, **config) -> Path:
    """A PEFT LoRA of the tiny Qwen3 ``base`` with random non-zero factors, saved by PEFT."""
    return make_random_adapter(base, out, "qwen3", seed=7, **config)


def with_config(adapter: Path, target: Path, changes: dict) -> Path:
    """A copy of ``adapter`` whose adapter_config.json has ``changes`` (the same weights)."""
    shutil.copytree(adapter, target)
    config = json.loads((target / CONFIG_NAME).read_text())
    config.update(changes)
    (target / CONFIG_NAME).write_text(json.dumps(config))
    return target


def delta_yaml(post: Path, adapter: Path | str) -> str:
    """``adapter`` grafted onto ``post`` as ``role: delta``, weight 0.7, ρ = 0."""
    return (f"merge_method: graft\nbase_model: {post}\nmodels:\n  - model: {adapter}\n"
            "    parameters: {role: delta, weight: 0.7}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n"
            "dtype: float32\nout_dtype: float32\n")


def timed_merge(tool: str, config_text: str, folder: Path) -> tuple[object, float]:
    """``tool`` (graftmerge merge, or mergekit-yaml) on ``config_text`` into ``folder/out``: result, seconds."""
    config = folder / "graft.yml"
    config.write_text(config_text)
    args = ("graftmerge", "merge") if tool == "graftmerge" else ("mergekit-yaml",)
    start = time.monotonic()
    result = run_cli(*args, str(config), str(folder / "out"))
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3 post/base, two PEFT adapters of the base with ordinary patterns, and their grafts."""
    root = tmp_path_factory.mktemp("bounded-regex")
    paths = make_graft_inputs(root, seed=0)
    paths["lists"] = make_adapter(paths["donor"], root / "lists", r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj", "down_proj"],
                                  rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    paths["layers"] = make_adapter(paths["donor"], root / "layers", r=4, lora_alpha=8,
                                   target_modules=["q_proj", "up_proj"], layers_to_transform=[1],
                                   layers_pattern="layers")
    for name in ("lists", "layers"):
        (root / f"{name}-graft").mkdir()
        result, _ = timed_merge("mergekit-yaml", delta_yaml(paths["post"], paths[name]), root / f"{name}-graft")
        assert result.returncode == 0, result.stderr[-3000:]
        paths[f"{name}-graft"] = root / f"{name}-graft" / "out"
    return paths


# -- a backtracking pattern that RE2 runs: the merge PEFT's rule gives, in bounded time --------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("field", list(HOSTILE))
def test_a_backtracking_pattern_in_each_field_merges_as_peft_would(tmp_path, models, field):
    name, changes = HOSTILE[field]
    adapter = with_config(models[name], tmp_path / "adapter", changes)
    clean, hostile = open_lora_adapter(models[name]), open_lora_adapter(adapter)  # the Python API
    assert hostile.modules == clean.modules and hostile.full == clean.full
    result, seconds = timed_merge("graftmerge", delta_yaml(models["post"], adapter), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seconds < BOUND_S
    assert_identical(read_model(tmp_path / "out"), read_model(models[f"{name}-graft"]))


@pytest.mark.timeout(120)
def test_every_backtracking_field_at_once_through_mergekit_yaml_base_plus_adapter(tmp_path, models):
    changes = {
        k: v for field in ("rank_pattern", "alpha_pattern", "exclude_modules") for k, v in HOSTILE[field][1].items()
    }
    adapter = with_config(models["lists"], tmp_path / "adapter", changes)
    scalings = {m.module: m.scaling for m in open_lora_adapter(adapter).modules.values()}
    assert scalings["model.layers.0.self_attn.v_proj"] == 4.0 and scalings["model.layers.1.mlp.down_proj"] == 0.75
    (tmp_path / "clean").mkdir()
    expected, _ = timed_merge("mergekit-yaml", graft_yaml(models["post"], models["donor"], [
        (f"{models['donor']}+{models['lists']}", 0.7)]), tmp_path / "clean")
    assert expected.returncode == 0, expected.stderr[-3000:]
    result, seconds = timed_merge("mergekit-yaml", graft_yaml(models["post"], models["donor"], [
        (f"{models['donor']}+{adapter}", 0.7)]), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seconds < BOUND_S
    assert_identical(read_model(tmp_path / "out"), read_model(tmp_path / "clean" / "out"))


@pytest.mark.timeout(60)
def test_matching_is_linear_in_the_name():
    """A pattern that is exponential in Python's re, on a name of 1000 characters: milliseconds."""
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": r"(a|aa)*b",
              "exclude_modules": r"(.*)*\.nothing"}
    check_adapter_config(config, "adapter_config.json")
    start = time.monotonic()
    assert not peft_adapts(config, "a" * 1000, "adapter_config.json")
    assert peft_adapts(config, "a" * 999 + "b", "adapter_config.json")
    assert pattern_key({r"([\w.]+)+\.nothing": 2}, "model." * 150 + "q_proj", "adapter_config.json") is None
    assert time.monotonic() - start < 1.0


# -- a pattern RE2 cannot express: one line, before any tensor ------------------------------------------------------

@pytest.mark.parametrize("field", list(UNBOUNDED))
def test_a_backreference_or_lookaround_is_refused_in_one_line(tmp_path, models, field):
    changes, named, why = UNBOUNDED[field]
    base = "layers" if field == "layers_pattern" else "lists"
    adapter = with_config(models[base], tmp_path / "adapter", changes)
    watched = [models["post"], models["donor"], adapter]
    before = [tree_digest(p) for p in watched]
    result, seconds = timed_merge("graftmerge", delta_yaml(models["post"], adapter), tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert str(adapter / CONFIG_NAME) in lines[0] and named in lines[0] and why in lines[0], lines[0]
    assert "not supported" in lines[0] and seconds < BOUND_S
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    assert [tree_digest(p) for p in watched] == before
    with pytest.raises(GraftError, match=why) as error:  # the Python API: the folder, and in memory
        open_lora_adapter(adapter)
    assert "\n" not in str(error.value)
    post = read_model(models["post"])
    with pytest.raises(GraftError, match=why):
        lora_delta_state_dict(load_file(adapter / WEIGHTS_NAME), json.loads((adapter / CONFIG_NAME).read_text()), post,
                              model_config=json.loads((models["post"] / "config.json").read_text()))


@pytest.mark.parametrize("pattern,expected", [
    (r"(?:a{1000}){1000}", "RE2 cannot compile it"),
    ("q_proj|" * 15_000 + "v_proj", "longer than 100000 characters"),
    (r"(?>q)_proj", "an atomic group" if sys.version_info >= (3, 11) else "not a valid regular expression"),
    (r"q_proj*+", "a possessive quantifier" if sys.version_info >= (3, 11) else "not a valid regular expression"),
    (r"(q)?(?(1)_proj|v_proj)", "a conditional group"),
    (r"(q_proj", "not a valid regular expression"),
])
def test_what_re2_cannot_bound_is_refused_with_the_config(pattern, expected):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": pattern}
    with pytest.raises(GraftError, match=expected) as error:
        check_adapter_config(config, "acme/adapter_config.json")
    message = str(error.value)
    assert message.startswith("acme/adapter_config.json: target_modules ") and "\n" not in message
    assert len(message) < 600


def test_a_name_outside_plain_ascii_is_refused_not_guessed():
    """On other names Python's classes and anchors could differ from RE2's: one line, not a guess."""
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": r".*\.q_proj"}
    for name in ("model.layers.0.q_proj\n", "model.läyers.0.q_proj", "a b.q_proj", "x" * 1001):
        with pytest.raises(GraftError, match="is not printable ASCII") as error:
            peft_adapts(config, name, "adapter_config.json")
        assert "\n" not in str(error.value)


# -- delta pull: patterns checked before the weights are fetched ----------------------------------------------------

def place_in_hf_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """``files`` laid out as the HF cache keeps a download (blobs, refs/main, a snapshot); the snapshot."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def adapter_files(adapter: Path, weights: bool = True) -> dict[str, bytes]:
    """The adapter's files as a repo holds them (without the weights when asked)."""
    names = [CONFIG_NAME, WEIGHTS_NAME] if weights else [CONFIG_NAME]
    return {name: (adapter / name).read_bytes() for name in names}


@pytest.mark.timeout(120)
def test_pull_of_backtracking_patterns_is_bounded_and_takes_the_adapter(tmp_path, models, monkeypatch):
    from huggingface_hub import constants

    changes = {
        k: v for field in ("rank_pattern", "alpha_pattern", "exclude_modules") for k, v in HOSTILE[field][1].items()
    }
    adapter = with_config(models["lists"], tmp_path / "adapter", changes)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    place_in_hf_cache(tmp_path / "hf-cache", "acme/hostile", adapter_files(adapter))
    start = time.monotonic()
    result = run_cli("graftmerge", "delta", "pull", "acme/hostile", "-o", str(tmp_path / "pulled"), "-q")
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < BOUND_S
    assert {p.name: p.read_bytes() for p in (tmp_path / "pulled").iterdir()} == adapter_files(adapter)


@pytest.mark.parametrize("field", ["rank_pattern", "target_modules", "layers_pattern"])
def test_pull_refuses_an_unbounded_pattern_before_fetching_the_weights(tmp_path, models, monkeypatch, field):
    """The cached snapshot has no weights: had the pull tried to fetch them, it would say so instead."""
    from huggingface_hub import constants

    changes, named, why = UNBOUNDED[field]
    adapter = with_config(models["layers" if field == "layers_pattern" else "lists"], tmp_path / "adapter", changes)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    snapshot = place_in_hf_cache(tmp_path / "hf-cache", "acme/unbounded", adapter_files(adapter, weights=False))
    before = tree_digest(tmp_path / "hf-cache")
    result = run_cli("graftmerge", "delta", "pull", "acme/unbounded", "-o", str(tmp_path / "pulled"), "-q")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "acme/unbounded" in lines[0] and CONFIG_NAME in lines[0] and named in lines[0] and why in lines[0]
    assert not (tmp_path / "pulled").exists() and not list(tmp_path.glob(".pulled*"))
    assert tree_digest(tmp_path / "hf-cache") == before and not (snapshot / WEIGHTS_NAME).exists()


@pytest.mark.timeout(120)
def test_pull_as_a_process_ends_within_the_bound(tmp_path, models):
    """A real process (no test harness between it and the clock): the pull of a pattern that would pin a core."""
    adapter = with_config(models["lists"], tmp_path / "adapter", HOSTILE["target_modules"][1])
    place_in_hf_cache(tmp_path / "hf-cache", "acme/hostile", adapter_files(adapter))
    result = run_process("graftmerge", "delta", "pull", "acme/hostile", "-o", str(tmp_path / "pulled"), "-q",
                         env={"HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "pulled" / WEIGHTS_NAME).read_bytes() == (adapter / WEIGHTS_NAME).read_bytes()


# -- ordinary patterns: exactly PEFT's answers ----------------------------------------------------------------------

ORDINARY = ["q_proj", r".*\.q_proj", r".*\.(q_proj|v_proj)", r"model\.layers\.1\.self_attn\..*", "(?i).*Q_PROJ",
            r".*layers\.\d+\.mlp\.(up|down)_proj", ".*attn.*", r"transformer\.h\.\d+\.attn\.c_attn", "^model.*proj$",
            r".*\bc_(attn|proj)", "lm_head", ".*", r"[^.]*\.layers\.[01]\..*_proj", r".*(?:k|v)_proj", r"\w+\.\w+",
            r"model\.layers\.\d{1,2}\..*", "c_attn|c_proj", r".*\.h\.0\..*", r".*(_proj){1,2}", "model.layers.0",
            # as fine-tuning tools write them: one alternation per module kind, or every module spelled out
            r"(?:.*?(?:language|text).*?(?:self_attn|attention|attn|mlp).*?(?:q_proj|k_proj|v_proj|down_proj).*?)|"
            r"(?:\bmodel\.layers\.[\d]{1,}\.(?:self_attn|attention|attn|mlp)\.(?:(?:q_proj|k_proj|up_proj)))",
            "|".join(rf"model\.layers\.{i}\.self_attn\.{m}" for i in range(40) for m in ("q_proj", "v_proj"))]
KEYS = ["q_proj", "layers.1.self_attn.q_proj", r"layers\.\d+\.mlp\.up_proj", "proj", ".*proj", "(?i:V_PROJ)",
        r"h\.\d+\.attn\.c_attn", "model.layers.0", r"self_attn\.(q|k)_proj", "c_attn|c_proj", "mlp", r"\d\.mlp"]
LAYER_PATTERNS = ["layers", "h", ["blocks", "layers"], "model.layers", r"layer\w*", "dec.*", r"(layers|h)", ".*"]


def module_names(tmp_path: Path) -> list[str]:
    """Every module name of tiny Qwen3 and GPT-2 models, and some odd ones."""
    names = [
        "layers.0.q_proj",
        "model.blocks.2.layers.5.q_proj",
        "q_proj",
        "model.layers.1",
        "model.1.layers.0.up_proj",
        "model.decoder.layers.2.self_attn.v_proj",
        "Q_PROJ",
        "x.V_PROJ",
    ]
    for architecture in ("qwen3", "gpt2"):
        save_tiny_model(tmp_path / architecture, seed=0, architecture=architecture)
        model = getattr(transformers, ARCHITECTURES[architecture][1]).from_pretrained(tmp_path / architecture)
        names += [name for name, _ in model.named_modules() if name]
    return names


def test_ordinary_patterns_match_exactly_as_peft_matches_them(tmp_path):
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    names = module_names(tmp_path)
    configs = [{"target_modules": p} for p in ORDINARY]
    configs += [{"target_modules": ["q_proj", "c_attn", "up_proj"], "exclude_modules": p} for p in ORDINARY]
    configs += [{"target_modules": ["q_proj", "c_attn", "up_proj"], "layers_to_transform": layers, "layers_pattern": p}
                for p in LAYER_PATTERNS for layers in ([0], 1, [0, 1, 5])]
    agreed = adapted = 0
    for config in configs:
        ours = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
        check_adapter_config(ours, "adapter_config.json")
        theirs = LoraConfig(r=4, lora_alpha=8, **config)
        for name in names:
            expected = bool(check_target_module_exists(theirs, name))
            assert peft_adapts(ours, name, "adapter_config.json") == expected, (config, name)
            agreed, adapted = agreed + 1, adapted + expected
    for name in names:
        for keys in [*([key] for key in KEYS), KEYS, KEYS[::-1]]:
            theirs = get_pattern_key(keys, name)  # the name itself when no key matches
            expected = theirs if theirs != name or name in keys else None
            assert pattern_key(dict.fromkeys(keys, 2), name, "adapter_config.json") == expected, (keys, name)
            agreed += 1
    assert len(configs) > 60 and agreed > 5000 and adapted > 400


def test_python_s_meaning_is_kept_where_re2_syntax_differs():
    """Python's syntax, RE2's engine: a{,2} is a count in Python (a literal in RE2), [[:alpha:]] a set of
    characters, \\Z the end, (?i) folds the Kelvin sign onto k; each answers as Python's re answers."""
    import re
    import warnings

    cases = [(r"a{,2}", ["a", "aa", "aaa", "a{,2}"]), (r"[[:alpha:]]+", ["a:", "alpha", "[[", "x]"]),
             (r"q_proj\Z", ["q_proj"]), ("(?i)\u212a_proj", ["k_proj", "K_proj", "q_proj"]),
             (r"(?x) q _ proj  # spaces", ["q_proj", "q _ proj"]), (r"\w+\W\d", ["ab.1", "ab_1"])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Python's "possible nested set", for [[:alpha:]]
        for pattern, names in cases:
            for name in names:
                if " " in name:
                    continue  # not a module name
                got = bounded_regex.pattern_fullmatch(pattern, name, "adapter_config.json", "target_modules")
                assert got == (re.fullmatch(pattern, name) is not None), (pattern, name)


@pytest.mark.timeout(60)
def test_a_huge_class_name_in_the_adapter_or_the_model_is_compared_in_bounded_time(tmp_path, models):
    """The model family is a suffix search on auto_mapping's class name and the model's architectures:
    quadratic in the name's length, so a name longer than any class name is compared whole."""
    from graftmerge.formats.lora_binding import check_architecture

    adapter = with_config(models["lists"], tmp_path / "adapter",
                          {"auto_mapping": {"base_model_class": "ForA" * 50_000 + "!", "parent_library": "x"}})
    result, seconds = timed_merge("graftmerge", delta_yaml(models["post"], adapter), tmp_path)
    assert result.returncode == 2 and seconds < BOUND_S, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "an adapter for another architecture" in lines[0] and len(lines[0]) < 1000
    assert not (tmp_path / "out").exists()
    qwen3 = open_lora_adapter(with_config(models["lists"], tmp_path / "qwen3", {"auto_mapping": {
        "base_model_class": "Qwen3ForCausalLM", "parent_library": "transformers.models.qwen3.modeling_qwen3"}}))
    start = time.monotonic()
    with pytest.raises(GraftError, match="an adapter for another architecture"):  # the Python API
        check_architecture(qwen3, {"architectures": ["ForA" * 50_000 + "!"]}, "post model")
    check_architecture(qwen3, {"architectures": ["Qwen3Model"]}, "post model")
    assert time.monotonic() - start < 1.0


def test_a_pattern_nested_too_deeply_is_one_line():
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "exclude_modules": "(" * 5000 + ")" * 5000}
    with pytest.raises(GraftError, match="nests groups too deeply") as error:
        check_adapter_config(config, "adapter_config.json")
    assert "\n" not in str(error.value) and len(str(error.value)) < 600
