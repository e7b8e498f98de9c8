"""Plain-torch model families. Each entry maps a family name to (model class, args dataclass)."""

from __future__ import annotations

import dataclasses

from torch import nn

from models.deepseek import DeepSeek, DeepSeekArgs
from models.gpt import GPT, GPTArgs
from models.llama import LlamaArgs, Transformer
from models.mixtral import Mixtral, MixtralArgs

MODELS = {
    "llama": (Transformer, LlamaArgs),
    "gpt": (GPT, GPTArgs),
    "mixtral": (Mixtral, MixtralArgs),
    "deepseek": (DeepSeek, DeepSeekArgs),
}


def build(family: str, fields: dict) -> nn.Module:
    """The family's model, uninitialised, from config fields (ones it does not use are ignored).

    Build under `torch.device("meta")` to get shapes without memory.
    """
    model_cls, args_cls = MODELS[family]
    names = {f.name for f in dataclasses.fields(args_cls)}
    return model_cls(args_cls(**{k: v for k, v in fields.items() if k in names}))
