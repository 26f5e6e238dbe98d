"""A real Slurm for tests (tests/test_slurm.py, test_verl_slurm.py, nemo/test_nemo_slurm.py,
nemorl/test_nemo_rl_slurm.py): start or reuse one (scripts/slurm_up.sh: two nodes on this host),
submit, preempt and wait for jobs, and tell a failed job's story.

    slurm = slurm_cluster.slurm           # in a test module: the module-scoped fixture
    job = submit(slurm, BATCH, RECIPE, *overrides, cwd=tmp_path, env=env)
    preempt(slurm, job); wait_requeued(slurm, job)
    info = wait_until_ended(slurm, job)   # scontrol's fields of the ended job
    assert info["JobState"] == "COMPLETED", why(slurm, submit_dir, info)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import cluster_lock
import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def cluster():
    """SLURM_CONF of a running cluster: the caller's (CI exports it), or one
    scripts/slurm_up.sh starts and this stops again; this session's alone while the block runs
    (tests/cluster_lock.py: the test command's other suites wait for it)."""
    with cluster_lock.held("Slurm jobs"):
        conf = os.environ.get("SLURM_CONF")
        if conf and shutil.which("sinfo"):
            if subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0:
                yield conf
                return
        if os.geteuid() != 0 and shutil.which("sbatch") is None:
            pytest.skip("Slurm is not installed and installing it needs root")
        up = subprocess.run(["bash", str(ROOT / "scripts/slurm_up.sh")], capture_output=True,
                            text=True, timeout=300)  # fmt: skip
        if up.returncode != 0:
            pytest.skip(f"could not start a Slurm here: {up.stderr.strip()[-500:]}")
        conf = up.stdout.strip().split("=", 1)[1]
        try:
            yield conf
        finally:
            if "already running" not in up.stderr:  # stop only what this started
                subprocess.run(["bash", str(ROOT / "scripts/slurm_down.sh")], capture_output=True)


@pytest.fixture(scope="module")
def slurm():
    """SLURM_CONF of a running cluster, for the tests of one module (`slurm =
    slurm_cluster.slurm` there makes it theirs)."""
    with cluster() as conf:
        yield conf


def submit(conf: str, *command, cwd: Path, env: dict | None = None, options: tuple = ()) -> int:
    """`sbatch --parsable OPTIONS COMMAND` (a batch script and its arguments) from `cwd` with the
    submitting shell's `env` (default: this process's; its SLURM_JOB* left out, so a test run
    inside a job submits one of its own): the job id."""
    env = {k: str(v) for k, v in (os.environ if env is None else env).items()
           if not k.startswith("SLURM_JOB")}  # fmt: skip
    env["SLURM_CONF"] = conf
    cmd = ["sbatch", "--parsable", *options, *map(str, command)]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(cmd)}: {p.stderr}"
    return int(p.stdout.strip().split(";")[0])


def preempt(conf: str, job) -> None:
    """Slurm's warning before the time limit, as slurm/grpo_balanced.sh asks for it
    (--signal=B:USR1): SIGUSR1 to the job's batch shell alone."""
    env = dict(os.environ, SLURM_CONF=conf)
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True, env=env)


def wait_requeued(conf: str, job, timeout: float = 900.0) -> dict:
    """scontrol's fields of `job` once it has been requeued (Restarts=1): the batch shell took
    the warning, stopped the run and asked Slurm to run the job again."""
    return wait(lambda: (j := job_info(conf, job)).get("Restarts") == "1" and j,
                f"job {job} to be requeued", timeout, every=0.5)  # fmt: skip


def job_info(conf: str, job: int) -> dict:
    """scontrol's fields of `job` (empty once Slurm has forgotten it)."""
    p = subprocess.run(["scontrol", "-o", "show", "job", str(job)], capture_output=True,
                       text=True, env=dict(os.environ, SLURM_CONF=conf))  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


def wait(cond, what: str, timeout: float = 900.0, every: float = 1.0):
    """cond()'s first true value, polled every `every` s; AssertionError after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


# A pending job with one of these reasons stays pending until someone acts (a launch that failed
# and was requeued held, an admin or user hold, a dependency that can no longer be met).
NEVER_STARTS = {
    "launch_failed_requeued_held",
    "JobHeldAdmin",
    "JobHeldUser",
    "DependencyNeverSatisfied",
}


def wait_until_ended(
    conf: str, job, timeout: float = 900.0, cwd: Path | None = None, more: tuple[Path, ...] = ()
) -> dict:
    """scontrol's fields of `job` once it has ended. On a timeout the AssertionError tells the
    job's story (why(); with `cwd`, the output of the jobs submitted from there; the tails of the
    `more` log files) and the queue: a pending job's Reason (a dependency, a hold, a begin time),
    a running one's node."""
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    def done():
        info = job_info(conf, job)
        if info.get("Reason") in NEVER_STARTS:  # waiting longer cannot help: say so now
            raise AssertionError(f"job {job} will not start again ({info['Reason']})")
        return info.get("JobState") in ended and info

    try:
        return wait(done, f"job {job} to end", timeout)
    except AssertionError as timed_out:
        info = job_info(conf, job)
        fields = {k: info.get(k) for k in ("NodeList", "BeginTime", "Dependency", "JobName")}
        queue = subprocess.run(["squeue", "-h", "-o", "%i %j %T %r %N"], capture_output=True,
                               text=True, env=dict(os.environ, SLURM_CONF=conf)).stdout  # fmt: skip
        story = why(conf, cwd or Path("/nonexistent"), dict(info, JobId=str(job)), *more)
        raise AssertionError(f"{timed_out}: {fields}\n-- squeue:\n{queue}\n{story}") from None


def daemon_log(conf: str, key: str) -> str:
    """The log(s) a slurm.conf names under KEY (SlurmctldLogFile, SlurmdLogFile; %n = any node)."""
    for line in Path(conf).read_text().splitlines():
        if line.startswith(key + "="):
            pattern = line.split("=", 1)[1].strip().replace("%n", "*")
            return "\n".join(p.read_text() for p in sorted(Path("/").glob(pattern.lstrip("/"))))
    return ""


def batch_output(cwd: Path) -> str:
    """What the jobs submitted from `cwd` printed (the batch scripts' slurm-*.out)."""
    return "\n".join(p.read_text() for p in sorted(cwd.glob("slurm-*.out")))


def why(conf: str, cwd: Path, info: dict, *more: Path) -> str:
    """A failed job's story: its state and reason, the jobs' output, the tails of `more` log
    files, and what slurmctld and slurmd logged about it (a job can fail before its script
    prints a line)."""
    job = info.get("JobId", "?")
    ours = re.compile(rf"JobId={job}\b|job {job}\b|\[{job}\.|StepId={job}\.")
    logs = daemon_log(conf, "SlurmctldLogFile") + "\n" + daemon_log(conf, "SlurmdLogFile")
    daemons = "\n".join(line for line in logs.splitlines() if ours.search(line))
    state = {k: info.get(k) for k in ("JobState", "Reason", "ExitCode", "Restarts")}
    tails = "\n".join(f"-- {p}:\n{p.read_text()[-4000:]}" for p in more if p.is_file())
    return f"{state}\n{batch_output(cwd)}\n{tails}\n-- slurmctld/slurmd on job {job}:\n{daemons}"
