"""Plain-torch model families; `families.py` describes each (classes, TP plan, shape, HF).

Importing this package imports no torch: the planner reads `models.families` before any
process starts, and a model module is imported when a model of its family is built.
"""

from __future__ import annotations

import dataclasses

from models.families import family


def build(name: str, fields: dict):
    """Family `name`'s model, uninitialised, from config fields (ones it does not use are
    ignored). Build under `torch.device("meta")` to get shapes without memory."""
    model_cls, args_cls = family(name).classes()
    names = {f.name for f in dataclasses.fields(args_cls)}
    return model_cls(args_cls(**{k: v for k, v in fields.items() if k in names}))
