"""The ``tierlog`` command line: every command, flag and its help text."""

from __future__ import annotations

import argparse

from streaming.cli.config_check import cmd_config
from streaming.cli.inspect import cmd_inspect
from streaming.cli.kv import cmd_kv
from streaming.cli.maintenance import cmd_commitlog_gc, cmd_tier
from streaming.cli.produce import cmd_produce
from streaming.cli.read import cmd_get, cmd_key, cmd_offset_for_time, cmd_queues
from streaming.cli.run import cmd_demo, cmd_run
from streaming.cli.status import cmd_gap, cmd_status
from streaming.cli.tables import cmd_table


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that name the command and its choices, not the parser's internal
    names (``argument kv_command: invalid choice``), and say where the help is."""

    commands: dict = {}  # the top parser's subcommands, by name

    def parse_args(self, args=None, namespace=None):
        # argparse leaves a subcommand's unknown options to the top parser, which would point at
        # `tierlog --help`: the subcommand's own parser says it, and points at its own help.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.commands.get(getattr(parsed, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self._plain(message)}; `{self.prog} --help` explains\n")

    def _plain(self, message: str) -> str:
        import difflib
        import re

        bad = re.match(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if bad:
            word, choices = bad.group(2), [c.strip(" '") for c in bad.group(3).split(",")]
            close = difflib.get_close_matches(word, choices, n=1)
            guess = f" (did you mean {close[0]}?)" if close else ""
            option = bad.group(1).split("/")[-1]
            if option.startswith("-"):  # an option's value, not a command
                return f"{option} {word!r} is not one of its choices{guess}: {_one_of(choices)}"
            return f"{word!r} is not a command of `{self.prog}`{guess}; choose {_one_of(choices)}"
        missing = re.match(r"the following arguments are required: (.*)$", message)
        if missing:
            wanted = []
            for dest in (d.strip() for d in missing.group(1).split(",")):
                action = next((a for a in self._actions if dest in (a.dest, a.metavar)), None)
                if action is not None and action.choices:
                    wanted.append(f"a command ({_one_of(list(action.choices))})")
                else:
                    wanted.append(dest)
            return f"`{self.prog}` needs {' and '.join(wanted)}"
        unknown = re.match(r"unrecognized arguments: (.*)$", message)
        if unknown:
            words = unknown.group(1).split()
            options = [a for action in self._actions for a in action.option_strings]
            close = difflib.get_close_matches(words[0], options, n=1) if words[0].startswith("-") else []
            guess = f" (did you mean {close[0]}?)" if close else ""
            return f"`{self.prog}` takes no {' '.join(words)!r}{guess}"
        named = re.match(r"argument (\S+): (.*)$", message)  # argparse's own wording of a bad value
        if named:
            return f"{named.group(1).split('/')[-1]}: {named.group(2)}"
        return message


def counting(least: int):
    """An argparse type: a whole number of at least ``least`` (a count or limit: 1; an offset: 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}: give {least} or more")
        return value
    return parse


