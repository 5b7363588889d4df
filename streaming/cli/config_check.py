"""``tierlog config show`` and ``tierlog config check``: every setting with where it came from, and what would stop a run."""

from __future__ import annotations

import socket
import sys

from connectors.errors import ConfigError, TierlogError
from streaming import config as cfg
from streaming.cli.output import emit


def cmd_config(args, conf: cfg.Config) -> int:
    if args.config_command == "show":
        if args.format == "json":
            emit([cfg.as_dict(conf)], "json")
        else:
            sys.stdout.write(cfg.to_toml(conf))
        return 0
    problems = check_config(conf)
    for problem in problems:
        print(f"tierlog: config: {problem}", file=sys.stderr)
    if not problems:
        print("configuration OK")
        return 0
    # Only systems that are away (75: trying again later can succeed), or a setting to fix (1).
    return 75 if all(isinstance(p, Away) for p in problems) else 1


class Away(str):
    """A problem that is a system away (an endpoint that refuses, a broker down), not a setting."""


def _dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as a directory tierlog writes to, or None.  Tried with a file made
    and removed in it, or in its nearest existing parent (permission bits do not bind root, and
    some file systems refuse writes whatever they say): nothing is left behind."""
    import os
    import tempfile

    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return "is not a directory" if existing == os.path.abspath(path) else f"cannot be created: {existing} is a file"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".tierlog-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = "" if existing == os.path.abspath(path) else f" (it does not exist, and {existing} is where it would be made)"
        return f"is not writable{where}: {exc.strerror or exc}"
    return None


def check_config(conf: cfg.Config) -> list[str]:
    """Reach out to what the configuration names; one line per problem, naming the setting."""
    problems = []
    from connectors.commitlog.reader import directory_problem

    commitlog = directory_problem(conf.commitlog.dir)
    if commitlog:
        problems.append(commitlog[1])
    for name, path in (("tier.location", conf.tier.location), ("state.dir", conf.state.dir),
                       ("checkpoint.dir", conf.checkpoint.dir)):
        if "://" not in path:
            problem = _dir_problem(path)
            if problem:
                problems.append(f"{name} {path!r} {problem}")
    if conf.tier.location.startswith("s3://"):
        problems += _s3_problems(conf.tier.location)
    from streaming.runtime.checkpoints import location_problem
    from streaming.settings import spark_jars

    problem = location_problem(spark_jars(conf.spark.jars), conf.checkpoint.dir)
    if problem:
        problems.append(problem)
    if not 0 <= conf.metrics.port <= 65535:
        problems.append(f"metrics.port {conf.metrics.port} is not a TCP port: use 1-65535, or 0 to turn metrics off")
    from streaming import settings

    for part in settings.PARTS:
        try:
            part(conf)
        except ConfigError as exc:
            problems.append(str(exc))
    for hostport in cfg.bootstrap_servers(conf.kafka.bootstrap):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"kafka.bootstrap entry {hostport!r} is not host:port")
            continue
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError as exc:
            problems.append(Away(f"kafka.bootstrap {hostport!r} is unreachable: {exc.strerror or exc}"))
    problems += _kafka_problems(conf)
    return problems


_CODEC_MODULES = {"snappy": "snappy", "lz4": "lz4", "zstd": "zstandard"}


def _s3_problems(location: str) -> list[str]:
    """Reach the bucket: a missing one, denied access or an unreachable endpoint, in one line."""
    from connectors.tier.s3 import S3Backend

    try:
        backend = S3Backend(location)
        try:
            backend.check()  # gives up after 10 s, where tiering would retry for minutes
        finally:
            backend.close()
    except TierlogError as exc:
        text = str(exc)
        text = text if "tier.location" in text else f"tier.location {location!r}: {text}"
        return [Away(text) if exc.retriable else text]
    return []


def _kafka_problems(conf: cfg.Config) -> list[str]:
    import importlib.util

    k, problems = conf.kafka, []
    if not k.bootstrap.strip():
        return problems
    module = _CODEC_MODULES.get(k.compression)
    if module and importlib.util.find_spec(module) is None:
        problems.append(f"kafka.compression = {k.compression!r} needs the Python package {module!r}: "
                        f"pip install {module}, or choose gzip or none")
    if k.changelog and not conf.compaction.enabled:
        problems.append("kafka.changelog is on but compaction.enabled is off: the changelog is fed by the "
                        "compaction query; turn one of them around")
    if k.security_protocol.startswith("SASL") and not (k.sasl_mechanism and k.sasl_username):
        problems.append(f"kafka.security_protocol = {k.security_protocol} needs kafka.sasl_mechanism and "
                        "kafka.sasl_username (and kafka.sasl_password)")
    return problems  # the settings' own parse (kafka_settings) is one of settings.PARTS
