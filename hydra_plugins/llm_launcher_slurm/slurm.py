"""hydra-submitit-launcher's SLURM launcher with the planner in front of the queue.

`python -m launcher.train -m parallel.tp=1,2,3 hydra/launcher=slurm`:
- every point is planned before anything is submitted; a point that breaks a rule or does not
  fit is printed with its reasons, gets SWEEP_DIR/<n>/rejected.json and never reaches the queue;
  if every point is rejected nothing is submitted (exit 2);
- each job's resources come from its plan: nodes = hardware.nodes, tasks per node =
  hardware.devices_per_node (each task is one rank: launcher/launch.py maps the SLURM task
  onto torch.distributed), GPUs per node on CUDA. Points with the same resources go as one job
  array; partition, account, qos, constraint, timeout_min, additional_parameters, ... pass
  through as hydra-submitit-launcher names them (`hydra.launcher.partition=...`);
- a job that fails (a crash, or killed) is recorded in SWEEP_DIR/<n>/status.json and the
  sweep goes on; the summary (launcher/sweep.py) then shows every point.

Hydra plugins live in the `hydra_plugins` namespace package, which is why this file is here.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

# Set from each point's plan; a value in hydra.launcher for these is overruled.
RESOURCES = ("nodes", "tasks_per_node", "gpus_per_node")


class PlannedSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from launcher import sweep

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
            sweep.write_json(job_dir / sweep.OVERRIDES, list(overrides))
            problems, resources = self._plan(list(overrides))
            if problems:
                print(f"rejected: {' '.join(overrides)}\n{problems}", file=sys.stderr, flush=True)
                sweep.write_json(job_dir / sweep.REJECTED, {"problems": problems})
                continue
            groups[resources].append((idx, list(overrides)))
        if not groups:
            from launcher.cli import fail

            fail(f"every point of the sweep was rejected; nothing was submitted ({sweep_dir})")
        returns: list[JobReturn] = []
        for resources, points in groups.items():
            returns += self._submit(dict(resources), points, sweep_dir)
        return returns

    def _plan(self, overrides: list[str]) -> tuple[str, tuple]:
        """(the problems of this point, or ""; its SLURM resources)."""
        from launcher.cli import to_config
        from launcher.plan import make_plan
        from launcher.plan.report import problems_message
        from launcher.plan.rules import engine_problems

        dcfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(dcfg):
            del dcfg["hydra"]
        cfg = to_config(dcfg)
        plan = make_plan(cfg)
        if plan.layout is not None:
            plan.errors.extend(engine_problems(cfg, plan.layout))
        hw = cfg.hardware
        cuda = hw.device_type.value == "cuda"
        resources = (
            ("nodes", hw.nodes),
            ("tasks_per_node", hw.devices_per_node),
            ("gpus_per_node", hw.devices_per_node if cuda else None),
        )
        return ("" if plan.ok else problems_message(plan)), resources

    def _executor(self, resources: dict):
        """submitit's executor with hydra.launcher's parameters and this group's resources
        (as BaseSubmititLauncher.launch builds it)."""
        import submitit

        params = {**self.params, **resources}
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
        from launcher import sweep

        executor = self._executor(resources)
        args = [
            (o, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            for idx, o in points
        ]
        for idx, overrides in points:
            print(f"\t#{idx} : {' '.join(filter_overrides(overrides))}", flush=True)
        jobs = executor.map_array(self, *zip(*args, strict=True))
        out = []
        for (idx, _), job in zip(points, jobs, strict=True):
            status = {"job_id": job.job_id}
            try:
                ret = job.results()[0]
            except Exception as e:  # the queue's verdict: killed, timed out, crashed
                status.update(status="failed", reason=_first_line(e))
            else:
                if ret.status == JobStatus.COMPLETED:
                    status["status"] = "completed"
                    out.append(ret)
                else:
                    status.update(status="failed", reason=_first_line(ret._return_value))
            sweep.write_json(sweep_dir / str(idx) / sweep.STATUS, status)
        return out


def _first_line(e: Any) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
