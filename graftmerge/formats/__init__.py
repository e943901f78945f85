"""Artifacts on disk, read lazily and validated: one module per format.

checkpoint      a folder of safetensors shards (model inputs), headers first
fisher_cache    Fisher caches (format v1, ``docs/formats/fisher-cache.md``)
delta_folder    delta folders written by ``graftmerge delta extract`` (``docs/formats/delta-folder.md``)
lora_adapter    PEFT LoRA adapter folders opened and checked (config and tensor list)
peft_rules      PEFT's reading of adapter_config.json: accepted fields, adapted modules, scaling
lora_binding    an adapter bound to a model: each tensor it changes, shapes and layer types checked
lora_sources    a bound adapter read as Δ (``role: delta``) or merged θft (``BASE+ADAPTER``)
rotation_store  the threshold pass's scratch Δ̃ = UᵀΔV, reused by the merge
gguf_import     a GGUF file turned into a safetensors model folder
gguf_header     a GGUF header read strictly: every count and length checked against the file first
file_hash       sha256 of a file, for identities and uploads
json_file       manifests and indexes read defensively: size and nesting capped, no repeated key
manifest_schema Fisher and delta manifests checked field by field
output_folder   every output folder: built beside OUT under a lock, then replacing it whole
May import: ``math``, ``errors``.
"""
