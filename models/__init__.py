"""Plain-torch model families. Each entry maps a family name to (model class, args dataclass)."""

from models.llama import LlamaArgs, Transformer

MODELS = {"llama": (Transformer, LlamaArgs)}
