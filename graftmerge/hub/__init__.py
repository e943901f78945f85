"""Share graftmerge artifacts (Fisher caches, deltas) as Hugging Face Hub model repos; pull PEFT LoRA adapters.

``artifacts`` pushes and pulls (resumable, partial by layers, offline from the HF
cache), ``kinds`` says what each artifact is, ``cards`` writes model cards,
``references`` parses (and checks) ``org/name@rev``, ``untrusted`` checks what a Hub
repo or a shared cache hands over (file names, links, configs that name code),
``models`` points a merge config's Hub-id models at the local cache; the thin click
commands are in ``graftmerge.cli.hub``.
"""
