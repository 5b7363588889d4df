"""Running the ``tierlog`` command as a user would: a separate process, no inherited TIERLOG_* settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def cli_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLOG_")}
    env["PYTHONPATH"] = str(ROOT)
    # As in an activated .venv: `tierlog` and `python` are this installation's.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env


def cli_command(*argv: str, prelude: str | None = None) -> list[str]:
    """The command line of ``tierlog argv``; ``prelude``, Python run first in the same process, injects a fault."""
    if prelude is None:
        return [sys.executable, "-m", "streaming.cli", *argv]
    main = "import sys\nfrom streaming import cli\nsys.exit(cli.main(sys.argv[1:]))\n"
    return [sys.executable, "-c", prelude + "\n" + main, *argv]


def tierlog(*argv: str, stdin: str | None = None, cwd=None, env: dict | None = None,
            timeout: float = 300, prelude: str | None = None) -> subprocess.CompletedProcess:
    """``tierlog argv`` as a process; past ``timeout`` it is killed, and the AssertionError raised
    says what it was doing: the end of its log, every Python thread's stack (SIGUSR1, see
    ``streaming.cli.main``) and the JVM's streaming threads (jstack), where a hang shows."""
    command = cli_command(*argv, prelude=prelude)
    with subprocess.Popen(command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env=cli_env(env)) as proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            jvm = _jvm_threads(proc.pid)
            proc.send_signal(signal.SIGUSR1)
            try:
                out, err = proc.communicate(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"`tierlog {' '.join(argv)}` ran past {timeout:g} s and was killed; its stderr "
                                 f"ends:\n{err[-12000:]}\nthe JVM's streaming threads:\n{jvm}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def processes_marked(mark: str) -> list[str]:
    """The command lines of the processes still running whose environment holds ``TEST_RUN_MARK=mark``
    (pass it in ``env``: every process a command starts inherits it, its JVM included)."""
    found, needle = [], f"TEST_RUN_MARK={mark}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _jvm_threads(pid: int) -> str:
    """The stacks of the Spark JVM's query and batch threads under process ``pid``, from jstack."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as fh:
                name = fh.read().strip()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and name == "java":
            children.append(entry)
    dumps = []
    for java in children:
        try:
            text = subprocess.run(["jstack", java], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            dumps.append(f"(jstack {java}: {exc})")
            continue
        threads = text.split("\n\n")
        dumps.extend(t for t in threads if "stream execution" in t or "Python" in t or "foreachBatch" in t)
    return "\n\n".join(dumps)[-12000:] or "(no JVM found)"


def run_killed_at(config, point: str, nth: int, fault_dir: Path, *flags: str) -> bool:
    """``tierlog run --until-caught-up [flags]`` with a crash point armed; True if it was SIGKILLed
    there (else it must have exited 0, leaving no JVM crash: the point was not reached that many
    times).  It runs in ``fault_dir`` (``crashed_in``)."""
    import signal

    fault_dir.mkdir()
    result = tierlog("run", "--until-caught-up", "--config", str(config), *flags, cwd=fault_dir,
                     env={"TIERLOG_FAULT": f"{point}:{nth}", "TIERLOG_FAULT_DIR": str(fault_dir)})
    if result.returncode == -signal.SIGKILL:
        return True
    assert result.returncode == 0, result.stderr[-3000:]
    assert not crashed_in(fault_dir), crashed_in(fault_dir)
    return False


def crashed_in(directory: Path) -> list[Path]:
    """The JVM crash reports (``hs_err_pid*``) a process run in ``directory`` left there.

    Why a killed run gets a directory of its own: once its driver is SIGKILLed, Spark's JVM sees
    its stdin close and exits with the state stores' RocksDB still open, and a RocksDB thread can
    crash it on the way out (CI met SIGSEGV in ``DBImpl::PersistStats``).  That report belongs to
    the kill, not to an orderly exit, so it must not land where ``test_orderly_exit`` looks."""
    return sorted(directory.glob("hs_err_pid*"))


def sink_offsets(conf) -> dict[str, int]:
    """Each sink's applied physical offset, from the metadata store (read-only)."""
    from state.metadata import MetadataStore
    from streaming.settings import derive

    store = MetadataStore(derive(conf).paths.metadata, read_only=True)
    try:
        return store.journal.sinks()
    finally:
        store.close()


def write_config(tmp_path: Path, **sections: dict) -> Path:
    """``tmp_path/tierlog.toml``: a deployment under ``tmp_path`` (commitlog, tier, state,
    checkpoints), plus ``sections`` (``tier={"segment_messages": 120}``) merged over it."""
    import json

    base = {"commitlog": {"dir": str(tmp_path / "commitlog")}, "tier": {"location": str(tmp_path / "tier")},
            "state": {"dir": str(tmp_path / "state")}, "checkpoint": {"dir": str(tmp_path / "checkpoints")},
            "metrics": {"port": 0}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    cap = base.get("source", {}).get("max_bytes_per_trigger")
    if cap is not None:  # a test that caps batches small counts compaction's too (crash points, restarts)
        base["compaction"] = {"max_batch_bytes": cap, **base.get("compaction", {})}
    lines = []
    for section, values in base.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]  # JSON scalars are TOML scalars
    path = tmp_path / "tierlog.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
