"""Pure tensor math of a graft: tensors in, tensors out; no file is opened here.

donor_delta       Δ = Σ λ_i (θft_i − θdonor) + Σ λ_j δ_j
scores            diagonal and KFAC direction scores
selection         exact top-k masks, ⌈ρ·D⌉
global_threshold  streaming exact radix select over a model's scores
projection        Δ' = Δ − masked part (diagonal, KFAC)
mask_stats        per-ρ thresholds, masked counts and removed shares (plan, compress)
delta_stats       norms and Fisher-weighted shares of a delta (delta stats)
kfac              the KfacFactors value type
eigenbasis        a factor's eigendecomposition, the eigenvalue clamp, the orthonormality check
low_rank          Δ̃ = c·(UᵀL)(RV) for a low-rank Δ = c·L·R (a LoRA), without the dense Δ
fisher_average    θ = Σ w F̂ θ / Σ w F̂ (Fisher merging), and the plain weighted average
regmean           Wᵀ = (Σ w G̃)⁻¹ Σ w G̃ Wᵀ (RegMean), in float64
"""
