"""Trusted launcher of the code sandbox (stdlib only; run by megatron_ba.rewards.sandbox).

    python -I -S _sandbox_launch.py run CONFIG_JSON     # set up, run the runner, clean up
    python -I -S _sandbox_launch.py reap UID            # SIGKILL every process of UID

It runs as the scoring process's user (root on the project's machines) in a fresh,
single-threaded interpreter, so that no `preexec_fn` runs in a possibly multi-threaded caller.
Steps, each recorded in the status line it prints on stderr:
  1. join the sandbox's cgroups (pids.max, memory limit) when the caller made them;
  2. a new network namespace (only a loopback that is down: no route anywhere) and a new mount
     namespace with fresh size-limited tmpfs on /tmp, /var/tmp, /dev/shm and every other mount
     read-only, so nothing outside the private /tmp/work can be written;
  3. fork the untrusted runner: new session, rlimits, supplementary groups dropped, uid/gid
     switched to a throw-away uid (RLIMIT_NPROC is ignored for root: as that uid it holds),
     no_new_privs, parent-death signal, scrubbed environment, no inherited descriptors;
  4. wait at most the wall-clock budget, then kill every process of the sandbox uid.
The untrusted code never sees the expected outputs: it only writes raw outputs to stdout, and
the caller compares them. This file must stay importable by a bare `python -I -S`.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

SANDBOX_ROOT = "/tmp"  # the private tmpfs that becomes the sandbox's only writable place
WORKDIR = "/tmp/work"
PYTHON_MOUNT = "/tmp/.python"
SCRATCH_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")

_libc = ctypes.CDLL(None, use_errno=True)


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mount(src, target, fstype, flags, data) -> None:
    enc = [None if a is None else a.encode() for a in (src, target, fstype, data)]
    _call(_libc.mount, enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))  # "\040" -> " "
    return points


def _isolate_filesystem(cfg: dict) -> str:
    """New mount namespace: private tmpfs scratch dirs, the interpreter bound read-only, the rest
    remounted read-only. Returns the interpreter path usable inside."""
    _call(_libc.unshare, CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    size = f"size={int(cfg['tmpfs_bytes'])},mode=1777"
    _mount("tmpfs", SANDBOX_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, size)
    ours = {SANDBOX_ROOT}
    for d in SCRATCH_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1048576,mode=1777")
            ours.add(d)
    # The interpreter may live under a directory the sandbox uid cannot traverse (/root): bind
    # its installation prefix into the private tmpfs, read-only.
    os.mkdir(PYTHON_MOUNT, 0o755)
    _mount(cfg["python_prefix"], PYTHON_MOUNT, None, MS_BIND | MS_REC, None)
    _mount(None, PYTHON_MOUNT, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
    ours.add(PYTHON_MOUNT)
    for point in _mount_points():
        if point in ours or point.startswith(("/proc", "/sys", "/dev")):
            continue
        try:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
        except OSError:
            pass  # some pseudo mounts refuse; they are not writable by the sandbox uid anyway
    return os.path.join(PYTHON_MOUNT, cfg["python_rel"])


def _reap(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) from a helper running as that uid reaches
    exactly them (and sees forks made during the pass blocked by the tasklist lock)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            for _ in range(5):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _start_runner(cfg: dict, python: str, workdir: str) -> int:
    uid = cfg["uid"]
    pid = os.fork()
    if pid != 0:
        return pid
    try:  # child: becomes the untrusted runner
        os.setsid()
        lim = cfg["limits"]
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"]))
        resource.setrlimit(resource.RLIMIT_AS, (lim["address_space"], lim["address_space"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size"], lim["file_size"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _call(_libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _call(_libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid: it clears
        os.chdir(workdir)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 2)  # the runner's stderr is untrusted noise: drop it
        os.closerange(3, 65536)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
        }
        if python.startswith(PYTHON_MOUNT + "/") and cfg.get("python_libdir_rel"):
            # The bound interpreter's RUNPATH names its libpython where the caller installed it
            # (e.g. under /root, which the sandbox uid cannot traverse): point the loader at the
            # bound copy. Without it an interpreter built with --enable-shared exits 127 (or
            # silently loads the system's libpython of the same version, where there is one).
            env["LD_LIBRARY_PATH"] = os.path.join(PYTHON_MOUNT, cfg["python_libdir_rel"])
        os.execve(python, [python, "-I", "-S", "runner.py"], env)
    except BaseException as exc:  # report and die, never return into the launcher
        os.write(2, f"sandbox runner setup failed: {exc!r}\n".encode())
    os._exit(126)


def _run(cfg: dict) -> int:
    started = time.monotonic()
    status = {"status": "error", "net_isolated": False, "fs_isolated": False, "uid": cfg["uid"]}
    for procs in cfg.get("cgroup_procs", []):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    status["cgroups"] = len(cfg.get("cgroup_procs", []))
    try:
        if not cfg["namespaces"]:
            raise OSError("namespaces disabled by the caller")
        _call(_libc.unshare, CLONE_NEWNET)
        status["net_isolated"] = True
    except OSError as exc:
        status["net_error"] = str(exc)
    # Read what the runner needs before the private tmpfs hides the caller's /tmp.
    with open(cfg["payload"]) as f:
        payload = json.load(f)
    with open(cfg["runner_src"], "rb") as f:
        runner_src = f.read()
    python = cfg["python_fallback"]
    workdir = cfg["fallback_workdir"]
    try:
        if not cfg["namespaces"]:
            raise OSError("namespaces disabled by the caller")
        if not cfg["python_rel"]:
            raise OSError("interpreter is not under its base prefix: cannot bind it")
        python = _isolate_filesystem(cfg)
        workdir = WORKDIR
        os.mkdir(workdir, 0o700)
        status["fs_isolated"] = True
    except OSError as exc:
        status["fs_error"] = str(exc)
    # Without a network namespace, the runner refuses every socket through an audit hook.
    payload["block_sockets"] = status["block_sockets"] = not status["net_isolated"]
    with open(os.path.join(workdir, "payload.json"), "w") as f:
        json.dump(payload, f)
    with open(os.path.join(workdir, "runner.py"), "wb") as f:
        f.write(runner_src)
    if cfg["uid"] is not None:
        for name in ("", "runner.py", "payload.json"):
            os.chown(os.path.join(workdir, name), cfg["uid"], cfg["uid"])
    # Orphans of the sandbox become our children (not init's): we reap them as they die, so
    # zombies never pile up against the process limits, and we can wait for the last one.
    _call(_libc.prctl, PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = _start_runner(cfg, python, workdir)
    deadline = started + cfg["wall_s"]
    status["status"] = "timeout"
    while time.monotonic() < deadline and status["status"] == "timeout":
        while True:
            try:
                done, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                done = 0
            if done == 0:
                break
            if done == pid:
                status["status"] = "exited"
                status["exit_code"] = os.waitstatus_to_exitcode(wstatus)
        time.sleep(0.002)
    try:
        os.killpg(pid, signal.SIGKILL)  # the runner's session (all, without a sandbox uid)
    except ProcessLookupError:
        pass
    if cfg["uid"] is not None:
        _reap(cfg["uid"])
    give_up = time.monotonic() + 2.0
    while time.monotonic() < give_up:  # everything left is dying: collect it
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.002)
        except ChildProcessError:
            break
    status["elapsed_s"] = round(time.monotonic() - started, 4)
    os.write(2, (json.dumps(status) + "\n").encode())
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "run":
        with open(argv[2]) as f:
            return _run(json.load(f))
    if len(argv) == 3 and argv[1] == "reap":
        _reap(int(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
