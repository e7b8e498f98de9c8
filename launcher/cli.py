"""What every command shares: the Hydra entry, run ids, and exit code 2 for user mistakes.

User mistakes (a typo in an override, a wrong type, a layout that breaks a rule) end with one
message on stderr and exit status 2, never a traceback. Crashes of the engine keep exit 1.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import difflib
import enum
import functools
import hashlib
import os
import re
import sys
import threading
import time
import typing
from collections.abc import Callable

from omegaconf import BooleanNode, DictConfig, FloatNode, IntegerNode, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from launcher import configs
from launcher.config import Config, register_configs
from launcher.layout import LAYOUT_OVERRIDES

USAGE_ERROR = 2
CONF_DIR = str(configs.BUILTIN)  # the built-in configs; the user's come first (launcher/configs.py)
_task_started = False


@functools.cache
def run_id() -> str:
    """A run name every rank of one job agrees on without talking to the others. Resolved
    once per process: Hydra resolves `hydra.sweep.dir` again for every job of a sweep, and
    all of them belong in the one directory."""
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ["TORCHELASTIC_RUN_ID"] != "none":
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_STEP_ID', '0')}"
    return time.strftime("%Y-%m-%d_%H-%M-%S")


def run_name(model_name: str, overrides: str) -> str:
    """`outputs/${run_name:...}`: the model's name, plus a hash of the command's overrides when
    it has any. The same command gets the same directory, so that running it again resumes
    from its checkpoints; another command gets another one."""
    items = re.split(r",(?=[+~]*[\w.]+=)", overrides) if overrides else []
    if "parallel.auto=true" in items:  # the same run on whatever world and layout it gets
        kept = [o for o in items if o == "parallel.auto=true" or not o.startswith(LAYOUT_OVERRIDES)]
        overrides = ",".join(kept)
    if not overrides:
        return str(model_name)
    return f"{model_name}-{hashlib.sha1(overrides.encode()).hexdigest()[:8]}"


def on_cuda(device_type: str, dtype: str) -> str:
    """`${on_cuda:${hardware.device_type},bf16}`: bf16 on CUDA, fp32 elsewhere."""
    return dtype if str(device_type).endswith("cuda") else "fp32"


def fail(message: str) -> None:
    """Report a user mistake and exit 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(USAGE_ERROR)


def print_table(module: str, markdown: Callable[[], str], doc: str | None, args: list[str]) -> int:
    """`python -m MODULE ARGS`, a command that prints one generated table: `-h` shows what it
    is, any other argument is refused (exit 2) rather than ignored."""
    if args in (["-h"], ["--help"]):
        print(f"usage: python -m {module}\n\n{(doc or '').strip()}")
        return 0
    if args:
        fail(f"{' '.join(args)}: python -m {module} takes no arguments (it prints a table)")
    sys.stdout.write(markdown())
    return 0


def quick_exit(status: int = 0) -> None:
    """End a command that has finished, as Python would but without tearing its modules
    down: with torch's distributed packages imported, that teardown (module dicts cleared,
    garbage collections over about a million objects) costs a process 1.5-2.5 s of CPU on
    this machine, which every rank paid after its run was over. What the teardown would
    still do is done first: the threads Python waits for joined (threading's own exit
    step, which also ends idle thread pools), the atexit handlers run (wandb's, logging's,
    torch's), the standard streams flushed."""
    exit_steps()
    os._exit(status)


def exit_steps() -> None:
    """What Python's exit does before its teardown: the threads it waits for joined, the
    atexit handlers run, the standard streams flushed."""
    threading._shutdown()  # what the interpreter calls first at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def adopt_config_dirs(argv: list[str]) -> list[str]:
    """The command line without the user's configuration directories, which this process
    and the ones it starts then search (launcher/configs.py); one that is not there exits 2."""
    try:
        return configs.adopt(argv)
    except configs.ConfigDirProblem as e:
        fail(str(e))


def to_config(dcfg: DictConfig) -> Config:
    """The composed DictConfig as the typed dataclass tree the planner works on.

    Also refuses keys the schema lacks that were added with `+key=value` (Hydra lets those
    through a structured config).
    """
    extra = unknown_keys(dcfg, Config)
    if extra:
        fail(
            f"unknown config key(s): {', '.join(extra)} (see `python -m launcher.train --cfg job`)"
        )
    try:
        return OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        fail(f"config: {e}")


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of `node` that the dataclass `schema` does not declare."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in node:
        if key not in hints:
            found.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):
            found += unknown_keys(node[key], hints[key], f"{prefix}{key}.")
    return found


