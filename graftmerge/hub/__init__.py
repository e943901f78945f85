"""Share graftmerge artifacts (Fisher caches, deltas) as Hugging Face Hub model repos; pull PEFT LoRA adapters.

``push`` and ``pull`` move an artifact (resumable, partial by layers, offline from the HF
cache: ``cache_layout``), ``artifact_kind`` and ``kinds`` say what each artifact is,
``content_ids`` checks files against the Hub's hashes, ``hub_errors`` turns
huggingface_hub's exceptions into one line, ``cards`` writes model cards (``merge_cards``: those of
merged models and extracted adapters, in their inputs' model tree),
``references`` parses (and checks) ``org/name@rev``, ``untrusted`` checks what a Hub
repo or a shared cache hands over (file names, links, configs that name code),
``models`` points a merge config's Hub-id models at the local cache; the thin click
commands are in ``graftmerge.cli.hub``.
"""
