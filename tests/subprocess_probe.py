"""Run a Python snippet in a fresh interpreter and read back its `RESULT <json>` line: for the
settings a process makes once (the OpenMP runtime at import, malloc's thresholds), which a test
can neither observe from nor undo in the pytest process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any


def run_python(script: str, env_extra: dict[str, str] | None = None, *, drop: tuple[str, ...] = (),
               cwd: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`script` (dedented) in a fresh interpreter, with this process's environment less `drop`
    plus `env_extra`."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def result(proc: subprocess.CompletedProcess) -> Any:
    """The JSON of the process's last `RESULT ` line; fails with its stderr if it failed."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[-1][len("RESULT "):])
