"""Running the ``tierlog`` command as a user would: a separate process, no inherited TIERLOG_* settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def cli_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLOG_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra or {})
    return env


def cli_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "streaming.cli", *argv]


def tierlog(*argv: str, stdin: str | None = None, cwd=None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(*argv), input=stdin, cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)
