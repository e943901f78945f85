"""adapter/mergekit_compat.py against the mergekit that pyproject.toml pins: every internal it names exists
with the shape it relies on, and its hooks work. A mergekit upgrade that moves one fails here first."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mergekit.io.tasks import LoaderCache
from mergekit.io.tensor_writer import TensorWriter
from mergekit.merge_methods.base import GroupMergeMethod
from packaging.requirements import Requirement
from safetensors.torch import load_file

from graftmerge.adapter import mergekit_compat
from graftmerge.errors import GraftError
from tests.helpers.runners import run_process

ROOT = Path(__file__).resolve().parents[1]


def test_the_pin_is_the_one_pyproject_declares_and_the_installed_mergekit_meets_it():
    [line] = re.findall(r'^\s*"(mergekit[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    pin = Requirement(line)
    assert str(pin.specifier) == str(Requirement(f"mergekit{mergekit_compat.PINNED}").specifier)
    assert pin.specifier.contains(importlib.metadata.version("mergekit"))


@pytest.mark.parametrize("name, parameters", [
    ("_model_out_config", ["config", "arch_info", "trust_remote_code"]),
    ("_copy_tokenizer", ["merge_config", "out_path", "options"]),
    ("_copy_tagalong_files", ["merge_config", "out_path", "files", "options"]),
    ("run_merge", ["merge_config", "out_path", "options", "config_source"]),
])
def test_the_private_functions_of_mergekit_merge_exist_with_their_parameters(name, parameters):
    function = getattr(mergekit_compat._merge_module(), name)
    function = getattr(function, "__wrapped__", function)  # run_merge: graftmerge's wrapper
    assert list(inspect.signature(function).parameters) == parameters


def test_the_private_methods_it_overrides_exist_with_their_parameters():
    assert list(inspect.signature(TensorWriter._write_shard_task).parameters) == [
        "self", "shard_data", "shard_index", "shard_path"]
    execute = inspect.signature(GroupMergeMethod._execute).parameters
    assert list(execute) == ["self", "groups", "parameters", "options", "input_dtypes", "out_dtype"]
    assert execute["input_dtypes"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_loader_cache_is_one_dict_for_every_instance_and_the_block_leaves_it_as_it_was():
    assert LoaderCache().loaders is LoaderCache().loaders
    before = dict(LoaderCache().loaders)
    with mergekit_compat.loaders_in_cache({"a-reference": "a loader"}):
        assert LoaderCache().loaders["a-reference"] == "a loader"
    assert LoaderCache().loaders == before


def test_a_shard_writer_writes_what_shard_tensors_returns_and_is_told_after(tmp_path):
    class Doubling(mergekit_compat.ShardWriter):
        written = 0

        def shard_tensors(self, shard_data):
            return {name: tensor * 2 for name, tensor in shard_data.items()}

        def shard_written(self):
            self.written += 1

    writer = Doubling(str(tmp_path), SimpleNamespace(out_shard_size=1 << 30, safe_serialization=True))
    writer.save_tensor("w", torch.ones(3))
    writer.finalize()
    [shard] = tmp_path.glob("*.safetensors")
    assert torch.equal(load_file(shard)["w"], torch.full((3,), 2.0)) and writer.written == 1


def test_run_merge_is_wrapped_once_and_routes_only_its_methods():
    calls = []
    module = SimpleNamespace(run_merge=lambda config, out, options=None, config_source=None: calls.append("mk"))
    routes = {"graft": lambda original, config, out, options, source: calls.append("graft")}
    mergekit_compat.wrap_run_merge(module, routes)
    wrapped = module.run_merge
    mergekit_compat.wrap_run_merge(module, routes)
    assert module.run_merge is wrapped
    module.run_merge(SimpleNamespace(merge_method="graft"), "out", None)
    module.run_merge(SimpleNamespace(merge_method="linear"), "out", None)
    assert calls == ["graft", "mk"]


def test_settings_reach_the_route_and_a_method_without_a_route_refuses_them():
    seen = []
    module = SimpleNamespace(run_merge=lambda config, out, options=None, config_source=None: seen.append("mk"))
    routes = {"graft": lambda original, config, out, options, source, **settings: seen.append(settings)}
    mergekit_compat.wrap_run_merge(module, routes)
    module.run_merge(SimpleNamespace(merge_method="graft"), "out", None, use_threshold_cache=False)
    assert seen == [{"use_threshold_cache": False}]
    with pytest.raises(GraftError, match="use_threshold_cache: only for graft merges, not merge_method linear"):
        module.run_merge(SimpleNamespace(merge_method="linear"), "out", None, use_threshold_cache=False)
    assert seen == [{"use_threshold_cache": False}]


def test_registering_twice_is_harmless():
    registered = []
    registry = SimpleNamespace(registered_methods=lambda: registered, register=registered.append)
    method = SimpleNamespace(spec=SimpleNamespace(name="graft"))
    mergekit_compat.register(registry, [method])
    mergekit_compat.register(registry, [method])
    assert registered == [method]


@pytest.mark.parametrize("first_import", ["import graftmerge.adapter.mergekit_compat",
                                          "from graftmerge import lora_delta_state_dict"])
def test_the_compat_module_imported_first_in_a_process_and_the_methods_still_register(first_import):
    """It imports no ``mergekit.merge_methods`` module, whose registry's hook registers the methods built on it."""
    code = (f"{first_import}\nfrom mergekit.merge_methods import registry\n"
            "print(*(registry.get(m).spec.name for m in ('graft', 'fisher', 'regmean')))")
    result = run_process("python", "-c", code)
    assert result.returncode == 0 and result.stdout.split() == ["graft", "fisher", "regmean"], result.stderr[-2000:]
