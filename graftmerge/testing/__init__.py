"""Models for tests, benchmarks and demos: generated tiny checkpoints and the SmolLM2 fixture."""
