"""Training data before tokenization: the source list, row formats, mixing arithmetic and validation (no torch)."""
