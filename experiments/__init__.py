"""The repository's research, kept out of the installed package: the small-LM experiment of
`python -m experiments.demo` with its pre-registrations, verdicts and re-analysis, the SmolLM2
precondition, and the statistics only they use. experiments/README.md says how to reproduce
each recorded result."""
