"""The post model under FSDP2: built on the meta device, each rank reading only its own rows.

``fully_shard`` goes on every decoder layer (the classes the model names in
``_no_split_modules``) and on the root, so a forward or backward holds one layer's full
weights at a time. Parameters are created on the meta device (buffers such as rotary
frequencies are computed for real: they are small and not in the checkpoint); then each
rank allocates its dim-0 shard of every parameter and fills it from the safetensors
files with a row slice, so no process ever holds, or even reads, the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from graftmerge.errors import GraftError
from graftmerge.estimate.model_loading import DTYPES, LOAD_ERRORS
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.math.ownership import row_range


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device (no memory, no init); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        """Register ``parameter`` as usual, then swap it for a meta-device parameter of the same kind."""
        register(module, name, parameter)
        if parameter is not None and parameter.device.type != "meta":
            kind = type(parameter)
            module._parameters[name] = kind(parameter.to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def model_dtype(config, dtype: str) -> torch.dtype:
    """The dtype to compute in: ``--dtype``, or for ``auto`` the one config.json records (float32 if none)."""
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return DTYPES[dtype]
    # transformers >= 4.56 calls it dtype (reading its old name, torch_dtype, logs a deprecation notice)
    recorded = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) else torch.float32


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules of the classes in the model's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise GraftError(
            f"cannot shard {type(model).__name__} with --fsdp: it names no decoder-layer class "
            "(_no_split_modules); run without --fsdp"
        )
    return layers


def build_meta_model(folder: Path, config, *, dtype: torch.dtype, attn_implementation: str,
                     trust_remote_code: bool) -> nn.Module:
    """The model's modules with every parameter on the meta device."""
    try:
        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
    except (*LOAD_ERRORS, RuntimeError) as error:
        raise GraftError(f"cannot build {folder} as a causal LM: {str(error).splitlines()[0]}") from error


def load_sharded_model(folder: Path, config, *, dtype: torch.dtype, device: torch.device, rank: int,
                       world_size: int, attn_implementation: str = "sdpa",
                       trust_remote_code: bool = False) -> nn.Module:
    """The post model, ``fully_shard``-ed per decoder layer and at the root, each rank holding its rows only."""
    model, checkpoint = checked_meta_model(folder, config, dtype=dtype, attn_implementation=attn_implementation,
                                           trust_remote_code=trust_remote_code)
    return shard_and_fill(model, checkpoint, device=device, rank=rank, world_size=world_size)


def checked_meta_model(folder: Path, config, *, dtype: torch.dtype, attn_implementation: str = "sdpa",
                       trust_remote_code: bool = False) -> tuple[nn.Module, Checkpoint]:
    """(meta model, its checkpoint) once every parameter is found in the files with its shape: no collective yet."""
    model = build_meta_model(folder, config, dtype=dtype, attn_implementation=attn_implementation,
                             trust_remote_code=trust_remote_code)
    decoder_layers(model)
    checkpoint = Checkpoint(folder, label="post model")
    for name, parameter in model.named_parameters():
        info = checkpoint.tensors.get(name)
        if info is None:
            raise GraftError(f"post model {folder} has no tensor {name!r}, which the model needs")
        if tuple(info.shape) != tuple(parameter.shape):
            raise GraftError(f"post model tensor {name!r} has shape {tuple(info.shape)}, "
                             f"the model's config makes it {tuple(parameter.shape)}")
    return model, checkpoint


def shard_and_fill(model: nn.Module, checkpoint: Checkpoint, *, device: torch.device, rank: int,
                   world_size: int) -> nn.Module:
    """``fully_shard`` every decoder layer and the root, allocate this rank's shards, read its rows."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates each rank's parameter shards (and buffers, restored next)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        fill_owned_rows(model, checkpoint, rank, world_size)
    return model.eval()


def fill_owned_rows(model: nn.Module, checkpoint: Checkpoint, rank: int, world_size: int) -> None:
    """Copy this rank's dim-0 rows of every parameter from the safetensors files (a slice read, nothing more)."""
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        start, stop = row_range(parameter.shape[0], world_size, rank)
        if local.shape[0] != stop - start:
            raise GraftError(f"FSDP shards {name!r} into {local.shape[0]} rows on rank {rank}, "
                             f"expected {stop - start}")
        if stop > start:
            local.copy_(checkpoint.read(name, (start, stop)))
