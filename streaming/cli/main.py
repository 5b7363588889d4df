from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from connectors.errors import TierlogError, exit_code
from streaming import config as cfg
from streaming.cli.parser import build_parser


def overrides_from(args: argparse.Namespace) -> dict:
    """Flags named ``section.key`` override settings."""
    return {k: v for k, v in vars(args).items() if "." in k and v is not None}


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every Python thread's stack to stderr and the run goes on: what a
    run that seems stuck is doing (the tests' runner asks for it before killing a run past its time).
    Not when stderr is no file (main called in a process that captures it)."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        pass


def main(argv: list[str] | None = None) -> int:
    _stacks_on_sigusr1()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # py4j reports the connections a stopping JVM drops, each with a trace: what matters reaches the
    # runner as the query's failure, one line.  Its own DEBUG is every command it sends and every
    # answer, 1,600 records (5,300 lines) in a 20 s catch-up: so DEBUG shows py4j's INFO.
    logging.getLogger("py4j").setLevel(logging.INFO if args.log_level == "DEBUG" else logging.CRITICAL)
    for chatty in ("botocore", "boto3", "urllib3"):  # "Found credentials in environment variables" etc.
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # kafka-python logs every connection, and every refused one with a traceback; the sinks report
    # what matters (waiting for the broker, in the log and in status) in one line each.
    logging.getLogger("kafka").setLevel(logging.DEBUG if args.log_level == "DEBUG" else logging.CRITICAL)
    if getattr(args, "reads", False):  # a person waits on it: a store that is away is said in seconds
        from connectors.tier.retry import READ_DEADLINE_S, set_patience

        set_patience(READ_DEADLINE_S)
    try:
        conf = cfg.load(args.config, overrides=overrides_from(args))
        return args.func(args, conf)
    except TierlogError as exc:  # one paragraph for a person; the trace only under --log-level DEBUG
        logging.getLogger("tierlog").debug("the error's trace", exc_info=True)
        print(f"tierlog: error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
