"""The training console: our lines on the terminal, third-party output (child processes and C
code writing to the file descriptors included) in RUN/logs/rank-<r>.log; --verbose shows all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, warnings
    from megatron_ba.train.console import Console
    with Console(sys.argv[1], rank=0, verbose=sys.argv[2] == "1") as console:
        console.log("[ours] progress line")
        print("INFO python print from a library")
        warnings.warn("a fallback warning")
        os.write(2, b"WARNING written to fd 2 by C code\\n")
        subprocess.run([sys.executable, "-c", "print('INFO from the engine process')"])
    print("after: the summary")
    """
)


def _run(tmp_path, verbose: bool):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs"), "1" if verbose else "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_third_party_output_goes_to_the_log_file(tmp_path):
    proc = _run(tmp_path, verbose=False)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    assert "[ours] progress line" in terminal and "after: the summary" in terminal
    for noise in ("python print", "fallback warning", "fd 2 by C code", "engine process"):
        assert noise not in terminal
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    for noise in ("python print", "fallback warning", "fd 2 by C code", "engine process"):
        assert noise in log
    assert "[ours]" not in log
    assert f"third-party output: {tmp_path / 'logs' / 'rank-0.log'}" in proc.stderr


def test_verbose_keeps_everything_on_the_terminal(tmp_path):
    proc = _run(tmp_path, verbose=True)
    terminal = proc.stdout + proc.stderr
    for line in ("[ours]", "python print", "fallback warning", "fd 2 by C code", "engine process"):
        assert line in terminal
    assert not (tmp_path / "logs").exists()