def within(low: float, high: float | None = None, *, above: bool = False):
    """An argparse type: a number from ``low`` (or above it) up to ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if (value <= low if above else value < low) or (high is not None and value > high):
            span = (f"from {low:g} to {high:g}" if high is not None else f"above {low:g}" if above
                    else f"of at least {low:g}")
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: give a number {span}")
        return value
    return parse


COUNT, OFFSET = counting(1), counting(0)


def _one_of(choices: list[str]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


EPILOG = """\
configuration: defaults < tierlog.toml (or --config FILE) < TIERLOG_<SECTION>_<KEY> variables < flags.
Run `tierlog config show` to see every setting with its documentation."""


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (default: ./tierlog.toml if present)")
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="tierlog's log level (default INFO); DEBUG also shows Spark's start-up notes")
    common.add_argument("--commitlog-dir", dest="commitlog.dir", metavar="DIR", help="override commitlog.dir")
    common.add_argument("--broker-name", dest="broker.name", metavar="NAME",
                        help="override broker.name: the RocketMQ broker whose commitlog this is")
    tier = Parser(add_help=False)
    tier.add_argument("--tier", dest="tier.location", metavar="LOCATION", help="override tier.location")
    brokers = Parser(add_help=False)
    brokers.add_argument("--broker", dest="read_broker", metavar="NAME",
                         help="only this broker's part of the tier (default: every broker; a queue that several "
                         "brokers hold needs it)")
    printing = Parser(add_help=False)
    printing.add_argument("--format", choices=["table", "json"], default="table", help="table, or one JSON object per line")

    parser = Parser(
        prog="tierlog",
        description="Tier a RocketMQ commitlog to cheap storage, keep the latest value per key, "
        "and replicate it to Kafka, with Spark Structured Streaming.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.commands = sub.choices

    p = sub.add_parser(
        "produce", parents=[common, printing], help="append a synthetic workload (or JSON lines) to the commitlog",
        description="Append messages to the commitlog with the embedded producer. Generates a synthetic "
        "workload, or reads JSON lines from stdin with --stdin. Another writer on the same directory is refused.",
    )
    p.add_argument("--messages", type=OFFSET, default=10000, metavar="N", help="how many messages (default 10000)")
    p.add_argument("--topics", type=COUNT, default=2, metavar="T", help="spread over T topics (default 2)")
    p.add_argument("--queues", type=COUNT, default=4, metavar="Q", help="queues per topic (default 4)")
    p.add_argument("--keys", type=COUNT, default=1000, metavar="K", help="distinct keys (default 1000)")
    p.add_argument("--body-size", type=OFFSET, default=1024, metavar="B", help="body bytes (default 1024)")
    p.add_argument("--delete-ratio", type=within(0, 1), default=0.0, metavar="R", help="fraction of KV_OP=DELETE messages")
    p.add_argument("--rate", type=within(0), default=0.0, metavar="R", help="at most R msgs/s (default: as fast as possible)")
    p.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same messages")
    p.add_argument("--stdin", action="store_true", help='read JSON lines: {"topic", "queue_id", "body" or "body_b64", "keys", "tags", "properties"}')
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser(
        "inspect", parents=[common, printing], help="decode commitlog messages",
        description="Decode messages from the commitlog, from a physical offset or a queue offset.",
    )
    p.add_argument("--from-phy", type=OFFSET, default=None, metavar="N", help="start at physical offset N (default: the first retained)")
    p.add_argument("--topic", help="only this topic")
    p.add_argument("--queue", type=OFFSET, help="only this queue id")
    p.add_argument("--from-queue-offset", type=OFFSET, metavar="N", help="with --topic and --queue: from queue offset N")
    p.add_argument("--limit", type=COUNT, default=20, metavar="N", help="at most N messages (default 20)")
    p.add_argument("--summary", action="store_true",
                   help="instead of messages: per topic its class (business, retry, system), messages, bytes and "
                        "which sinks take it under [topics]; reads the whole commitlog (or from --from-phy)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "config", parents=[common, tier, printing], help="show or check the effective configuration",
        description="show: print the effective configuration, every setting with its doc, secrets masked. "
        "check: validate it and reach the commitlog directory, the tier and Kafka; one line per problem.",
    )
    p.add_argument("config_command", choices=["show", "check"])
    p.set_defaults(func=cmd_config, reads=True)

    p = sub.add_parser(
        "run", parents=[common, tier], help="run the service: tier the commitlog and keep the latest value per key",
        description="Run the tiering query, the compaction query (unless compaction.enabled = false) and, with "
        "kafka.bootstrap set, the Kafka mirror query in one Spark application until stopped (SIGTERM/SIGINT "
        "finish the batches in flight, then exit 0). Logs one JSON line per batch: for tiering rows, bytes, "
        "objects, seals and lag in bytes, messages and seconds; for compaction the changed keys, how many the "
        "KV view took, expired keys and snapshots; for the mirror the records sent.",
    )
    p.add_argument("--until-caught-up", action="store_true",
                   help="drain what is in the commitlog now (Spark availableNow) and exit 0")
    p.add_argument("--on-missing", dest="source.on_missing", choices=["fail", "skip"],
                   help="for this run, override source.on_missing: skip goes on past commitlog files deleted "
                        "before tierlog read them, recording the range as a gap (`tierlog status`, `tierlog gap ack`)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "status", parents=[common, printing], help="per-queue dispatch/commit offsets, lag, segments, safepoint",
        description="Show what is tiered, from the metadata store (opened read-only, so it works while "
        "`tierlog run` runs): per queue the dispatch, commit and sealed offsets, the lowest retained offset, "
        "messages not yet tiered, and segments; then the safepoint and each sink's applied offset.",
    )
    p.add_argument("--watch", type=within(0, above=True), metavar="SECONDS", nargs="?", const=2.0,
                   help="refresh every SECONDS (default 2) until Ctrl-C; the table view redraws in place, "
                        "JSON prints each refresh after the last")
    p.add_argument("--count", type=COUNT, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--topic", metavar="TOPIC", help="only this topic's queues")
    p.add_argument("--limit", type=COUNT, metavar="N", help="at most N queues, in name order")
    p.set_defaults(func=cmd_status, reads=True)

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
        "table", parents=[common, tier, printing], help="the Iceberg tables of the tier: info, rebuild",
        description="info: one row per table ([tables], on by default). A messages table (one per topic) "
        "holds every message the tier committed (its sealed segments and fresh files of the rest), within "
        "seconds; its row gives the tier commit record it reflects for this broker (tier_seq), the tier's last "
        "(tier_head_seq), and the committed messages it lacks (lag_messages) and how long the oldest has "
        "waited (lag_s). A latest "
        "table (one per topic) holds the newest compacted snapshot of every key; its row gives the physical "
        "offset that snapshot reflects (through_phy). Each row names the metadata file any engine can read "
        "with no catalog (DuckDB's iceberg_scan). rebuild: make each table equal to the tier alone (after a "
        "catalog was lost or restored from a backup); safe while `tierlog run` runs.",
    )
    p.add_argument("table_command", choices=["info", "rebuild"])
    p.set_defaults(func=cmd_table, reads=True)

    p = sub.add_parser(
        "gap", parents=[common, printing], help="acknowledge commitlog ranges deleted before tierlog read them",
        description="ack: acknowledge every gap `tierlog status` lists (commitlog ranges the broker deleted before "
        "tierlog read them, skipped under source.on_missing = skip), once you have dealt with the messages lost "
        "in them; `status` exits non-zero until then. Works while `tierlog run` runs.",
    )
    p.add_argument("gap_command", choices=["ack"])
    p.set_defaults(func=cmd_gap, reads=True)

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
    p.add_argument("queue", type=OFFSET, metavar="QUEUE")
    p.add_argument("offset", type=OFFSET, metavar="OFFSET")
    p.add_argument("--max", type=COUNT, default=32, metavar="N", help="at most N messages (default 32)")
    p.set_defaults(func=cmd_get, reads=True)

    p = sub.add_parser(
        "offset-for-time", parents=[common, tier, brokers, printing], help="find a queue offset by store time",
        description="Like RocketMQ's searchOffset: --boundary lower (default) gives the first offset whose store "
        "time is at or after TS (the commit offset if none); upper gives the last offset at or before TS (the "
        "lowest retained offset if none). TS is epoch milliseconds or ISO 8601.",
    )
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("queue", type=OFFSET, metavar="QUEUE")
    p.add_argument("timestamp", metavar="TS")
    p.add_argument("--boundary", choices=["lower", "upper"], default="lower")
    p.set_defaults(func=cmd_offset_for_time, reads=True)

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
    p.set_defaults(func=cmd_key, reads=True)

    p = sub.add_parser(
        "queues", parents=[common, tier, brokers, printing], help="list the queues in the tier",
        description="Every queue in the tier, of every broker: its lowest retained and commit offsets, the sealed offset, "
        "segments, and bytes. Reads one small bucket object per group of queues, never the segments; "
        "--topic reads only that topic's.",
    )
    p.add_argument("--topic", metavar="TOPIC", help="only this topic's queues")
    p.add_argument("--limit", type=COUNT, metavar="N", help="at most N queues, in name order")
    p.set_defaults(func=cmd_queues, reads=True)

    p = sub.add_parser(
        "kv", parents=[common, tier, brokers, printing],
        help="the latest value per key: get, scan, history, rebuild, snapshot",
        description="get TOPIC KEY: the latest value of one key (exit 1 if it has none). "
        "scan TOPIC [--prefix P]: live keys in key order. These open the KV view read-only, so they work "
        "while `tierlog run` runs. "
        "get TOPIC KEY --as-of TIME: the value the key had at TIME, read from the tier and its compacted "
        "snapshots alone (no local state: any machine that reads the tier can ask); says live, deleted, "
        "expired (compaction.ttl) or absent, and refuses a TIME retention has put out of reach, naming the "
        "earliest it can answer. "
        "history TOPIC KEY [--from T1] [--to T2]: every change of the key the tier holds in the window. "
        "snapshot: write every topic's live keys to the tier now, under _compacted/topic=<t>/. "
        "rebuild: recreate the KV view from the newest snapshots plus the tier and commitlog after them "
        "(--from tier or --from commitlog to replay from the start instead); stop `tierlog run` first.",
    )
    p.add_argument("kv_command", choices=["get", "scan", "history", "snapshot", "rebuild"])
    p.add_argument("topic", nargs="?", metavar="TOPIC")
    p.add_argument("key", nargs="?", metavar="KEY")
    p.add_argument("--prefix", metavar="P", help="scan: only keys starting with P")
    p.add_argument("--limit", type=OFFSET, default=0, metavar="N", help="scan: at most N keys (default 0: all)")
    p.add_argument("--as-of", dest="as_of", metavar="TIME",
                   help="get: the value at TIME (epoch ms, or ISO 8601 / RFC 3339 like 2026-11-21T10:42:00Z)")
    p.add_argument("--from", dest="source", metavar="FROM",
                   help="rebuild: where to start, snapshot (default), tier or commitlog; history: the window's "
                   "start (a TIME as for --as-of)")
    p.add_argument("--to", dest="until", metavar="TIME", help="history: the window's end (default: now)")
    p.set_defaults(func=cmd_kv, reads=True)

    p = sub.add_parser(
        "demo", parents=[common], help="run the main job on the embedded default (needs only Python and Java)",
        description="Produce a realistic workload into a local commitlog (several topics and queues, repeated "
        "keys, some deletes), tier it with Spark in local mode to a posix tier, and print what to try next.",
    )
    p.add_argument("--dir", default="data/demo", help="where the demo's commitlog, tier and state go (default data/demo)")
    p.add_argument("--messages", type=COUNT, default=50000, help="messages to produce (default 50000)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed (default 0): the same seed gives the same keys and values, so the README's "
                        "examples name keys the demo has")
    p.set_defaults(func=cmd_demo)
    return parser
