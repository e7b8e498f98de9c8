"""Kill a training run at each instant of a save, then run it again (tests/checkpoint/
test_save_window.py): `save_window.py OUT WORLD`, results in OUT/results.json.

Every run is the engine's own (tests/jobs.py `train`: the Trainer as launcher.train runs it) on
WORLD processes forked from this one, which imported torch and the engine once: a run costs its
steps, not a start-up. The ranks of a run share a process group of their own; a kill is
SIGKILL to that whole group, sent by one rank from inside the save of step KILL_AT, at:

- write: DCP has written part of a shard file (its third item);
- written: every rank's shards and DCP's .metadata are written, nothing summed yet;
- summing: a rank has summed its first file and not written its sums;
- published: rank 0 has renamed the checkpoint into place, before pruning;
- pruning: rank 0 has renamed the oldest checkpoint out and deleted one of its files.

Each point runs with checkpoint.keep=1 and 3, a checkpoint every step. After the kill the same
command runs again and trains to the end; the uninterrupted run of the same command is the
reference its losses and final parameters must equal bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
STEPS, KILL_AT = 5, 4
POINTS = ("write", "written", "summing", "published", "pruning")
KEEPS = (1, 3)
ARGS = [
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "checkpoint.interval=1",
    "logging.wandb.mode=disabled",
    "logging.tensorboard=false",
    "model.n_layers=1",
    "train.seq_len=64",
    "train.save_final=true",
]


def kill_group() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


def arm(point: str) -> None:
    """Make this rank kill its run's process group at `point` of the save of step KILL_AT.
    Each point asks the path it works on which save it is: the sums, the publish and the
    prune of one save run in the background, and may still run when the next save begins."""
    import torch.distributed.checkpoint.filesystem as fs

    from launcher.checkpoint import saver, store

    ours = store.step_dir("", KILL_AT).name  # step_0000000K, and its .partial

    def of_ours(path) -> bool:
        return any(part.split(".")[0] == ours for part in Path(path).parts)

    if point == "write":
        real, items = fs._write_item, [0]

        def write_item(transforms, stream, *args, **kwargs):
            result = real(transforms, stream, *args, **kwargs)
            items[0] += of_ours(stream.name)
            if items[0] == 3:  # part of this rank's shard written
                stream.flush()
                kill_group()
            return result

        fs._write_item = write_item
    elif point == "written":
        real_sums = saver.write_sums

        def write_sums(directory, *args):
            if of_ours(directory):
                kill_group()
            return real_sums(directory, *args)

        saver.write_sums = write_sums
    elif point == "summing":
        real_crc = store.crc32

        def crc32(path):
            value = real_crc(path)
            if of_ours(path):  # one file summed, its sums not written
                kill_group()
            return value

        store.crc32 = crc32
    elif point == "published":
        real_publish = saver.publish

        def publish(partial, final):
            real_publish(partial, final)
            if of_ours(final):
                kill_group()

        saver.publish = publish
    elif point == "pruning":
        real_prune = saver.prune

        def prune(directory, keep):
            if not (Path(directory) / ours).is_dir():  # another save's prune
                return real_prune(directory, keep)
            real_rmtree = store.shutil.rmtree

            def rmtree(path, *args, **kwargs):
                path = Path(path)
                if path.name.endswith(store.DELETING) and path.is_dir():
                    next(f for f in path.iterdir() if f.is_file()).unlink()
                    kill_group()  # one file of the checkpoint renamed out is gone
                return real_rmtree(path, *args, **kwargs)

            store.shutil.rmtree = rmtree
            return real_prune(directory, keep)

        saver.prune = prune


def rank_main(out: Path, rank: int, world: int, port: int, args: list[str], point: str | None):
    """One rank of a run (a forked child): its output to OUT/log.RANK.txt."""
    log = os.open(out / f"log.{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        import torch.distributed as dist
        from jobs import train

        # The rank that kills: the one that publishes and prunes for those points, else the
        # last (on 2 ranks, one that is not rank 0).
        if point is not None and rank == (0 if point in ("published", "pruning") else world - 1):
            arm(point)
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        train(out, *args)
        if world > 1:
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def run(out: Path, world: int, point: str | None = None, keep: int = 1) -> list[int]:
    """One run of the command in `out` on `world` forked ranks (their own process group);
    each rank's exit status (-9: killed)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [*ARGS, f"hardware.devices_per_node={world}", f"checkpoint.keep={keep}"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, pids[0] if pids else 0)
            rank_main(out, rank, world, port, args, point)
        os.setpgid(pid, pids[0] if pids else pid)  # set on both sides: no race with the kill
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    return codes


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def main(out: Path, world: int) -> None:
    from launcher.runtime.imports import uncollected

    # The engine's imports, once, before the forks, frozen as launcher.agent freezes its own.
    with uncollected():
        import jobs  # noqa: F401

        import launcher.training.trainer  # noqa: F401
        from launcher.checkpoint.reader import checkpoint_damage
        from launcher.checkpoint.store import newest_complete

    results = {"reference": run(out / "reference", world)}
    for point in POINTS:
        for keep in KEEPS:
            case = out / f"{point}-keep{keep}"
            killed = run(case, world, point, keep)
            after_kill = listing(case / "checkpoints")
            newest = newest_complete(case / "checkpoints")
            damage = newest and checkpoint_damage(newest)
            again = run(case, world, keep=keep)
            results[f"{point}-keep{keep}"] = {
                "killed": killed,
                "after_kill": after_kill,
                # The checkpoint the kill left to resume from, and what is wrong with it.
                "newest": newest and newest.step,
                "damage": damage,
                "again": again,
                "after": listing(case / "checkpoints"),
            }
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    # The repository first (tests/models would shadow the `models` package), then tests/.
    here = [TESTS, TESTS / "checkpoint"]
    sys.path[:] = [str(TESTS.parent), *(p for p in sys.path if Path(p).resolve() not in here)]
    sys.path.append(str(TESTS))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), int(sys.argv[2]))
