"""The Slurm launchers: the fit helper, DRY_RUN commands for 1, 4 and 16 nodes and every backend
(verl and nemo_rl: the Ray cluster's commands; their launch path with shims for srun, scontrol and
ray; the wait helper against a local Ray head), shellcheck, and (slow) real jobs on the Slurm that
scripts/slurm_up.sh starts (two nodes on this host): a run that completes beside one that is
preempted, requeued and resumed with no step lost or repeated, and with the verl and NeMo-RL
backends a Ray cluster over the job's nodes (formed, an entry on its head, preempted, requeued
and formed again; and a worker that does not start, failing the job)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cluster_lock
import pytest
import slurm_cluster

from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.planning.launch import FitError, check_fit, expand_hostlist

slurm = slurm_cluster.slurm  # the fixture: a running Slurm for this module's tests

ROOT = Path(__file__).resolve().parents[1]
BATCH = ROOT / "slurm/grpo_balanced.sh"
INTERACTIVE = ROOT / "slurm/interactive.sh"
TINY = ROOT / "recipes/tiny-cpu.yaml"
TP2 = ROOT / "recipes/tiny-cpu-tp2.yaml"
# recipes/tiny-cpu.yaml cut to seconds per step (the launcher, not the learning, is under test)
SMALL = [
    "warmstart.steps=20",
    "warmstart.batch_size=32",
    "data.eval_prompts=8",
    "eval.samples=2",
    "grpo.prompts_per_step=4",
    "grpo.group_size=4",
    "grpo.max_new_tokens=24",
    "parallel.micro_batch_size=8",
    "logging.progress=false",
]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # The launcher runs this interpreter (and the torchrun beside it), activated or not; the
    # tests of how it finds one without PYTHON are below (_no_env).
    env.setdefault("PYTHON", sys.executable)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _dry(script: Path, *args: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=cwd,
        env=_env(DRY_RUN=1, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- the fit helper ---------------------------------------------------------------------------
def test_check_fit():
    assert check_fit(ParallelLayout(tp=2, pp=2, dp=None), nodes=4, gpus_per_node=8) == (
        ParallelLayout(tp=2, pp=2, dp=8)
    )
    with pytest.raises(FitError, match="--nodes a multiple of 3"):
        check_fit(ParallelLayout(tp=2, pp=3, dp=None), nodes=2, gpus_per_node=4)  # 8 ranks, mp 6
    with pytest.raises(FitError, match=r"parallel\.tp<=4"):
        check_fit(ParallelLayout(tp=8, dp=None), nodes=4, gpus_per_node=4)
    with pytest.raises(FitError, match="straddle"):
        check_fit(ParallelLayout(tp=4, dp=None), nodes=2, gpus_per_node=6)


def test_expand_hostlist_matches_slurm_grammar():
    assert expand_hostlist("gpu[01-03,10],cpu7") == ["gpu01", "gpu02", "gpu03", "gpu10", "cpu7"]
    assert expand_hostlist("a[1-2]b[8-9]") == ["a1b8", "a1b9", "a2b8", "a2b9"]
    assert expand_hostlist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    with pytest.raises(ValueError, match="bad range"):
        expand_hostlist("gpu[a-b]")


# -- DRY_RUN ----------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [1, 4, 16])
@pytest.mark.parametrize("backend", ["local", "nemo_aligner"])
def test_dry_run_prints_the_commands(tmp_path, nodes, backend):
    nodelist = "gpu01" if nodes == 1 else f"gpu[01-{nodes:02d}]"
    mbs = "parallel.micro_batch_size=2"  # 256 sequences split over up to 32 DP ranks
    p = _dry(BATCH, str(TP2), f"backend={backend}", "parallel.pp=2", mbs, cwd=tmp_path,
             SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID=77, GPUS_PER_NODE=8,
             CONTAINER="nvcr.io/nvidia/nemo:24.07", MOUNTS="/data:/data", NCCL_IB_HCA="mlx5_0",
             NCCL_DEBUG="INFO")  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = p.stdout
    world = nodes * 8
    assert f"tp=2 pp=2 cp=1 dp={world // 4} (world {world})" in out
    assert "# nodes: " + " ".join(f"gpu{i:02d}" for i in range(1, nodes + 1)) in out
    assert "rendezvous: gpu01:20077" in out
    assert "export NCCL_DEBUG=INFO" in out  # the user's value wins over the default (WARN)
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith(f"srun --nodes={nodes} ")
    assert "--container-image=nvcr.io/nvidia/nemo:24.07 " in cmd
    assert "--container-mounts=/data:/data " in cmd
    if backend == "local":
        assert "--ntasks-per-node=1 " in cmd
        # in the container: the image's torchrun, not the one beside the launcher's interpreter
        assert f" torchrun --nnodes={nodes} --nproc-per-node=8 --rdzv-backend=c10d" in cmd
        assert (
            f"-m megatron_ba.cli train {TP2} backend=local parallel.pp=2 "
            "parallel.micro_batch_size=2 --run-dir"
        ) in cmd
        assert "logs/job-77-restart-0/node-%n.log" in cmd
    else:
        assert "--ntasks-per-node=8 " in cmd
        # in the container: `megatron-ba train`, which writes the prompts and runs train_grpo
        assert cmd.endswith(
            f" python3 -m megatron_ba.cli train {TP2} backend=nemo_aligner parallel.pp=2 "
            f"parallel.micro_batch_size=2 --run-dir runs/tiny-cpu-tp2-balanced --nodes {nodes} "
            "--devices 8 --accelerator gpu"
        )
        assert "logs/job-77-restart-0/rank-%t.log" in cmd
        shown = [line[4:] for line in out.splitlines() if line.startswith("#   ++")]
        assert shown[:5] == [f"++trainer.num_nodes={nodes}", "++trainer.devices=8",
                             "++trainer.accelerator=gpu", "++model.tensor_model_parallel_size=2",
                             "++model.pipeline_model_parallel_size=2"]  # fmt: skip
        assert "++exp_manager.explicit_log_dir=runs/tiny-cpu-tp2-balanced" in shown
        assert "++model.data.data_prefix.train=runs/tiny-cpu-tp2-balanced/data/train.jsonl" in shown
    assert not (tmp_path / "runs").exists()  # nothing written, nothing launched


def test_dry_run_on_cpu_uses_the_recipes_processes(tmp_path):
    p = _dry(BATCH, str(TP2), cwd=tmp_path, SLURM_JOB_NODELIST="vm", GPUS_PER_NODE="")
    assert p.returncode == 0, p.stderr
    assert "--nproc-per-node=2 " in p.stdout  # tp 2: two gloo processes
    p = _dry(INTERACTIVE, str(TINY), "grpo.steps=2", cwd=tmp_path, GPUS_PER_NODE="")
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.strip().splitlines()[-1]
    assert cmd.startswith("bash -c") and "torchrun --nnodes=1 --nproc-per-node=1 " in cmd
    assert "srun" not in cmd
    # backend nemo_aligner on CPU: two gloo processes, fp32 with torch's AdamW
    p = _dry(BATCH, str(TP2), "backend=nemo_aligner", cwd=tmp_path, SLURM_JOB_NODELIST="vm",
             GPUS_PER_NODE="")  # fmt: skip
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.strip().splitlines()[-1]
    assert "--ntasks-per-node=2 " in cmd and cmd.endswith("--devices 2 --accelerator cpu")
    shown = [line[4:] for line in p.stdout.splitlines() if line.startswith("#   ")]
    assert {"++trainer.accelerator=cpu", "++trainer.precision=32", "++model.optim.name=adamw",
            "~model.optim.bucket_cap_mb"} <= set(shown)  # fmt: skip


def test_nemo_aligner_needs_an_allocation_with_a_task_per_process(tmp_path):
    """srun starts no more tasks per node than the job holds: one task per process
    (backend nemo_aligner) needs sbatch --ntasks-per-node=G, said before anything starts."""
    args = (str(TP2), "backend=nemo_aligner")
    env = dict(SLURM_JOB_NODELIST="gpu01", GPUS_PER_NODE=8)
    p = _dry(BATCH, *args, cwd=tmp_path, SLURM_NTASKS_PER_NODE=1, **env)
    assert p.returncode == 2
    assert "this job has 1: submit with sbatch --ntasks-per-node=8" in p.stderr
    assert _dry(BATCH, *args, cwd=tmp_path, SLURM_NTASKS_PER_NODE=8, **env).returncode == 0
    # the local backend: one torchrun agent per node, whatever the job holds
    assert _dry(BATCH, str(TP2), cwd=tmp_path, SLURM_NTASKS_PER_NODE=1, **env).returncode == 0


# backends verl and nemo_rl: a Ray cluster over the allocation, the entry on its head
QWEN = ROOT / "recipes/qwen3-1.7b-dapo17k.yaml"
RAY_ARGS = {  # what each translation needs besides the recipe (the benchmark files' folder...)
    "verl": ["backend=verl", "data.path=F.parquet", "eval.data_dir=DIR"],
    "nemo_rl": ["backend=nemo_rl", "eval.samples=1", "eval.benchmarks=aime24,aime25",
                "eval.data_dir=DIR"],
}  # fmt: skip
RAY_RESUME = {"verl": "trainer.resume_mode=auto", "nemo_rl": "checkpointing.checkpoint_dir="}


def _ray_steps(out: str) -> dict[str, list[str]]:
    """DRY_RUN's srun lines by kind, in the order printed (the order they run)."""
    kinds = {"head": " start --head ", "worker": " start --address=",
             "wait": "megatron_ba.integrations.ray_cluster wait",
             "entry": " -m megatron_ba.cli train "}  # fmt: skip
    steps = {k: [] for k in [*kinds, "order"]}
    for line in map(str.rstrip, out.splitlines()):
        if line.startswith("srun "):
            kind = next(k for k, mark in kinds.items() if mark in line)
            steps[kind].append(line)
            steps["order"].append(kind)
    return steps


