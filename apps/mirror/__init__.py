"""The model mirror: GGUF headers read in place, and the memory a model needs from its shape."""
