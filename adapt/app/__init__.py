"""Application layer: the CLI, its commands, the stage pipeline and the pytest plugin."""
