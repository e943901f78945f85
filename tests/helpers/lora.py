"""PEFT LoRA adapters for tests: made by ``peft`` itself on tiny generated models, and
PEFT's own Δ (``get_delta_weight``) as the reference."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from graftmerge.demo.tiny_models import ARCHITECTURES

PREFIX = "base_model.model."


def load_model(folder: Path, architecture: str):
    return getattr(transformers, ARCHITECTURES[architecture][1]).from_pretrained(folder, dtype=torch.float32)


def make_adapter(base: Path, out: Path, architecture: str = "qwen3", seed: int = 1, **config) -> Path:
    """A PEFT LoRA of ``base`` with random (non-zero) A and B, saved by PEFT."""
    model = get_peft_model(load_model(base, architecture), LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(out)
    return out


def peft_deltas(base: Path, adapter: Path, architecture: str = "qwen3") -> dict[str, torch.Tensor]:
    """PEFT's get_delta_weight of every LoRA layer, keyed by the model's parameter name."""
    model = PeftModel.from_pretrained(load_model(base, architecture), adapter)
    return {
        name.removeprefix(PREFIX) + ".weight": module.get_delta_weight("default").detach()
        for name, module in model.named_modules() if isinstance(module, LoraLayer)
    }
