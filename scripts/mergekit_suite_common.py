"""The ``tests/common.py`` that mergekit's test modules import and its sdist does not ship, written here.

scripts/mergekit_suite.sh copies this file into the unpacked sdist as ``tests/common.py`` so
that the six modules importing it run. It provides what they call: tiny random models of the
architectures they merge (Llama, GPT-2 with 12 layers, Granite, LLaVA), saved as
safetensors folders, and :func:`run_and_check_merge`, which runs a merge into a temporary
folder and checks the result is a loadable, finite model. graftmerge's own code; the names and
signatures are those the modules call.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from mergekit.config import MergeConfiguration
from mergekit.io.lazy_tensor_loader import LazyTensorLoader
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from transformers import (
    AutoConfig,
    CLIPVisionConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
)


def _save(model, path) -> str:
    """Random weights (fixed per folder name, so a rerun builds the same models) as a safetensors folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _seeded(path) -> None:
    torch.manual_seed(sum(map(ord, Path(path).name)))


def _llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def make_picollama(path, vocab_size: int = 64) -> str:
    """A two-layer Llama, hidden size 32, with ``vocab_size`` embeddings; its folder's path."""
    _seeded(path)
    return _save(LlamaForCausalLM(_llama_config(vocab_size)), path)


def make_gpt2size(path) -> str:
    """GPT-2's layout and layer count (12 blocks, tied embeddings), at a tiny width; its folder's path."""
    _seeded(path)
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=12, n_head=4)
    return _save(GPT2LMHeadModel(config), path)


def make_picogranite(path, vocab_size: int = 64) -> str:
    """A two-layer Granite (Llama-like with its multipliers); its folder's path."""
    _seeded(path)
    config = GraniteConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return _save(GraniteForCausalLM(config), path)


def make_picoLlaVa(path, vocab_size: int = 64) -> str:  # noqa: N802 - the name mergekit's tests import
    """A LLaVA: a two-layer CLIP vision tower, the projector, and the two-layer Llama above; its folder's path."""
    _seeded(path)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_llama_config(vocab_size), image_token_index=vocab_size - 1)
    return _save(LlavaForConditionalGeneration(config), path)


def run_and_check_merge(config: MergeConfiguration, *, check_nan: bool = True, validate=None,
                        auto_arch: bool = False, options: MergeOptions | None = None) -> None:
    """Merge ``config`` into a temporary folder with mergekit's ``run_merge``; the folder must hold a config
    transformers reads and safetensors weights, every tensor finite (``check_nan``); then ``validate(folder)``.

    ``auto_arch``: the inputs' architecture is one mergekit infers rather than looks up (a VLM); its
    ``run_merge`` does that by itself, so the flag only documents the case.
    """
    del auto_arch
    with tempfile.TemporaryDirectory(prefix="mergekit-suite-") as folder:
        run_merge(config, folder, options=options or MergeOptions())
        AutoConfig.from_pretrained(folder)
        loader = LazyTensorLoader.from_disk(folder)
        names = list(loader.index.tensor_paths)
        assert names, f"{folder}: no tensors written"
        assert any(Path(folder, shard).suffix == ".safetensors" for shard in set(loader.index.tensor_paths.values()))
        if check_nan:
            bad = [name for name in names if not torch.isfinite(loader.get_tensor(name).float()).all()]
            assert not bad, f"non-finite values in {bad[:5]}"
        if validate is not None:
            validate(folder)
