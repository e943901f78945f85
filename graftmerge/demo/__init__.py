"""Small, self-contained numeric demonstrations of the ideas behind grafting (no checkpoints, no IO)."""
