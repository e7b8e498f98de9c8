"""Hugging Face checkpoints: config.json mapping (config), parameter names per family (names),
safetensors reading and writing (weights). The command line is `python -m launcher.convert`."""
