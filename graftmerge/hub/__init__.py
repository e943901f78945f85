"""Share graftmerge artifacts (Fisher caches, deltas) as Hugging Face Hub model repos.

``artifacts`` pushes and pulls (resumable, partial by layers, offline from the HF
cache), ``kinds`` says what each artifact is, ``cards`` writes model cards,
``references`` parses ``org/name@rev``, ``models`` points a merge config's Hub-id
models at the local cache, ``cli`` holds the thin click commands.
"""
