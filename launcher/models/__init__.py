"""Plain-torch model families; `families.py` describes each (classes, TP plan, shape, HF).

Importing this package imports no torch: the planner reads `models.families` before any
process starts, and a model module is imported when a model of its family is built.
"""

from __future__ import annotations

import dataclasses

from launcher.models.config import ModelConfig
from launcher.models.families import family

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def build(name: str, fields: dict):
    """Family `name`'s model, uninitialised, from model config fields. A key that is not a
    field of ModelConfig (launcher/models/config.py) is an error; a field left out takes its default
    there (a checkpoint saved before the field existed); the model reads those its family's
    Args declare. Build under `torch.device("meta")` to get shapes without memory."""
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not model config fields (launcher/models/config.py)"
        )
    full = {**dataclasses.asdict(ModelConfig()), **fields}
    model_cls, args_cls = family(name).classes()
    return model_cls(args_cls(**{f.name: full[f.name] for f in dataclasses.fields(args_cls)}))
