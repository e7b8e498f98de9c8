"""hydra-submitit-launcher's SLURM launcher with the planner in front of the queue.

`python -m launcher.train -m parallel.tp=1,2,3 hydra/launcher=slurm`:
- every point is planned before anything is submitted; a point that breaks a rule or does not
  fit is printed with its reasons, gets SWEEP_DIR/<n>/rejected.json and never reaches the queue;
  if every point is rejected nothing is submitted (exit 2);
- each job's resources come from its plan: nodes = hardware.nodes, tasks per node =
  hardware.devices_per_node (each task is one rank: launcher/runtime/launch.py maps the SLURM task
  onto torch.distributed), GPUs per node on CUDA. Points with the same resources go as one job
  array; partition, account, qos, constraint, timeout_min, additional_parameters, ... pass
  through as hydra-submitit-launcher names them (`hydra.launcher.partition=...`);
- a parallel.auto point with launch.min_nodes=M below hardware.nodes=N goes as --nodes=M-N
  (every node count planned first); a requeued job gets that range back (restore_span), so
  it starts on what is free and re-plans for it;
- before a time limit or a preemption SLURM sends the warning signal submitit asks for
  (`--signal=USR2@signal_delay_s`): the ranks finish their step, save a checkpoint together
  (launcher/runtime/failures.py) and rank 0 requeues the job, which resumes from that checkpoint (at
  most max_num_timeout times);
- the launcher waits on the queue itself (`scontrol show job`), not on accounting: a job that
  leaves the queue without a result (SIGKILLed, out of memory, its node lost) is failed within
  seconds, on clusters without accounting too, where submitit would wait forever. Each job's
  end is recorded in SWEEP_DIR/<n>/status.json and the sweep goes on; the summary
  (launcher/sweep.py) then shows every point.

Hydra plugins live in the `hydra_plugins` namespace package, which is why this file is here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

# A job's states once it has left the queue (REQUEUED and PREEMPTED may come back: a state
# must last GRACE_S before the job counts as gone, which also lets a result file arrive).
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}
GRACE_S = 15.0
POLL_S = 1.0
# Ranks other than 0 wait this long after a stop for SLURM to end them (requeue), then leave.
REQUEUE_WAIT_S = 120.0


class PlannedSlurmLauncher(SlurmLauncher):
    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        """One task of a job (one rank). A run stopped by SLURM's warning signal has saved a
        checkpoint of its step: requeue the job, which then resumes from it."""
        from launcher.runtime.failures import EXIT_STOPPED

        try:
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        except SystemExit as e:
            if e.code != EXIT_STOPPED:
                raise
            run_dir = Path(str(self.config.hydra.sweep.dir)) / str(job_num)
            _requeue_after_stop(run_dir, int(self.params.get("max_num_timeout", 0)))
            raise

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from launcher.runtime import sweep_files

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # Each job resolves its config again in its own process: a concrete sweep directory
        # keeps all of them in this one.
        with open_dict(self.config):
            OmegaConf.set_readonly(self.config.hydra, False)
            self.config.hydra.sweep.dir = str(sweep_dir)
        groups: dict[tuple, list] = defaultdict(list)
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            job_dir = sweep_dir / str(idx)
            sweep_files.write_json(job_dir / sweep_files.OVERRIDES, list(overrides))
            problems, resources = self._plan(list(overrides))
            if problems:
                print(f"rejected: {' '.join(overrides)}\n{problems}", file=sys.stderr, flush=True)
                sweep_files.write_json(job_dir / sweep_files.REJECTED, {"problems": problems})
                continue
            groups[resources].append((idx, list(overrides)))
        from launcher.cli import fail

        if not groups:
            fail(f"every point of the sweep was rejected; nothing was submitted ({sweep_dir})")
        if shutil.which("sbatch") is None:
            fail(
                "hydra/launcher=slurm submits with SLURM's sbatch, which is not on PATH here: "
                "run this on a SLURM login node, or leave out hydra/launcher=slurm to run the "
                "sweep on this machine"
            )
        returns: list[JobReturn] = []
        for resources, points in groups.items():
            returns += self._submit(dict(resources), points, sweep_dir)
        return returns

    def _plan(self, overrides: list[str]) -> tuple[str, tuple]:
        """(the problems of this point, or ""; its SLURM resources)."""
        from launcher.plan import auto, engine_plan
        from launcher.plan.report import problems_message
        from launcher.plan.search import candidate_overrides, with_overrides

        cfg = self._task_config(overrides)
        if cfg.parallel.auto:  # the job plans for the nodes it gets; every count must work
            cfg, problem = auto.recompose(cfg, overrides, None, self._task_config)
            if problem:
                return problem, ()
        elif cfg.plan.candidate >= 0:  # the job will run the same search, train this layout
            extra, problem = candidate_overrides(cfg)
            if problem:
                return problem, ()
            cfg = self._task_config(with_overrides(overrides, extra))
        plan = engine_plan(cfg)
        hw, low = cfg.hardware, cfg.launch.min_nodes
        cuda = hw.device_type.value == "cuda"
        resources = (
            # A node range (sbatch --nodes=MIN-MAX): SLURM starts the job on as many as are
            # free, also when it is requeued (see _executor).
            ("nodes", f"{low}-{hw.nodes}" if 0 < low < hw.nodes else hw.nodes),
            ("tasks_per_node", hw.devices_per_node),
            ("gpus_per_node", hw.devices_per_node if cuda else None),
        )
        return ("" if plan.ok else problems_message(plan)), resources

    def _task_config(self, overrides: list[str]):
        """The typed Config the task of a job with these overrides receives."""
        from launcher.cli import to_config

        dcfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(dcfg):
            del dcfg["hydra"]
        return to_config(dcfg)

    def _executor(self, resources: dict):
        """submitit's executor with hydra.launcher's parameters and this group's resources
        (as BaseSubmititLauncher.launch builds it)."""
        import submitit

        params = {**self.params, **resources}
        if isinstance(params["nodes"], str):  # MIN-MAX: submitit counts tasks from an int
            extra = dict(params.get("additional_parameters") or {}, nodes=params["nodes"])
            params.update(nodes=int(params["nodes"].split("-")[1]), additional_parameters=extra)
        init = {"folder": params.pop("submitit_folder")}
        init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()}
        )
        return executor

    def _submit(self, resources: dict, points: list, sweep_dir: Path) -> list[JobReturn]:
        """One job array for `points` [(job number, overrides)]; waits for every job and
        returns the completed ones (a failed one is recorded, not raised)."""
        import submitit

        from launcher.runtime import sweep_files

        executor = self._executor(resources)
        args = [
            (o, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            for idx, o in points
        ]
        for idx, overrides in points:
            print(f"\t#{idx} : {' '.join(filter_overrides(overrides))}", flush=True)
        try:
            jobs = executor.map_array(self, *zip(*args, strict=True))
        except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
            from launcher.cli import fail

            lines = [x for x in str(e).splitlines() if x.strip()]
            fail(f"sbatch refused the job: {' / '.join(lines[-3:]) or type(e).__name__}")
        nodes = str(resources["nodes"])
        span = (nodes, resources["tasks_per_node"]) if "-" in nodes else None
        ends = _wait([job for job in jobs], span)
        out = []
        for (idx, _), job in zip(points, jobs, strict=True):
            status, ret = ends[job.job_id]
            if ret is not None:
                out.append(ret)
            sweep_files.write_json(sweep_dir / str(idx) / sweep_files.STATUS, status)
        return out


def queue_record(job_id: str) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict ({} once the controller has forgotten the job)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    record: dict[str, str] = {}
    for item in (out.splitlines() or [""])[0].split():
        key, _, value = item.partition("=")
        record.setdefault(key, value)
    return record


def _wait(
    jobs: list, span: tuple[str, int] | None = None
) -> dict[str, tuple[dict, JobReturn | None]]:
    """Every job's end: ({status, reason, requeued, job_id}, its JobReturn when completed).

    A job is over when its result file exists (submitit writes it, also when the task
    raised), or when it has been out of the queue (ENDED, or unknown to scontrol) for GRACE_S
    without one: then it was killed outright. `span` ("MIN-MAX" nodes, tasks per node): a
    requeued job gets its node range back (restore_span).
    """
    pending = {job.job_id: job for job in jobs}
    gone: dict[str, float] = {}
    restored: dict[str, int] = {}
    ends: dict[str, tuple[dict, JobReturn | None]] = {}
    while pending:
        for job_id, job in list(pending.items()):
            record = queue_record(job_id)
            status = {"job_id": job_id, "requeued": int(record.get("Restarts", 0) or 0)}
            again = record.get("JobState") == "PENDING" and status["requeued"]
            if span and again and restored.get(job_id) != status["requeued"]:
                restore_span(job_id, *span)
                restored[job_id] = status["requeued"]
            if job.paths.result_pickle.exists():
                ends[job_id] = _result(job, status)
            elif record and record.get("JobState") not in ENDED:
                gone.pop(job_id, None)
                continue
            elif time.monotonic() - gone.setdefault(job_id, time.monotonic()) > GRACE_S:
                state = record.get("JobState", "gone from the queue")
                reason = f"job {job_id} ended {state} without a result"
                if record.get("ExitCode"):
                    reason += f" (exit code {record['ExitCode']})"
                status.update(status="failed", reason=reason)
                ends[job_id] = (status, None)
            else:
                continue
            del pending[job_id]
        if pending:
            time.sleep(POLL_S)
    return ends


def restore_span(job_id: str, nodes: str, per_node: int) -> None:
    """Give a requeued job of a node range its range back. SLURM keeps the node and task
    counts of the allocation it had (2 nodes, 4 tasks), so it would wait for as many nodes
    again; with --nodes=MIN-MAX and MIN x tasks per node it starts on what is free."""
    low = int(nodes.split("-")[0])
    subprocess.run(
        [
            "scontrol",
            "update",
            f"JobId={job_id}",
            f"NumNodes={nodes}",
            f"NumTasks={low * per_node}",
        ],
        capture_output=True,
        timeout=60,
    )


def _result(job, status: dict) -> tuple[dict, JobReturn | None]:
    try:
        ret = job.task(0).result()  # task 0 only: a job of a node range may run fewer tasks
    except Exception as e:  # the task raised, or was stopped without a requeue
        return {**status, "status": "failed", "reason": _first_line(e)}, None
    if ret.status == JobStatus.COMPLETED:
        return {**status, "status": "completed"}, ret
    return {**status, "status": "failed", "reason": _first_line(ret._return_value)}, None


def _requeue_after_stop(run_dir: Path, limit: int) -> None:
    """After a stop checkpoint: rank 0 requeues the job if SLURM's warning signal stopped it
    and it has been requeued fewer than `limit` times; every rank then waits for SLURM to end
    it (returning would let the job complete). Otherwise this returns and the job fails
    with the stop's exit status."""
    import submitit

    from launcher.runtime.failures import STOPPED_FILE

    env = submitit.JobEnvironment()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if env.global_rank == 0:
        stopped = json.loads((run_dir / STOPPED_FILE).read_text())
        warned = stopped["signal"] in (signal.SIGUSR1, signal.SIGUSR2)
        if not warned or restarts >= limit:
            return  # cancelled (SIGTERM), or requeued often enough: the job ends here
        subprocess.check_call(["scontrol", "requeue", env.job_id], timeout=60)
        print(f"requeued {env.job_id} after the stop checkpoint", file=sys.stderr, flush=True)
    deadline = time.monotonic() + REQUEUE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(1)


def _first_line(e: Any) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