def test_ray_dashboard_only_when_asked(tmp_path):
    """The head starts without Ray's dashboard (above); MBA_RAY_DASHBOARD=1 turns it on, and
    only on the head."""
    env = dict(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_JOB_ID=77, GPUS_PER_NODE=8,
               CONTAINER="nvcr.io/nvidia/nemo-rl:v0.7.0", MBA_RAY_DASHBOARD="1")  # fmt: skip
    p = _dry(BATCH, str(QWEN), *RAY_ARGS["verl"], cwd=tmp_path, **env)
    assert p.returncode == 0, p.stderr
    steps = _ray_steps(p.stdout)
    (head,) = steps["head"]
    assert "--include-dashboard=true" in head and "--include-dashboard=false" not in head
    assert all("--include-dashboard" not in w for w in steps["worker"])


@pytest.mark.parametrize("nodes", [1, 4, 16])
@pytest.mark.parametrize("backend", ["verl", "nemo_rl"])
def test_dry_run_forms_a_ray_cluster(tmp_path, nodes, backend):
    nodelist = "gpu01" if nodes == 1 else f"gpu[01-{nodes:02d}]"
    p = _dry(BATCH, str(QWEN), *RAY_ARGS[backend], cwd=tmp_path, SLURM_JOB_NODELIST=nodelist,
             SLURM_JOB_ID=77, GPUS_PER_NODE=8,
             CONTAINER="nvcr.io/nvidia/nemo-rl:v0.7.0")  # fmt: skip
    assert p.returncode == 0, p.stderr
    out, steps = p.stdout, _ray_steps(p.stdout)
    hosts = [f"gpu{i:02d}" for i in range(1, nodes + 1)]
    assert f"# backend {backend}, {nodes} node(s) x 8 process(es)" in out
    assert "export RAY_ADDRESS=gpu01:20077" in out  # how the engine's ray.init finds the cluster
    waits = ["wait"] if nodes == 1 else ["wait", *["worker"] * (nodes - 1), "wait"]
    assert steps["order"] == ["head", *waits, "entry"]
    (head,) = steps["head"]
    # each Ray node carries its Slurm node name (the wait names a missing node by it)
    assert " -w gpu01 " in head and head.endswith(" &")
    assert shlex.split(head[:-2])[-9:] == [
        "ray", "start", "--head", "--port=20077", "--num-gpus=8",
        '--resources={"slurm-node/gpu01": 1}', "--include-dashboard=false",
        "--disable-usage-stats", "--block"
    ]  # fmt: skip
    assert [w.split(" -w ")[1].split()[0] for w in steps["worker"]] == hosts[1:]
    logs = "runs/qwen3-1.7b-dapo17k-balanced/logs/job-77-restart-0"
    assert f"--output={logs}/ray-head.log " in head
    for worker, host in zip(steps["worker"], hosts[1:], strict=True):
        assert f"--output={logs}/ray-worker-{host}.log " in worker
        assert shlex.split(worker[:-2])[-7:] == [
            "ray", "start", "--address=gpu01:20077", "--num-gpus=8",
            f'--resources={{"slurm-node/{host}": 1}}', "--disable-usage-stats", "--block"
        ] and worker.endswith(" &")  # fmt: skip
    assert [w.split("--nodes=")[-1].split()[0] for w in steps["wait"]] == (
        ["1"] if nodes == 1 else ["1", str(nodes)]
    )
    assert all(" -w gpu01 " in w and "--address=gpu01:20077" in w for w in steps["wait"])
    (entry,) = steps["entry"]
    assert entry.startswith("srun --overlap --nodes=1 --ntasks=1 -w gpu01 ")
    assert "--container-image=nvcr.io/nvidia/nemo-rl:v0.7.0 " in entry
    train = ["python3", "-m", "megatron_ba.cli", "train", str(QWEN), *RAY_ARGS[backend],
             "--run-dir", "runs/qwen3-1.7b-dapo17k-balanced", "--nodes", str(nodes),
             "--devices", "8"]  # fmt: skip
    assert f"--output={logs}/entry.log " in entry
    assert shlex.split(entry)[-len(train) :] == train
    # at the end, the Ray steps are ended (this job's Ray only: no `ray stop`, which ends every
    # Ray process of the node's user)
    assert "# at exit (trap): the head's and workers' steps above are ended" in out
    assert " stop" not in out
    # the entry's translation, and the resume setting a requeued job relies on
    shown = next(line for line in out.splitlines() if line.startswith("#   python "))
    assert f" {RAY_RESUME[backend]}" in shown
    assert f"a requeued job resumes: {RAY_RESUME[backend]}" in out
    if backend == "verl":
        assert " -m megatron_ba.integrations.verl.main_ppo " in shown
        assert f" trainer.nnodes={nodes} trainer.n_gpus_per_node=8 " in shown
    else:
        assert " -m megatron_ba.integrations.nemo_rl.run_grpo_balanced " in shown
        assert f" cluster.num_nodes={nodes} cluster.gpus_per_node=8 " in shown
        run = tmp_path.resolve() / "runs/qwen3-1.7b-dapo17k-balanced"
        assert f" checkpointing.checkpoint_dir={run}/checkpoints " in shown
    assert not (tmp_path / "runs").exists()  # nothing written, nothing launched