def misspelled(arg: str) -> str | None:
    """An override `a.b=v` whose key the schema does not have, named with the closest ones it
    has (Hydra's own message suggests `+a.b=v`, which the schema refuses too)."""
    match = re.fullmatch(r"([A-Za-z_][\w]*(?:\.[\w]+)+)=.*", arg)
    if not match:  # a group choice, +key, ~key, a flag, hydra's own settings
        return None
    schema, done = Config, []
    for part in match[1].split("."):
        if schema is Config and part == "hydra":
            return None
        hints = typing.get_type_hints(schema)
        if part not in hints:
            near = difflib.get_close_matches(part, list(hints), n=3)
            where = ".".join(done) or "the config"
            hint = (
                f" (did you mean {' or '.join('.'.join([*done, n]) for n in near)}?)"
                if near
                else ""
            )
            return (
                f"{match[1]}: {where} has no setting {part!r}{hint}; "
                "`python -m launcher.train --cfg job` lists every setting"
            )
        schema, done = hints[part], [*done, part]
        if not dataclasses.is_dataclass(schema):
            return None
    return None


def unknown_choice(arg: str) -> str | None:
    """`model=llama3_dbug`: a choice its config group does not have, `hardwre=h100_80g`: a
    group no directory has, each named with the closest ones there are, the user's
    directories' included (Hydra's own message lists every option beside its config search
    path, or suggests `+hardwre=...`)."""
    match = re.fullmatch(r"\+?([a-z_]+)=([\w./-]+)", arg)
    if not match or match[1] == "hydra" or match[2] == "null":
        return None  # hydra/launcher=...: Hydra's own groups come from its packages too
    group, choice = match.groups()
    folders = configs.folders(group)
    if not folders:
        return unknown_group(group, arg)
    options = configs.options(group)
    if choice in options:
        return None
    near = difflib.get_close_matches(choice, list(options), n=3)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    where = " and ".join(f"{configs.shown(f)}/" for f in folders)
    listed = ", ".join(options) if len(options) <= 12 else f"{len(options)} of them in {where}"
    return f"{arg}: no such {group}{hint}; the {group} options: {listed}"


def unknown_group(group: str, arg: str) -> str | None:
    """`hardwre=h100_80g`: neither a config group nor a setting of the config's top level."""
    if group in typing.get_type_hints(Config):
        return None  # a top-level setting (Hydra and the schema check its value)
    known = configs.groups()
    near = difflib.get_close_matches(group, known, n=3)
    hint = f" (did you mean {' or '.join(f'{n}=' for n in near)}?)" if near else ""
    return (
        f"{arg}: no config group {group!r}{hint}; the groups: {', '.join(known)} "
        "(`--help` lists their options)"
    )


# What a value must look like for a setting of each type (OmegaConf's own node validates it).
VALUE_NODES = {
    int: (IntegerNode, "an integer"),
    float: (FloatNode, "a number"),
    bool: (BooleanNode, "true or false"),
}


def wrong_type(arg: str) -> str | None:
    """`train.steps=abc`: a value the setting's type cannot take, said with what it takes
    (Hydra's own message names the schema's class and suggests HYDRA_FULL_ERROR)."""
    match = re.fullmatch(r"([A-Za-z_]\w*(?:\.\w+)+)=(.*)", arg)
    value = match and match[2]
    if not value or value == "null" or value[0] in "$[{'\"" or re.search(r"[,(*]", value):
        return None  # interpolations, lists, quoted or swept values: Hydra's grammar decides
    schema: typing.Any = Config
    for part in match[1].split("."):
        if not dataclasses.is_dataclass(schema):
            return None
        schema = typing.get_type_hints(schema).get(part)
    if isinstance(schema, type) and issubclass(schema, enum.Enum):
        names = [m.name for m in schema]
        if value in names:
            return None
        return f"{arg}: {match[1]} takes one of {', '.join(names)}"
    node, what = VALUE_NODES.get(schema, (None, ""))
    if node is None:
        return None
    try:
        node(value=value)
    except ValidationError:
        return f"{arg}: {match[1]} takes {what}, not {value!r}"
    return None


# Hydra's own flags, long and short (`python -m launcher.train --help` lists them).
HYDRA_FLAGS = {
    "--help": "-h",
    "--hydra-help": None,
    "--version": None,
    "--cfg": "-c",
    "--resolve": None,
    "--package": "-p",
    "--run": "-r",
    "--multirun": "-m",
    "--shell-completion": "-sc",
    "--config-path": "-cp",
    "--config-name": "-cn",
    "--config-dir": "-cd",
    "--experimental-rerun": None,
    "--info": "-i",
}


def unknown_flag(arg: str) -> str | None:
    """`--stpes 5`: a flag Hydra does not have (its own message is argparse's usage line of
    a script named train.py), named with the closest ones, and the settings' spelling."""
    if not arg.startswith("-") or re.fullmatch(r"-[\d.]+", arg):
        return None
    name = arg.split("=", 1)[0]
    if name in HYDRA_FLAGS or name in HYDRA_FLAGS.values():
        return None
    near = difflib.get_close_matches(name, list(HYDRA_FLAGS), n=2)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return (
        f"{arg}: no such flag{hint}; settings are key=value (train.steps=100, not "
        "--steps 100): `--help` lists the flags and the config groups"
    )


