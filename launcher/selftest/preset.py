"""The hardware preset the self-test writes: the composed hardware it ran on, field by field,
with the collective figures the fabric fitted, into the user's configuration directory (the
first of them; else the self-test's own RUN_DIR/conf), so that `hardware=NAME` plans with it.

It never replaces a file it did not write: a preset of that name without its first line is
refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from enum import Enum
from pathlib import Path

from launcher import configs

MARK = "# Written by python -m launcher.selftest"


class PresetProblem(ValueError):
    pass


def preset_name(cfg) -> str:
    return cfg.selftest.preset or f"{cfg.hardware.name}_selftest"


def target(cfg, run_dir: Path) -> tuple[Path, bool]:
    """Where the preset goes, and whether that is a directory the user's commands search
    already."""
    name = preset_name(cfg)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise PresetProblem(f"selftest.preset={name}: a preset's name is letters, digits, _ . -")
    users = configs.user_dirs()
    base = users[0] if users else run_dir / "conf"
    path = base / "hardware" / f"{name}.yaml"
    if path.exists() and not path.read_text().startswith(MARK):
        raise PresetProblem(
            f"{path} exists and launcher.selftest did not write it: give selftest.preset "
            "another name"
        )
    return path, bool(users)


def text(cfg, fitted: dict[str, float], measured_on: str) -> str:
    hw = cfg.hardware
    values = {}
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        values[f.name] = value.value if isinstance(value, Enum) else value
    values.update({k: float(f"{v:.4g}") for k, v in fitted.items()})
    values["name"] = preset_name(cfg)
    values["fitted"] = measured_on
    lines = [
        MARK + f" ({measured_on}).",
        f"# The preset {hw.name} as the self-test ran it, with the collective figures its fabric",
        f"# rows fitted: {', '.join(sorted(fitted))}.",
    ]
    for key, value in values.items():
        shown = json.dumps(value) if isinstance(value, str) else value  # a YAML string
        lines.append(f"{key}: {shown}")
    return "\n".join(lines) + "\n"


def write(cfg, fitted: dict[str, float], measured_on: str, run_dir: Path) -> tuple[Path, bool]:
    path, searched = target(cfg, run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text(cfg, fitted, measured_on))
    tmp.replace(path)
    return path, searched
