"""The merge pipeline: a graft config in, a model (or a report) out.

config_files      merge config files read: YAML parsed, mergekit's schema checked, one-line errors
graft_plan        validate a config; open its inputs (GraftPlan, GraftInputs)
trusted_code      which inputs may run their own code (the trust_remote_code parameter)
threshold_pass    the streaming pre-pass that finds the global ⌈ρ·D⌉-th score
merge_run         MergeRun: one merge's state (inputs, threshold, kept masks), born and gone with it
graft             each tensor's record, and the staged, validated merge around mergekit
graft_kernel      one tensor's graft from its record: calls math/ and formats/ only
lora_inputs       LoRA adapters inside mergekit's graph (loaders, config view, low-rank Δ̃)
mask_preview      what each ρ would mask (graftmerge plan), from one scoring pass
sweep             a λ × ρ grid in one run (Grid)
card_writer       the README.md card of every model folder written
suggest           ρ and λ from the removed-share curve and a KL budget
delta_extract     write Δ = weight·(θft − θdonor) as a delta folder
delta_report      where a delta writes (norms, Fisher-weighted shares)
fisher_compress   a rank-K Fisher cache from a full one, with its mask overlap
May import: ``math``, ``formats``, ``hub`` (never ``estimate``, its sibling).

mergekit's registry is imported first, before any module here: its import hook then registers
graftmerge's methods (which import this package's modules) while none of them is half-initialised.
"""

import mergekit.merge_methods  # noqa: F401 - first, for the reason above