def override_problem(arg: str) -> str | None:
    """What is wrong with one command-line argument, checked before Hydra composes: a
    setting the schema lacks, a group choice the group lacks, a value of the wrong type, a
    flag Hydra lacks, an override Hydra's grammar cannot read, a sweep with such a value
    (None: nothing this can tell; Hydra and the schema check the rest)."""
    return (
        misspelled(arg)
        or unknown_choice(arg)
        or wrong_type(arg)
        or unknown_flag(arg)
        or swept_problem(arg)
    )


@functools.cache
def _override_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


@functools.lru_cache(maxsize=256)
def parsed_override(arg: str):
    """Hydra's reading of one override (once per argument: the checks before composing and
    the sweep check both read it); raises Hydra's error where its grammar cannot read it."""
    return _override_parser().parse_overrides([arg])[0]


def is_sweep(arg: str) -> bool:
    """Whether Hydra reads `arg` as a sweep (key=a,b, key=range(a,b), ...)."""
    if arg.startswith("-") or "=" not in arg:
        return False
    try:
        return parsed_override(arg).is_sweep_override()
    except Exception:  # a grammar error: swept_problem says it
        return False


def swept_problem(arg: str) -> str | None:
    """`train.steps=[1`: what Hydra's override grammar cannot read, in one line; `model=a,b`,
    `train.steps=abc,2`: a sweep's value its group or setting cannot take (Hydra would say
    either with its parser's or its schema's trace)."""
    from hydra.errors import HydraException

    if arg.startswith("-") or "=" not in arg:
        return None
    try:
        parsed = parsed_override(arg)
    except HydraException as e:
        why = str(e).strip().splitlines()[0]
        return (
            f"{arg}: not an override ({why}); a setting is key=value, a sweep key=a,b or "
            "key=range(a,b) (https://hydra.cc/docs/advanced/override_grammar/basic)"
        )
    try:
        values = list(parsed.sweep_string_iterator()) if parsed.is_sweep_override() else []
    except HydraException:  # glob() and interval(): Hydra's sweepers enumerate them
        values = []
    key = arg.split("=", 1)[0].lstrip("+~")
    for value in values:
        if problem := unknown_choice(f"{key}={value}") or wrong_type(f"{key}={value}"):
            return f"{arg}: {problem}"
    return None


def whole_dict(arg: str) -> str:
    """`data.val_sources={a: x}` as `++data.val_sources={a: x}`: a setting that is a mapping
    takes the one given whole (Hydra's struct mode would refuse its new keys)."""
    key = arg.split("=", 1)[0]
    if arg.startswith(("+", "~")) or "=" not in arg or "." not in key:
        return arg
    schema: typing.Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(schema):
            return arg
        schema = typing.get_type_hints(schema).get(part)
    return f"++{arg}" if typing.get_origin(schema) is dict else arg


def compose(overrides: list[str]) -> Config:
    """The typed Config `launcher.train` would build from these overrides, without running:
    composed once per process for each list of overrides (Hydra takes 0.1-0.2 s; the docs'
    tables and the tests compose the same recipes many times), each call given its own copy."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> Config:
    return to_config(compose_dict(list(overrides)))


def compose_dict(overrides: list[str]) -> DictConfig:
    """The composed (untyped) DictConfig of these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    hydra_app(lambda cfg: None)  # registers the schema and resolvers
    for arg in overrides:  # the commands' own wording before Hydra's (hydra_app's entry)
        if problem := override_problem(arg):
            raise ValueError(problem)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose("config", overrides=[whole_dict(o) for o in overrides])


def hydra_app(task: Callable[[DictConfig], None]) -> Callable[[], None]:
    """Wrap a Hydra task so that composition errors (raised before it starts) exit 2."""
    import hydra

    register_configs()
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id)
        OmegaConf.register_new_resolver("run_name", run_name)
        OmegaConf.register_new_resolver("on_cuda", on_cuda)

    @functools.wraps(task)
    def started(dcfg: DictConfig) -> None:
        global _task_started
        _task_started = True
        task(dcfg)

    main = hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)(started)

    def entry() -> None:
        sys.argv[1:] = adopt_config_dirs(sys.argv[1:])
        for arg in sys.argv[1:]:
            if problem := override_problem(arg):
                fail(problem)
        multirun = [a for a in sys.argv[1:] if a in ("-m", "--multirun")]
        if not multirun and (swept := next(filter(is_sweep, sys.argv[1:]), None)):
            fail(f"{swept}: a sweep runs with -m (--multirun), each of its values a run")
        # -m first: written among the overrides, it would split them in two for Hydra's parser
        # (which takes one run of them: "unrecognized arguments").
        rest = [whole_dict(a) for a in sys.argv[1:] if a not in ("-m", "--multirun")]
        sys.argv[1:] = multirun[:1] + rest
        try:
            main()
        except SystemExit as e:
            # Hydra reports a bad override or config with exit 1 before the task runs.
            if e.code == 1 and not _task_started:
                sys.exit(USAGE_ERROR)
            raise

    return entry
