"""Core layer: errors, the model spec, sources and checkpoint headers. Imports nothing else of adapt."""
