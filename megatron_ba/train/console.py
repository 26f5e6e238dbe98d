"""The terminal of a training run: our progress bar and lines there, everything else in RUN/logs/.
(`megatron-ba eval` uses it too, with its log file beside its output.)

    console = Console(run_dir / "logs", rank=0, verbose=False)
    with console:                        # from here on third-party output goes to the log file
        console.log("[eval] step 0 ...")  # our lines still reach the terminal
        tqdm(..., file=console.stream)
    # afterwards the terminal is back (print the summary, or the traceback of a failure)

vLLM, Transformer Engine / Apex fallback warnings, megatron-core and torch print hundreds of lines
around the progress bar. Python-level redirection would not catch them: the vLLM engine runs in a
process of its own and C extensions write to the file descriptors directly. So the console
redirects file descriptors 1 and 2 into `logs/rank-<r>.log` (inherited by child processes) and
keeps a duplicate of the original terminal for our own lines. `verbose=True` changes nothing: all
output stays on the terminal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


class Console:
    def __init__(
        self,
        log_dir: str | Path,
        *,
        rank: int = 0,
        verbose: bool = False,
        name: str | None = None,
    ) -> None:
        # `name`: the log file's name in log_dir (default rank-<r>.log; `megatron-ba eval` names
        # it after its output).
        self.log_path = Path(log_dir) / (name or f"rank-{rank}.log")
        self.verbose = verbose
        self.stream = sys.stderr  # where our lines and the progress bar go
        self._saved: tuple[int, int] | None = None

    def __enter__(self) -> Console:
        if self.verbose or self._saved is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        with open(self.log_path, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        # Line-buffered, on a duplicate of the terminal's stderr: our lines appear at once and
        # the progress bar redraws in place.
        self.stream = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        return self

    def log(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, say_where: bool = True) -> None:
        """Give the terminal back (idempotent); say where the third-party output went (not for a
        run refused at start-up, whose folder goes)."""
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = self._saved
        self._saved = None
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self.stream.close()
        self.stream = sys.stderr
        if say_where and self.log_path.exists():
            print(f"[logs] third-party output: {self.log_path}", file=sys.stderr)