@pytest.mark.parametrize(
    ("backend", "args", "key"),
    [
        ("verl", ["backend=verl", "eval.data_dir=DIR"], "data.path"),
        ("nemo_rl", RAY_ARGS["nemo_rl"][:1] + RAY_ARGS["nemo_rl"][2:], "eval.samples"),
    ],
)
def test_a_recipe_the_ray_backend_refuses_launches_nothing(tmp_path, backend, args, key):
    """The translation's refusal, naming the key, before any Ray step (the control: the same
    recipe with the key set is test_dry_run_forms_a_ray_cluster)."""
    p = _dry(BATCH, str(QWEN), *args, cwd=tmp_path, SLURM_JOB_NODELIST="gpu[01-04]",
             GPUS_PER_NODE=8)  # fmt: skip
    assert p.returncode == 2
    assert f"train: {key}: " in p.stderr
    assert f"backend {backend}: the recipe does not translate (above); nothing launched" in p.stderr
    assert "srun" not in p.stdout and "ray" not in p.stdout


def test_a_translation_without_the_resume_setting_is_refused(tmp_path):
    """A translated command that would not resume after a requeue is not launched (a PYTHON
    wrapper whose --print-command leaves the setting out); the control is the real command."""
    fake = tmp_path / "python-no-resume"
    fake.write_text(f"""#!/bin/bash
for a in "$@"; do
    if [[ $a == --print-command ]]; then
        echo "python -m megatron_ba.integrations.verl.main_ppo x=1"
        exit 0
    fi
done
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = dict(SLURM_JOB_NODELIST="gpu[01-02]", GPUS_PER_NODE=8)
    p = _dry(BATCH, str(QWEN), *RAY_ARGS["verl"], cwd=tmp_path, PYTHON=fake, **env)
    assert p.returncode == 2
    assert "backend verl: the translated command lacks trainer.resume_mode=auto" in p.stderr
    assert _dry(BATCH, str(QWEN), *RAY_ARGS["verl"], cwd=tmp_path, **env).returncode == 0


def test_print_command_is_for_the_ray_backends(tmp_path):
    p = subprocess.run([sys.executable, "-m", "megatron_ba.cli", "train", str(TINY),
                        "--print-command"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True)  # fmt: skip
    assert p.returncode == 2 and not p.stdout
    assert "--print-command is for backend=verl or nemo_rl, not local" in p.stderr


def test_interactive_refuses_a_ray_backend(tmp_path):
    p = _dry(INTERACTIVE, str(QWEN), *RAY_ARGS["verl"], cwd=tmp_path, GPUS_PER_NODE=8)
    assert p.returncode == 2
    assert "backend verl runs on a Ray cluster that slurm/grpo_balanced.sh forms" in p.stderr


def test_ray_wait_messages_and_arguments():
    from megatron_ba.integrations import ray_cluster

    nodes = [{"NodeManagerHostname": "gpu02.cluster", "Alive": True},
             {"NodeManagerHostname": "gpu01", "Alive": True},
             {"NodeManagerHostname": "gpu03", "Alive": False}]  # fmt: skip
    assert ray_cluster.live_hosts(nodes) == ["gpu01", "gpu02"]
    hosts = ["gpu01", "gpu02", "gpu03"]
    text = ray_cluster.missing_message("gpu01:1", 3, hosts, ["gpu01", "gpu02"], 9)
    assert text == (
        "Ray cluster at gpu01:1: 2 of 3 node(s) joined after 9 s (gpu01, gpu02); missing: gpu03"
    )
    for bad, named in (["--nodes=0"], "--nodes"), (["--timeout=-1"], "--timeout"):
        p = subprocess.run([sys.executable, "-m", "megatron_ba.integrations.ray_cluster", "wait",
                            "--address=gpu01:1", "--nodes=2", *bad], capture_output=True,
                           text=True, env=_env())  # fmt: skip
        assert p.returncode == 2 and named in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "megatron_ba.integrations.ray_cluster", "wait",
                        "--address=gpu01", "--nodes=2"], capture_output=True, text=True,
                       env=_env())  # fmt: skip
    assert p.returncode == 2 and "--address gpu01: expected HOST:PORT" in p.stderr
    # the watchdog ends a wait that a call into Ray holds past its deadline
    code = ("import time; from megatron_ba.integrations import ray_cluster as r; "
            "r._watchdog(0.5, lambda: 'gpu02 missing'); time.sleep(30)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                       timeout=20)  # fmt: skip
    assert p.returncode == 1 and "gpu02 missing (Ray did not answer)" in p.stderr


@pytest.fixture
def machine_ray():
    """This machine's Ray to this test alone: another suite's `ray stop --force` would end its
    head (tests/cluster_lock.py)."""
    with cluster_lock.held("a local Ray head"):
        yield


def test_ray_wait_against_a_local_ray_head(machine_ray, tmp_path):
    """The wait helper against a real `ray start --head` (the verl environment's Ray): one node
    joins; waiting for two times out naming the host that is missing (the negative control)."""
    bin_dir = ROOT / ".venv-verl/bin"
    if not (bin_dir / "ray").exists():
        pytest.skip("no .venv-verl with Ray (bash scripts/setup_verl_env.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = Path(tempfile.mkdtemp(prefix="mba-ray-", dir="/tmp"))  # Ray's socket paths: short
    env = {k: v for k, v in _env().items() if not k.startswith("RAY_")}
    head = subprocess.Popen(
        [bin_dir / "ray", "start", "--head", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", "--block"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait = [bin_dir / "python", "-m", "megatron_ba.integrations.ray_cluster", "wait",
            f"--address=127.0.0.1:{port}", "--every=0.5"]  # fmt: skip
    try:
        # Ray's head took over 195 s to answer at a load average of ~19 (a whole test run, a
        # load test and two busy processes on 2 cores): the wait allows 600 s
        p = subprocess.run([*wait, "--nodes=1", "--timeout=600"], env=env, capture_output=True,
                           text=True, timeout=700)  # fmt: skip
        assert p.returncode == 0, p.stderr
        host = socket.gethostname().split(".")[0]
        assert f"1 node(s) joined at 127.0.0.1:{port}: {host}" in p.stdout
        p = subprocess.run([*wait, "--nodes=2", f"--hosts={host} ghost02", "--timeout=3"],
                           env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert p.returncode == 1
        # after the 3 s asked for, or more where Ray's connection itself took longer (load)
        said = rf"1 of 2 node\(s\) joined after (\d+) s \({host}\); missing: ghost02"
        gave_up = re.search(said, p.stderr)
        assert gave_up and int(gave_up.group(1)) >= 3, p.stderr
        # SIGUSR2 (the launcher's "a node's Ray step ended") ends a long wait at its next poll
        give_up = subprocess.Popen([*wait, "--nodes=2", f"--hosts={host} ghost02", "--timeout=300"],
                                   env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
        armed = give_up.stderr.readline()  # printed once its handler is set (not a fixed sleep)
        assert armed.startswith("ray_cluster: waiting for 2 node(s)"), armed
        start = time.monotonic()
        give_up.send_signal(signal.SIGUSR2)
        _out, err = give_up.communicate(timeout=60)
        assert give_up.returncode == 1 and time.monotonic() - start < 120, err  # not its 300 s
        assert "missing: ghost02 (a node's Ray step ended: not waiting any longer)" in err
    finally:
        _end_group(head)
        shutil.rmtree(temp, ignore_errors=True)


def _end_group(proc: subprocess.Popen) -> None:
    """TERM the process group this test started (ray start --block and what it started), KILL
    what is left after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)  # its daemons (gcs_server, raylet), if any remain
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


_SHIMS = {  # a Slurm job without Slurm: each command logs itself to $SHIM_LOG
    "srun": """#!/bin/bash
echo "srun $*" >>"$SHIM_LOG"
while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done   # options; -w takes a value
exec "$@"
""",
    "scontrol": """#!/bin/bash
echo "scontrol $*" >>"$SHIM_LOG"
[[ $1 == show && $2 == hostnames ]] && exit 1   # the project's expander then
exit 0
""",
    "ray": """#!/bin/bash
echo "ray $*" >>"$SHIM_LOG"
[[ $1 == start ]] || exit 0
trap 'echo "ray ended: $*" >>"$SHIM_LOG"; kill $s; exit 0' TERM
sleep 1000 & s=$!
wait $s
""",
    "python": """#!/bin/bash
case "$*" in
*--print-command* | *planning.launch* | -c*) exec "$REAL_PYTHON" "$@" ;;
*ray_cluster*)
    echo "wait $*" >>"$SHIM_LOG"
    [[ $* == *"--nodes=$FAIL_WAIT_AT "* ]] && exit 1
    exit 0 ;;
*"megatron_ba.cli train"*)
    echo "entry RAY_ADDRESS=$RAY_ADDRESS $*" >>"$SHIM_LOG"
    [[ $ENTRY == sleep ]] || exit "$ENTRY"
    trap 'echo "entry ended" >>"$SHIM_LOG"; kill $s; exit 143' TERM
    sleep 1000 & s=$!
    wait $s ;;
esac
exec "$REAL_PYTHON" "$@"
""",
}


def _shim_job(tmp_path, entry: str, fail_wait_at: int = 0) -> tuple[subprocess.Popen, Path]:
    """grpo_balanced.sh backend=verl as a 3-node job whose srun, scontrol, ray and entry are the
    shims above (nothing of Slurm or Ray runs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in _SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "shim.log"
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SHIM_LOG=log, REAL_PYTHON=sys.executable,
               PYTHON=bin_dir / "python", RAY=bin_dir / "ray", ENTRY=entry, BACKEND_CHECK=0,
               FAIL_WAIT_AT=fail_wait_at, SLURM_JOB_ID=123, SLURM_JOB_NAME="x",
               SLURM_JOB_NODELIST="n[1-3]", GPUS_PER_NODE=8, MBA_HOME=ROOT)  # fmt: skip
    cmd = ["bash", str(BATCH), str(QWEN), *RAY_ARGS["verl"]]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    return job, log


def _shim_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_ray_launch_order_and_exit_status_with_shims(tmp_path):
    job, log = _shim_job(tmp_path, entry="3")
    _out, err = job.communicate(timeout=120)
    assert job.returncode == 3, err  # the entry's exit status
    lines = _shim_lines(log)
    # the steps in the foreground, in order (the background ones log when they get to it)
    ordered = [line for line in lines if line.startswith(("wait ", "entry "))]
    assert [line.split(" --")[0] for line in ordered] == [
        "wait -m megatron_ba.integrations.ray_cluster wait",
        "wait -m megatron_ba.integrations.ray_cluster wait",
        f"entry RAY_ADDRESS=n1:20123 -m megatron_ba.cli train {QWEN} {' '.join(RAY_ARGS['verl'])}",
    ]  # fmt: skip
    assert "--nodes=1 --hosts=n1 " in ordered[0] and "--nodes=3 --hosts=n1 n2 n3 " in ordered[1]
    assert ordered[2].endswith(" --run-dir runs/qwen3-1.7b-dapo17k-balanced --nodes 3 --devices 8")
    heads = [line for line in lines if line.startswith("srun ") and " start --head " in line]
    assert len(heads) == 1 and " -w n1 " in heads[0]
    workers = [line for line in lines if line.startswith("srun ") and " start --address" in line]
    assert sorted(w.split(" -w ")[1].split()[0] for w in workers) == ["n2", "n3"]
    assert sorted(line for line in lines if line.startswith("ray ended")) == [
        'ray ended: start --address=n1:20123 --num-gpus=8 --resources={"slurm-node/n2": 1} '
        "--disable-usage-stats --block",
        'ray ended: start --address=n1:20123 --num-gpus=8 --resources={"slurm-node/n3": 1} '
        "--disable-usage-stats --block",
        'ray ended: start --head --port=20123 --num-gpus=8 --resources={"slurm-node/n1": 1} '
        "--include-dashboard=false --disable-usage-stats --block",
    ]  # every Ray step ended at the stop, after the entry
    assert lines.index(ordered[-1]) < min(i for i, line in enumerate(lines)
                                          if line.startswith("ray ended"))  # fmt: skip
    assert not any("requeue" in line for line in lines)
    assert "finished with exit status 3" in err


def test_ray_launch_requeues_on_usr1_with_shims(tmp_path):
    job, log = _shim_job(tmp_path, entry="sleep")
    _wait(lambda: any(line.startswith("entry ") for line in _shim_lines(log)), "the entry",
          timeout=120, every=0.2)  # fmt: skip
    job.send_signal(signal.SIGUSR1)
    _out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    lines = _shim_lines(log)
    ends = ("entry ended", "ray ended", "scontrol requeue")
    tail = [line for line in lines if line.startswith(ends)]
    assert [line.split(":")[0] for line in tail] == ["entry ended", *["ray ended"] * 3,
                                                     "scontrol requeue 123"], lines  # fmt: skip
    assert "resumes from its latest checkpoint (trainer.resume_mode=auto)" in err


def test_ray_cluster_that_does_not_form_stops_the_job_with_shims(tmp_path):
    job, log = _shim_job(tmp_path, entry="0", fail_wait_at=3)
    _out, err = job.communicate(timeout=120)
    assert job.returncode == 2
    assert "the Ray cluster did not form (above)" in err and "verl not launched" in err
    lines = _shim_lines(log)
    assert not any(line.startswith("entry ") for line in lines)
    assert sum(line.startswith("ray ended") for line in lines) == 3  # the EXIT trap ended them
    # a wait that fails while every Ray step runs gave no verdict (Ray can end its driver): it is
    # started again, 3 times at most
    assert sum(line.startswith("wait ") and "--nodes=3 " in line for line in lines) == 4
    assert (
        "the wait for 3 node(s) failed (above) while every Ray step runs: waiting again (3 of 3)"
        in err
    )


def test_a_layout_that_does_not_fit_says_what_to_change(tmp_path):
    p = _dry(BATCH, str(TP2), "parallel.pp=2", cwd=tmp_path, SLURM_JOB_NODELIST="gpu[1-3]",
             GPUS_PER_NODE=2)  # fmt: skip
    assert p.returncode == 2
    assert "is not a multiple of parallel.tp x pp x cp = 2 x 2 x 1 = 4" in p.stderr
    assert "--nodes a multiple of 2" in p.stderr and "nothing launched" in p.stderr
    assert "the allocation does not fit" in p.stderr  # the planner's verdict, and only it


def test_a_bad_override_is_not_blamed_on_the_allocation(tmp_path):
    p = _dry(BATCH, str(TP2), "parallel.nonsense=1", cwd=tmp_path, SLURM_JOB_NODELIST="gpu[1-2]",
             GPUS_PER_NODE=2)  # fmt: skip
    assert p.returncode == 2
    assert "parallel.nonsense" in p.stderr and "were refused (above); nothing launched" in p.stderr
    assert "allocation" not in p.stderr


# -- which interpreter ------------------------------------------------------------------------
def _bare_python(tmp_path, torch_error: str | None = None) -> Path:
    """A venv with no packages (no torch); torch_error: a `torch` that raises ImportError with
    that text on import (an install whose CUDA libraries are missing)."""
    venv = tmp_path / ("broken-torch" if torch_error else "bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    if torch_error:
        site = next(venv.glob("lib/python3.*/site-packages"))
        (site / "torch").mkdir()
        (site / "torch/__init__.py").write_text(f"raise ImportError({torch_error!r})\n")
    return venv / "bin/python"


def _checkout(tmp_path, **venvs: Path) -> Path:
    """A checkout (links to this one's code) whose .venv-gpu / .venv / .venv-current are links
    to the given environment folders, as setup scripts leave them."""
    home = tmp_path / "checkout"
    home.mkdir()
    for name in ("slurm", "megatron_ba", "recipes"):
        (home / name).symlink_to(ROOT / name)
    for name, target in venvs.items():
        (home / {"gpu": ".venv-gpu", "main": ".venv", "current": ".venv-current"}[name]).symlink_to(
            target
        )
    return home


def _no_env(python3: Path, **extra) -> dict:
    """The environment of a shell with no project environment: no PYTHON, no VIRTUAL_ENV, and
    python3 on PATH is `python3` (an interpreter without torch)."""
    env = _env(DRY_RUN=1, SLURM_JOB_NODELIST="gpu[01-02]", GPUS_PER_NODE=8)
    env.pop("PYTHON")
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{python3.parent}:/usr/bin:/bin"
    assert (python3.parent / "python3").exists()  # venv made it
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(home: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(home / "slurm/grpo_balanced.sh"), str(TP2)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_no_environment_says_which_interpreter_and_the_fix(tmp_path):
    home = _checkout(tmp_path)
    p = _launch(home, _no_env(_bare_python(tmp_path)), tmp_path)
    assert p.returncode == 2, p.stderr
    err = p.stderr
    assert (
        "the interpreter python3 (python3 on PATH: no PYTHON, no active virtual environment, "
        f"no .venv-gpu, .venv or .venv-current in {home})"
    ) in err
    assert "cannot import the project (import megatron_ba, torch): No module named 'torch'" in err
    assert "PYTHON=/path/to/env/bin/python" in err and "bash scripts/setup_gpu_env.sh" in err
    assert "bash scripts/setup_env.sh" in err
    assert "Traceback" not in err and "allocation" not in err
    assert not p.stdout  # no launch command printed


def test_python_is_honoured(tmp_path):
    home = _checkout(tmp_path)
    bare = _bare_python(tmp_path)
    p = _launch(home, _no_env(bare, PYTHON=sys.executable), tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"# recipe read with {sys.executable} (PYTHON)" in p.stdout
    beside = Path(sys.executable).parent / "torchrun"
    if beside.exists():  # the torchrun of that interpreter, not PATH's
        assert f" {beside} --nnodes=2 --nproc-per-node=8 " in p.stdout
    # control: the same launch with PYTHON naming the interpreter without torch
    p = _launch(home, _no_env(bare, PYTHON=bare), tmp_path)
    assert p.returncode == 2
    assert f"the interpreter {bare} (PYTHON) cannot import the project" in p.stderr
    assert "allocation" not in p.stderr


def test_the_checkouts_environments_in_order(tmp_path):
    bare, good = _bare_python(tmp_path), Path(sys.prefix)
    # .venv-gpu wins over .venv: a broken .venv-gpu is reported, never skipped for .venv
    home = _checkout(tmp_path, gpu=bare.parent.parent, main=good)
    p = _launch(home, _no_env(bare), tmp_path)
    assert p.returncode == 2
    assert f"the interpreter {home}/.venv-gpu/bin/python (the checkout's .venv-gpu)" in p.stderr
    # control: the same checkout with a working .venv-gpu launches with it
    (home / ".venv-gpu").unlink()
    (home / ".venv-gpu").symlink_to(good)
    p = _launch(home, _no_env(bare), tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"# recipe read with {home}/.venv-gpu/bin/python (the checkout's .venv-gpu)" in p.stdout
    # an active virtual environment comes before the checkout's
    p = _launch(home, _no_env(bare, VIRTUAL_ENV=bare.parent.parent), tmp_path)
    assert p.returncode == 2
    assert f"{bare.parent.parent}/bin/python (the active virtual environment" in p.stderr


def test_an_interpreter_whose_torch_fails_to_import(tmp_path):
    # torch is there (the cheap look passes) but its import fails: the planner crashes, and the
    # launcher says the interpreter cannot import the project, with torch's own error
    home = _checkout(tmp_path)
    broken = _bare_python(tmp_path, torch_error="libcudart.so.13: cannot open shared object file")
    p = _launch(home, _no_env(_bare_python(tmp_path), PYTHON=broken), tmp_path)
    assert p.returncode == 2
    assert f"the interpreter {broken} (PYTHON) cannot import the project" in p.stderr
    assert "ImportError: libcudart.so.13: cannot open shared object file" in p.stderr
    assert "allocation" not in p.stderr


def test_nemo_aligner_launch_says_it_is_not_installed(tmp_path):
    p = subprocess.run(
        ["bash", str(BATCH), str(TINY), "backend=nemo_aligner"],
        cwd=tmp_path,
        env=_env(SLURM_JOB_ID="999999", SLURM_JOB_NODELIST="vm", GPUS_PER_NODE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "backend nemo_aligner: NeMo-Aligner 0.7.0 (nemo_aligner) is not installed" in p.stderr


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = [*sorted((ROOT / "slurm").glob("*.sh")), ROOT / "scripts/slurm_up.sh",
               ROOT / "scripts/slurm_down.sh"]  # fmt: skip
    p = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True,
                       text=True)  # fmt: skip
    assert p.returncode == 0, p.stdout


# -- a real Slurm -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart-cache")  # shared: one warm start for the module


def _sbatch(conf, cwd, run_dir, cache, *overrides) -> int:
    env = _env(RUN_DIR=run_dir, CACHE_DIR=cache)
    return slurm_cluster.submit(conf, BATCH, TINY, *SMALL, *overrides, cwd=cwd, env=env)


_job, _wait, _why = slurm_cluster.job_info, slurm_cluster.wait, slurm_cluster.why


# Steps of the preempted runs: the test sends Slurm's warning once it sees the first step, and the
# run stops after the step in progress. With 5 steps (~0.4 s each here), on a machine with two busy
# processes the warning landed during the study's preempted element's last step: it finished
# (exit 0) and was never requeued.
STEPS = 12


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["step"] > 0]


def _comparable(run_dir: Path) -> list[dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.slow
def test_preempted_job_requeues_and_resumes_without_losing_a_step(slurm, cache_dir, tmp_path):
    """Two jobs of the tiny recipe side by side: one preempted after its first step, requeued
    and resumed; its uninterrupted twin, which completes as any job does (named after its run
    folder, a checkpoint, its logs), gives the metrics the resumed run must repeat."""
    # a checkpoint only at the end; STEPS after the first leave Slurm's warning time to land on a
    # busy machine before the run's last step (a tiny step takes ~0.4 s)
    steps = [f"grpo.steps={STEPS}", "checkpoint.every=0", "eval.every=0"]
    pre, ref = tmp_path / "pre", tmp_path / "ref"
    job = _sbatch(slurm, tmp_path, pre, cache_dir, *steps)
    ref_job = _sbatch(slurm, tmp_path, ref, cache_dir, *steps)  # the uninterrupted twin
    _wait(lambda: len(_train_steps(pre)) >= 1, "the first step", every=0.2)
    slurm_cluster.preempt(slurm, job)
    slurm_cluster.wait_requeued(slurm, job)
    stopped = json.loads((pre / "preempted.json").read_text())["step"]
    assert 1 <= stopped < STEPS
    assert (pre / "checkpoints" / f"step-{stopped:06d}" / "meta.json").is_file()
    assert _train_steps(pre) == list(range(1, stopped + 1))
    assert "requeueing job" in slurm_cluster.batch_output(tmp_path)
    # Slurm holds a requeued job until its last run's credentials expire (cred_expire + 1 s:
    # slurm_up.sh sets 15 s) and then starts it again by itself. Forcing it earlier races the
    # revocation of those credentials (whole seconds) and the job can fail as "job credential
    # revoked" before its script runs.
    ended = {j: slurm_cluster.wait_until_ended(slurm, j, cwd=tmp_path) for j in (job, ref_job)}
    for info in ended.values():
        assert info["JobState"] == "COMPLETED", _why(slurm, tmp_path, info)
    assert ended[ref_job]["JobName"] == "ref"  # renamed after the run folder: singleton keys on it
    assert (ref / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").is_file()
    logs = ref / "logs" / f"job-{ref_job}-restart-0"
    assert (logs / "recipe.yaml").is_file() and (logs / "node-0.log").is_file()
    assert list((logs / "ranks").glob("*/attempt_0/0/stdout.log"))  # per-rank logs
    assert (pre / "logs" / f"job-{job}-restart-1" / "launch.sh").read_text().count("--resume")
    assert _train_steps(pre) == list(range(1, STEPS + 1))  # every step once: none lost or redone
    a, b = _comparable(pre), _comparable(ref)
    assert a == b  # bit for bit on CPU, but for the timings
    assert not (pre / "preempted.json").exists()  # cleared on relaunch; the finished run adds none


# -- a real Slurm job with a Ray cluster (backends verl and nemo_rl) ----------------------------
VERL_BIN = ROOT / ".venv-verl/bin"
# The entry that RAY_ENTRY runs on the head in place of the engine's: it connects to the cluster
# through RAY_ADDRESS, appends what it sees to a file, and (with --hold, in the first run of the
# job) stays, a stand-in for a long training run.
RAY_CHECK = """import json, os, sys, time
import ray
out, hold = sys.argv[1], "--hold" in sys.argv
restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
nodes = [{"alive": n["Alive"], "host": n["NodeManagerHostname"],
          "slurm": [k for k in n["Resources"] if k.startswith("slurm-node/")]} for n in ray.nodes()]
ray.shutdown()
record = {"restart": restart, "on": os.environ.get("SLURMD_NODENAME"),
          "address": os.environ["RAY_ADDRESS"], "nodes": nodes}
with open(out, "a") as f:
    f.write(json.dumps(record) + "\\n")
if hold and restart == 0:
    time.sleep(900)
"""


def _slurm_nodes(conf: str) -> list[str]:
    p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                       env=_env(SLURM_CONF=conf))  # fmt: skip
    return sorted(set(p.stdout.split()))


def _ray_sbatch(conf, cwd: Path, backend: str, nodes: int, **extra) -> int:
    """grpo_balanced.sh for `backend` on `nodes` nodes with .venv-verl's Python and Ray (the
    engine's own import check skipped: `import verl` alone takes half a minute here)."""
    env = {k: v for k, v in _env(PYTHON=VERL_BIN / "python", BACKEND_CHECK=0, RUN_DIR=cwd / "run",
                                 **extra).items()
           if not k.startswith("RAY_") or k in ("RAY_ENTRY", "RAY_WAIT_TIMEOUT")}  # fmt: skip
    return slurm_cluster.submit(conf, BATCH, QWEN, *RAY_ARGS[backend], cwd=cwd, env=env,
                                options=(f"--nodes={nodes}",))  # fmt: skip


def _ray_daemons(job: int) -> list[str]:
    """The raylet and gcs_server processes of Slurm job `job` (by SLURM_JOB_ID in their
    environment), zombies left out."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            name = (proc / "comm").read_text().strip()
            if name not in ("raylet", "gcs_server") or " Z " in (proc / "stat").read_text():
                continue
            if f"SLURM_JOB_ID={job}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(name)
        except (OSError, ValueError):
            continue
    return sorted(found)


def _no_ray_daemons(job: int) -> bool:
    """No raylet or gcs_server of `job` left (a killed one can take a moment to go)."""
    with contextlib.suppress(AssertionError):
        return _wait(lambda: not _ray_daemons(job), "Ray's daemons to go", timeout=15, every=0.5)
    return False


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sbatch_forms_a_ray_cluster_and_a_preempted_job_forms_it_again(slurm, tmp_path):
    """backend=verl as a real job on every node of the cluster (two on scripts/slurm_up.sh's):
    the Ray head and the worker join, the entry (RAY_ENTRY, a stand-in for the engine's) runs on
    the head and sees them through RAY_ADDRESS; SIGUSR1 ends it, stops Ray (no raylet or
    gcs_server of the job left) and requeues the job, whose second run forms Ray again and runs
    the entry, which knows it is a restart; the job completes with Ray stopped."""
    if not (VERL_BIN / "ray").exists():
        pytest.skip("no .venv-verl with Ray (bash scripts/setup_verl_env.sh)")
    nodes = min(2, len(_slurm_nodes(slurm)))
    check, seen = tmp_path / "check.py", tmp_path / "seen.jsonl"
    check.write_text(RAY_CHECK)
    job = _ray_sbatch(slurm, tmp_path, "verl", nodes,
                      RAY_ENTRY=f"{VERL_BIN / 'python'} {check} {seen} --hold")  # fmt: skip
    run = tmp_path / "run"
    _wait(lambda: _records(seen) or _job(slurm, job).get("JobState") not in ("PENDING", "RUNNING"),
          "the entry", timeout=600, every=0.5)  # fmt: skip
    info = _job(slurm, job)
    hosts = subprocess.run(["scontrol", "show", "hostnames", info["NodeList"]], check=True,
                           capture_output=True, text=True,
                           env=_env(SLURM_CONF=slurm)).stdout.split()  # fmt: skip
    assert len(hosts) == nodes and _records(seen), _why(slurm, tmp_path, info)
    # while the entry runs: a raylet on each node, the GCS on the head (the control of the checks
    # that they are gone)
    assert _ray_daemons(job) == ["gcs_server", *["raylet"] * nodes]
    slurm_cluster.preempt(slurm, job)
    slurm_cluster.wait_requeued(slurm, job)
    assert _no_ray_daemons(job), _ray_daemons(job)  # Ray stopped before the requeue
    out = slurm_cluster.batch_output(tmp_path)
    assert out.index("Ray stopped") < out.index("requeueing job")
    info = slurm_cluster.wait_until_ended(slurm, job, cwd=tmp_path)
    logs = [run / "logs" / f"job-{job}-restart-{n}" for n in (0, 1)]
    assert info["JobState"] == "COMPLETED", _why(slurm, tmp_path, info,
                                                 *[d / "ray-head.log" for d in logs])  # fmt: skip
    assert _no_ray_daemons(job), _ray_daemons(job)
    records = _records(seen)
    assert [r["restart"] for r in records] == [0, 1]  # the entry, once in each run
    for r in records:
        assert r["on"] == hosts[0]  # on the head
        assert r["address"] == f"{hosts[0]}:{20000 + job % 20000}"
        assert all(n["alive"] for n in r["nodes"])
        assert sorted(n["slurm"][0] for n in r["nodes"]) == [f"slurm-node/{h}" for h in hosts]
    out = slurm_cluster.batch_output(tmp_path)
    assert out.count(f"ray_cluster: {nodes} node(s) joined at ") == 2
    assert out.count("Ray stopped") == 2
    assert "finished with exit status 0" in out
    for d in logs:
        assert (d / "entry.log").is_file() and (d / "ray-head.log").is_file()


@pytest.mark.slow
def test_a_ray_cluster_whose_worker_does_not_start_fails_the_job(slurm, tmp_path):
    """The negative control, backend=nemo_rl on two nodes: the worker's `ray start` fails (a
    stand-in ray that does not start workers), so the wait gives up at once naming the node that
    did not join, the job fails before the entry, and no Ray daemon of it is left."""
    if not (VERL_BIN / "ray").exists():
        pytest.skip("no .venv-verl with Ray (bash scripts/setup_verl_env.sh)")
    if len(_slurm_nodes(slurm)) < 2:
        pytest.skip("a one-node Slurm: a worker needs a second node (scripts/slurm_up.sh)")
    ray = tmp_path / "ray-without-workers"
    ray.write_text(f"""#!/bin/bash
if [[ $1 == start && " $* " == *" --address="* ]]; then
    echo "stand-in: this worker does not start" >&2
    exit 1
fi
exec {VERL_BIN / "ray"} "$@"
""")
    ray.chmod(0o755)
    check, seen = tmp_path / "check.py", tmp_path / "seen.jsonl"
    check.write_text(RAY_CHECK)
    job = _ray_sbatch(slurm, tmp_path, "nemo_rl", 2, RAY=ray,
                      RAY_ENTRY=f"{VERL_BIN / 'python'} {check} {seen}")  # fmt: skip
    info = slurm_cluster.wait_until_ended(slurm, job, timeout=600, cwd=tmp_path)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", _why(slurm, tmp_path, info)
    head, worker = subprocess.run(["scontrol", "show", "hostnames", info["NodeList"]],
                                  check=True, capture_output=True, text=True,
                                  env=_env(SLURM_CONF=slurm)).stdout.split()  # fmt: skip
    out = slurm_cluster.batch_output(tmp_path)
    assert "1 of 2 node(s) joined after " in out and f"({head}); missing: {worker}" in out, out
    assert "a node's Ray step ended: not waiting any longer" in out
    assert f"the Ray cluster did not form (above); ended: the worker on {worker};" in out
    assert "nemo_rl not launched" in out and "launching on" not in out
    assert not seen.exists()  # no entry
    assert _no_ray_daemons(job), _ray_daemons(job)


# -- the training side of preemption (megatron_ba/train/preemption.py) -------------------------
def _child_blocks_usr1() -> bool:
    """Whether a process started now from this thread has SIGUSR1 blocked (its SigBlk mask)."""
    out = subprocess.run(["grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True)
    return bool(int(out.stdout.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))


def test_preemption_flag_file_and_children(tmp_path):
    from megatron_ba.train import preemption

    class World1:
        world = 1

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    old_handler = signal.getsignal(signal.SIGUSR1)
    try:
        assert not _child_blocks_usr1()  # negative control: nothing installed yet
        preemption.install()
        assert not preemption.should_stop(World1(), tmp_path)
        (tmp_path / preemption.REQUEST_FILE).touch()  # what the batch shell writes on B:USR1
        assert preemption.should_stop(World1(), tmp_path)
        preemption.clear(tmp_path)
        assert not preemption.should_stop(World1(), tmp_path)
        assert _child_blocks_usr1()  # vLLM / reward workers started now cannot die of it
        os.kill(os.getpid(), signal.SIGUSR1)  # blocked here: the waiting thread takes it
        _wait(
            lambda: preemption.should_stop(World1(), tmp_path), "the flag", timeout=10, every=0.05
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        signal.signal(signal.SIGUSR1, old_handler)
        preemption._requested = False


class _Clock:
    """NeMo-Aligner's Timer as RunTimerWithRequests uses it: time left, settable."""

    def __init__(self) -> None:
        self.left = 10.0

    def start_time(self) -> None:
        pass

    def get_time_remaining(self) -> float:
        return self.left


def test_nemo_aligner_run_timer_stops_on_the_launchers_request(tmp_path):
    """The NeMo backend's side of the protocol: the same file names and exit status as the local
    backend's, and a run timer that finishes when RUN_DIR/PREEMPT appears or time is up."""
    from megatron_ba.integrations.nemo_aligner import requeue as nemo
    from megatron_ba.train import preemption

    assert (nemo.REQUEST_FILE, nemo.MARKER_FILE, nemo.PREEMPTED_EXIT_CODE) == (
        preemption.REQUEST_FILE, preemption.MARKER_FILE, preemption.PREEMPTED_EXIT_CODE
    )  # fmt: skip
    clock = _Clock()
    timer = nemo.RunTimerWithRequests(clock, tmp_path)
    assert not timer.is_finished() and not timer.requested
    (tmp_path / "PREEMPT").touch()
    assert timer.is_finished() and timer.requested
    (tmp_path / "PREEMPT").unlink()
    clock.left = 0.0  # NeMo's own limit (exp_manager.max_time_per_run): finished, not requested
    assert timer.is_finished() and not timer.requested
    nemo.mark_preempted(tmp_path, 3)
    assert json.loads((tmp_path / "preempted.json").read_text()) == {"step": 3}


# -- a study as one job array (megatron-ba study --slurm) ---------------------------------------
@pytest.mark.slow
def test_a_study_runs_as_a_job_array_and_a_preempted_element_resumes(slurm, cache_dir, tmp_path):
    """Two elements as array tasks, side by side. The grid sweeps logging.plots, which does not
    touch training, so plots=false is the uninterrupted twin of plots=true, which is preempted
    after its first step, requeued and resumed. (Wider grids: tests/test_study.py.)"""
    out = tmp_path / "study"
    out.mkdir()
    (out / ".cache").symlink_to(cache_dir)  # the module's warm start
    steps = [f"grpo.steps={STEPS}", "checkpoint.every=0", "eval.every=0", "loss.rule=token"]
    cmd = [sys.executable, "-m", "megatron_ba.cli", "study", str(TINY), *SMALL, *steps,
           "--grid", "logging.plots=true,false",
           "--out", str(out), "--slurm", "--max-parallel", "2"]  # fmt: skip
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(SLURM_CONF=slurm), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    array = re.search(r"submitted job array (\d+) \(2 tasks\)", p.stdout).group(1)
    tasks = [f"{array}_{i}" for i in range(2)]
    pre, twin = out / "plotstrue", out / "plotsfalse"
    _wait(lambda: len(_train_steps(pre)) >= 1, "the first step", every=0.2)
    task0 = _job(slurm, tasks[0])["JobId"]  # Slurm's warning goes to the task's own job id
    # scancel delivers the signal, then finds a running array task "in transitional state" and
    # delivers it again and again until it gives up (exit status 228): stopped after 5 s. The
    # launcher takes a signal that comes before its launch too (grpo_balanced.sh's first trap).
    subprocess.run(["timeout", "5", "scancel", "--signal=USR1", "--batch", task0],
                   env=_env(SLURM_CONF=slurm), capture_output=True)  # fmt: skip
    _wait(lambda: _job(slurm, tasks[0]).get("Restarts") == "1", "the requeue")
    for task in tasks:
        info = slurm_cluster.wait_until_ended(slurm, task, cwd=out)
        assert info["JobState"] == "COMPLETED", _why(slurm, out, info)
    assert (pre / "logs" / f"job-{_job(slurm, tasks[0])['JobId']}-restart-1").is_dir()
    assert _train_steps(pre) == list(range(1, STEPS + 1))  # every step once: none lost or redone
    assert _comparable(pre) == _comparable(twin)  # bit for bit on CPU, but for the timings
    report = subprocess.run([sys.executable, "-m", "megatron_ba.cli", "report", str(out)],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True)  # fmt: skip
    assert report.returncode == 0, report.stderr
    cells = json.loads((out / "report.json").read_text())["cells"]
    assert len(cells) == 2 and all(len(c["runs"]) == 1 for c in cells)


# -- the tests' own wait (tests/slurm_cluster.py) -----------------------------------------------
def test_the_wait_gives_up_at_once_on_a_held_job_and_waits_for_a_released_one(slurm, tmp_path):
    """A job Slurm will not start again (here held by its user) fails the wait at once, naming
    the reason, instead of after the timeout; the control: the same job released completes."""
    env = _env(SLURM_CONF=slurm)
    job = slurm_cluster.submit(slurm, cwd=tmp_path, options=("--hold", "--wrap", "true"))
    try:
        with pytest.raises(AssertionError, match=r"will not start again \(JobHeldUser\)"):
            slurm_cluster.wait_until_ended(slurm, job, timeout=600, cwd=tmp_path)
        subprocess.run(["scontrol", "release", str(job)], env=env, check=True)
        info = slurm_cluster.wait_until_ended(slurm, job, timeout=600, cwd=tmp_path)
        assert info["JobState"] == "COMPLETED"
    finally:
        subprocess.run(["scancel", str(job)], env=env, capture_output=True)
