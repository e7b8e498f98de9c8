"""Where configs come from: the built-in groups shipped inside the package (launcher/conf/) and
the user's own directories, which are searched first, so that a user's preset sits beside the
built-in ones, may extend one (Hydra defaults: `defaults: [llama3_8b, _self_]`) and may shadow
one by name.

A user names their directories in any of three ways:
- `--config-dir DIR` (Hydra's flag),
- `hydra.searchpath=[DIR,file://DIR2,pkg://package.module]` (Hydra's setting),
- the environment variable LAUNCHER_CONFIG_PATH=DIR:DIR2 (set once, in a shell profile or a
  job script).
The command line comes first, then the variable, then the built-in configs.

A command's entry reads them once (`adopt`) and writes the whole list, absolute, back into
LAUNCHER_CONFIG_PATH: every process the command starts (torchrun's ranks and their restarts, a
sweep's jobs, SLURM's tasks) inherits it, and the search path plugin
(hydra_plugins/llm_launcher_configs) puts the directories in front of the built-in ones for
Hydra. Hydra is imported only to read a hydra.searchpath list.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

ENV = "LAUNCHER_CONFIG_PATH"
BUILTIN = Path(__file__).resolve().parent / "conf"
# Hydra's own flag and its short form (`--config-dir DIR`, `--config-dir=DIR`, `-cd DIR`).
DIR_FLAGS = ("--config-dir", "-cd")
SEARCHPATH = "hydra.searchpath"


class ConfigDirProblem(ValueError):
    """A named configuration directory that is not one (the message names it and how)."""


def user_dirs() -> list[Path]:
    """The user's directories, in the order they are searched (LAUNCHER_CONFIG_PATH)."""
    return [_absolute(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]


def search_dirs() -> list[Path]:
    """Every directory a config group is looked up in, the first match winning."""
    return [*user_dirs(), BUILTIN]


def _absolute(path: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path.strip())))


def is_user(path: Path) -> bool:
    return BUILTIN not in path.parents


def options(group: str) -> dict[str, Path]:
    """The choices of a config group (`model`, `hardware`, `recipe`, `hydra/launcher`), each with
    the file it is read from: the first directory that has it."""
    found: dict[str, Path] = {}
    for root in search_dirs():
        folder = root / group
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


def groups() -> list[str]:
    """The config groups of every directory (a folder holding YAML files)."""
    names = {
        folder.name
        for root in search_dirs()
        if root.is_dir()
        for folder in root.iterdir()
        if folder.is_dir() and folder.name != "hydra" and any(folder.glob("*.yaml"))
    }
    return sorted(names)


def folders(group: str) -> list[Path]:
    """The group's folders, in search order."""
    return [root / group for root in search_dirs() if (root / group).is_dir()]


def shown(path: Path) -> str:
    """A path as the messages show it: a built-in one from the package's parent
    (launcher/conf/model/), a user's one whole."""
    if not is_user(path):
        return path.relative_to(BUILTIN.parent.parent).as_posix()
    return str(path)


def user_files(choices: Mapping[str, str | None]) -> dict[str, str]:
    """Of Hydra's group choices (`hydra.runtime.choices`), those read from a user's directory:
    `{"model=my_llama": "/home/me/conf/model/my_llama.yaml"}` (what the plan shows)."""
    out = {}
    for group, choice in sorted(choices.items()):
        if not choice or group.startswith("hydra/"):
            continue
        path = options(group).get(str(choice))
        if path is not None and is_user(path):
            out[f"{group}={choice}"] = str(path)
    return out


def adopt(argv: list[str]) -> list[str]:
    """The command line without its configuration directories, which go in front of
    LAUNCHER_CONFIG_PATH's (absolute, every one checked); raises ConfigDirProblem."""
    rest, named = [], []
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in DIR_FLAGS:
            if not eq:
                value = next(args, "")
            if not value:
                raise ConfigDirProblem(f"{flag} needs a directory: {flag} DIR")
            named.append((f"{flag} {value}", value))
        elif flag.lstrip("+") == SEARCHPATH:
            named += [(f"{SEARCHPATH}: {entry}", _entry_dir(entry)) for entry in _entries(value)]
        else:
            rest.append(arg)
    from_env = [(f"{ENV}={os.environ[ENV]}", str(p)) for p in user_dirs()]
    dirs: list[Path] = []
    for how, value in [*named, *from_env]:
        path = _absolute(value)
        if not path.is_dir():
            raise ConfigDirProblem(f"{how}: {path} is not a directory of configs")
        if path not in dirs and path != BUILTIN:
            dirs.append(path)
    if dirs:
        os.environ[ENV] = os.pathsep.join(map(str, dirs))
    return rest


def _entries(value: str) -> list[str]:
    """hydra.searchpath's list, read by Hydra's own grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (parsed,) = OverridesParser.create().parse_overrides([f"{SEARCHPATH}={value}"])
        entries = parsed.value()
    except Exception as e:  # Hydra's grammar error: say it in one line
        raise ConfigDirProblem(
            f"{SEARCHPATH}={value}: not a list of directories ({str(e).strip().splitlines()[0]}); "
            f"write {SEARCHPATH}=[DIR,file://DIR2]"
        ) from None
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigDirProblem(
            f"{SEARCHPATH}={value}: takes a list of directories, {SEARCHPATH}=[DIR,file://DIR2]"
        )
    return entries


def _entry_dir(entry: str) -> str:
    """A search path entry as a directory: `file://DIR`, `pkg://package.module`, or a path."""
    if entry.startswith("file://"):
        return entry.removeprefix("file://")
    if entry.startswith("pkg://"):
        name = entry.removeprefix("pkg://").replace("/", ".")
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigDirProblem(f"{SEARCHPATH}: {entry}: no package {name!r} is importable")
        return list(spec.submodule_search_locations)[0]
    return entry
