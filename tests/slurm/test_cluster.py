"""The test cluster itself: jobs span both nodes, a SIGKILLed job is seen to end (by the
stand-in sacct and by submitit), and stopping the cluster leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from .cluster import Cluster, slurm_available, start_cluster, stray_pids

pytestmark = pytest.mark.e2e

RUNNING = {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "UNKNOWN"}


def wait_until(done, timeout: float, what: str):
    """Poll done() until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while not (value := done()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return value


def sacct_state(cluster: Cluster, job_id: str) -> str:
    """The State column the stand-in sacct gives for job_id, as submitit asks for it."""
    run = cluster.run("sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job_id)
    header, *rows = run.stdout.splitlines()
    assert header == "JobID|State|NodeList"
    states = {row.split("|")[0]: row.split("|")[1] for row in rows}
    return states.get(job_id, "UNKNOWN")


def test_job_spans_both_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = slurm_cluster.sbatch(
        "-N", "2", "-n", "2", f"--output={out}",
        "--wrap", "srun bash -c 'echo $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME'",
    )  # fmt: skip
    info = wait_until(
        lambda: (i := slurm_cluster.job(job))["JobState"] not in RUNNING and i, 30, "job end"
    )
    assert info["JobState"] == "COMPLETED", slurm_cluster.logs()
    assert sorted(out.read_text().splitlines()) == ["0 0 n1", "1 1 n2"]
    assert sacct_state(slurm_cluster, job) == "COMPLETED"
    assert slurm_cluster.node_addr("n1") == slurm_cluster.node_addr("n2") == "127.0.0.1"


@pytest.mark.parametrize("how", ["scancel", "kill"])
def test_sigkilled_job_ends_in_sacct(slurm_cluster, tmp_path, how):
    """Killed by `scancel --signal=KILL`, or its task by SIGKILL to its PID (the OOM killer)."""
    pid_file = tmp_path / "pid"
    job = slurm_cluster.sbatch(
        f"--output={tmp_path}/out.txt",
        "--wrap", f"srun bash -c 'echo $$ > {pid_file}; exec sleep 300'",
    )  # fmt: skip
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "task start")
    assert sacct_state(slurm_cluster, job) == "RUNNING"
    if how == "scancel":
        slurm_cluster.run("scancel", "--signal=KILL", job)
    else:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    state = wait_until(
        lambda: (s := sacct_state(slurm_cluster, job)) not in RUNNING and s, 30, "job end"
    )
    assert state == {"scancel": "CANCELLED", "kill": "FAILED"}[how]


def test_submitit_result(slurm_env, tmp_path):
    import submitit

    def forty_two():  # local, so cloudpickle ships it by value: the job cannot import tests
        return 42

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5)
    job = executor.submit(forty_two)
    assert job.result() == 42  # seen through the result file, before the job has ended
    wait_until(lambda: job.get_info(mode="force").get("State") == "COMPLETED", 10, "COMPLETED")


def test_submitit_sees_sigkilled_job_end(slurm_env, tmp_path):
    import submitit

    def sleep_forever(pid_file):
        import os
        import time
        from pathlib import Path

        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(300)

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5)
    pid_file = tmp_path / "pid"
    job = executor.submit(sleep_forever, str(pid_file))
    job._results_timeout_s = 1  # how long result() waits for a result file once the job ended
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "task start")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    start = time.monotonic()
    wait_until(job.done, 30, "submitit seeing the job end")  # job.wait(), bounded
    assert job.state == "FAILED"
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()
    assert time.monotonic() - start < 30


@pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available()))
def test_stop_leaves_no_process(tmp_path):
    """Even when the body raises with a job running: its own cluster, stopped on the way out."""
    own = start_cluster(tmp_path / "own", nodes=("n1",), cpus_per_node=1)
    with pytest.raises(RuntimeError, match="test body"), own as cluster:
        job = cluster.sbatch(f"--output={tmp_path}/out.txt", "--wrap", "srun sleep 300")
        wait_until(lambda: cluster.job(job)["JobState"] == "RUNNING", 30, "job start")
        procs = dict(cluster.procs)
        assert {"slurmctld", "slurmd_n1"} <= set(procs)
        assert stray_pids(cluster.dir)  # the daemons, slurmstepd, srun, sleep
        raise RuntimeError("test body")
    assert all(p.poll() is not None for p in procs.values())
    assert not stray_pids(cluster.dir)
    conf = str(cluster.conf).encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert conf not in cmdline.read_bytes(), cmdline
        except OSError:
            continue
