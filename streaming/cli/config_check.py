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
    return 1 if problems else 0


def _dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as a directory tierlog writes to, or None."""
    import os

    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is not a directory"
        return None if os.access(path, os.W_OK) else "is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"does not exist and cannot be created under {parent}"
    return None


def check_config(conf: cfg.Config) -> list[str]:
    """Reach out to what the configuration names; one line per problem, naming the setting."""
    problems = []
    for name, path in (("commitlog.dir", conf.commitlog.dir), ("tier.location", conf.tier.location),
                       ("state.dir", conf.state.dir), ("checkpoint.dir", conf.checkpoint.dir)):
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
            problems.append(f"kafka.bootstrap {hostport!r} is unreachable: {exc.strerror or exc}")
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
        return [text if "tier.location" in text else f"tier.location {location!r}: {text}"]
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
