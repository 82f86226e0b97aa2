"""Model layer: intake (checkpoint to ModelSpec), structure, skeletons and the tiny test zoo."""
