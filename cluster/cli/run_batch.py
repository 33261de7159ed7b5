"""`kvray run-batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's batch
format, answered by kvray, one result per line in input order (cluster/cli/batch_file.py).

With --base-url: sent to that running server (`kvray serve`, or any OpenAI-compatible one),
with --api-key or the key in $KVRAY_API_KEY (--api-key-env names another variable).
Without: this command starts what `kvray serve` starts (a local Ray instance and the kvray
application on the model, engine and replica flags) on free ports of 127.0.0.1 with a
one-off API key, runs the file against it, then deletes the application and stops Serve and
Ray. Its console is as quiet as `kvray serve`'s (--log-level).

The requests go over HTTP in both cases (cluster/cli/batch_runner.py): one code path, and a
local run answers exactly what the served API answers.

Imported by `kvray --help`: nothing heavy (no ray, aiohttp) at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import os
import secrets
import signal
import stat
import sys
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import TextIO

from cluster.cli.batch_file import SUPPORTED_URLS, count_requests, numbered_lines
from cluster.cli.batch_runner import RunOptions, check_server, normalize_base_url, run_lines
from cluster.cli.console import LOG_LEVEL_HELP, LOG_LEVELS, console_logging
from cluster.cli.flags import add_config_flags, api_key_from, config_from_flags
from cluster.config import ServeConfig

logger = logging.getLogger("kvray.run_batch")

DEFAULT_REMOTE_CONCURRENCY = 64

DESCRIPTION = f"""\
Run a file of requests in OpenAI's batch format through kvray: one JSON object a line,
  {{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
   "body": {{"messages": [{{"role": "user", "content": "Hi!"}}], "max_tokens": 32}}}}
url: {", ".join(SUPPORTED_URLS)}.
The output has one line per non-blank input line, in input order: the server's answer
(any HTTP status) under "response", or an "error" record for a line that could not be
sent (not JSON, a field missing, an unsupported url, a custom_id used before).

With --base-url the requests go to that running server. Without it, this command starts
kvray here, on the model, engine, replica and network flags below (the built-in demo model
by default), runs the file, and stops it again; those flags are `kvray serve`'s."""

EPILOG = """\
examples:
  kvray run-batch -i requests.jsonl -o results.jsonl --model ./my-checkpoint
  kvray run-batch -i requests.jsonl -o results.jsonl --base-url http://127.0.0.1:8000
  cat requests.jsonl | kvray run-batch -i - -o - --base-url http://gpu-host:8000 > out.jsonl

Guide: docs/batch.md"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    b = parser.add_argument_group("batch")
    b.add_argument(
        "-i", "--input-file", required=True, metavar="FILE", help="requests, JSONL ('-': stdin)"
    )
    b.add_argument(
        "-o",
        "--output-file",
        required=True,
        metavar="FILE",
        help="results, JSONL, written as they complete ('-': stdout)",
    )
    b.add_argument(
        "--base-url",
        metavar="URL",
        help="a running server, e.g. http://127.0.0.1:8000 (default: start kvray here, on the "
        "model flags below, and stop it when done)",
    )
    b.add_argument(
        "--api-key",
        help=f"--base-url's key (default: ${ServeConfig().network.api_key_env}, or the variable "
        "--api-key-env names)",
    )
    b.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help=f"requests in flight at most (default: {DEFAULT_REMOTE_CONCURRENCY} with "
        "--base-url; locally, enough to fill every replica's --max-num-seqs)",
    )
    b.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="retries of a request answered 429 or 503, or whose connection failed "
        "(default %(default)s)",
    )
    b.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="most seconds one request may take (default %(default)s)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.add_argument("--log-level", choices=LOG_LEVELS, default="info", help=LOG_LEVEL_HELP)
    add_config_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = _checked_config(args)
        _check_paths(args.input_file, args.output_file)
        source, total = _open_input(args.input_file)
    except ValueError as err:
        print(f"kvray run-batch: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"kvray run-batch: {args.input_file}: {err.strerror or err}", file=sys.stderr)
        return 1
    try:
        out = _open_output(args.output_file)
    except OSError as err:
        print(f"kvray run-batch: {args.output_file}: {err.strerror or err}", file=sys.stderr)
        if source is not sys.stdin:
            source.close()
        return 1
    levels = console_logging(args.log_level)
    logging.basicConfig(
        level=max(levels.kvray, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvray").setLevel(levels.kvray)
    # SIGTERM stops a run as Ctrl-C does: a local server is shut down either way.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    where = "stdout" if out is sys.stdout else args.output_file
    try:
        # Results own stdout: anything else printed there (Ray's forwarded lines) goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            return _run(args, config, source, total, out, where)
    except KeyboardInterrupt:
        print(
            f"kvray run-batch: interrupted; {where} holds the results of the lines before "
            "the first unfinished one",
            file=sys.stderr,
        )
        return 130
    except OSError as err:  # the output's disk is full, stdin closed, ...
        print(f"kvray run-batch: {err}", file=sys.stderr)
        return 1
    finally:
        if out is not sys.stdout:
            out.close()
        if source is not sys.stdin:
            source.close()


def _run(
    args: argparse.Namespace,
    config: ServeConfig,
    source: TextIO,
    total: int | None,
    out: TextIO,
    where: str,
) -> int:
    with contextlib.ExitStack() as stack:
        if args.base_url:
            base_url, api_key = normalize_base_url(args.base_url), api_key_from(args)
            concurrency = args.max_concurrency or DEFAULT_REMOTE_CONCURRENCY
        else:
            try:
                base_url, api_key = stack.enter_context(local_server(config, args.log_level))
            except RuntimeError as err:
                print(f"kvray run-batch: {err}", file=sys.stderr)
                return 1
            concurrency = args.max_concurrency or local_concurrency(config)
        options = RunOptions(
            base_url=base_url,
            api_key=api_key,
            max_concurrency=concurrency,
            max_retries=args.max_retries,
            timeout_s=args.timeout_s,
            progress=not args.no_progress,
        )
        problem = asyncio.run(check_server(options))
        if problem:
            print(f"kvray run-batch: {problem}", file=sys.stderr)
            return 1
        logger.info(
            "running %s against %s, %d at a time",
            f"{total} request(s)" if total is not None else "the requests",
            base_url,
            concurrency,
        )
        tally = asyncio.run(run_lines(numbered_lines(source), out, options, total))
    print(f"kvray run-batch: {tally.summary()}; results in {where}", file=sys.stderr)
    return 0


def _checked_config(args: argparse.Namespace) -> ServeConfig:
    """The local server's config from the flags; ValueError for a flag that makes no sense."""
    for name in ("max_concurrency", "timeout_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {args.max_retries}")
    config = config_from_flags(args)
    if args.base_url:
        # --api-key-env is the one config flag a remote run uses (it names the key's variable).
        if config.replace(api_key_env=ServeConfig().network.api_key_env) != ServeConfig():
            raise ValueError(
                "the model, engine and replica flags configure a local server: leave them "
                "out with --base-url"
            )
    elif config.network.tls:
        raise ValueError(
            "--tls-cert/--tls-key: the local server listens on 127.0.0.1 only, over plain HTTP"
        )
    return config


def _check_paths(input_file: str, output_file: str) -> None:
    """Writing the output must not truncate the input."""
    if "-" in (input_file, output_file) or not os.path.exists(output_file):
        return
    if os.path.exists(input_file) and os.path.samefile(input_file, output_file):
        raise ValueError(f"{output_file} is the input file too: write the results elsewhere")


def _open_input(path: str) -> tuple[TextIO, int | None]:
    """The input stream and its number of non-blank lines (None for stdin or a pipe: read
    once, as it comes). UTF-8; a byte that is not becomes U+FFFD (its line may then fail to
    parse: an error record, never a crash)."""
    if path == "-":
        _reconfigure(sys.stdin, errors="replace")
        return sys.stdin, None
    if not stat.S_ISREG(os.stat(path).st_mode):
        return open(path, encoding="utf-8", errors="replace"), None  # closed by run()
    with open(path, encoding="utf-8", errors="replace") as f:
        total = count_requests(f)
    return open(path, encoding="utf-8", errors="replace"), total


def _open_output(path: str) -> TextIO:
    if path == "-":
        _reconfigure(sys.stdout)
        return sys.stdout
    return open(path, "w", encoding="utf-8")


def _reconfigure(stream: TextIO, **options: str) -> None:
    """UTF-8 on stdin/stdout whatever the locale (a replaced stream, as in tests, stays)."""
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(encoding="utf-8", **options)


def local_concurrency(config: ServeConfig) -> int:
    """Enough requests in flight to fill every replica's sequence slots (none queue)."""
    replicas = (
        config.autoscaling.max_replicas
        if config.autoscaling.max_replicas is not None
        else config.replicas.num_replicas
    )
    return max(1, replicas * config.engine.max_num_seqs)


@contextlib.contextmanager
def local_server(config: ServeConfig, log_level: str) -> Iterator[tuple[str, str]]:
    """`kvray serve`'s start-up on free ports of 127.0.0.1 with a one-off API key; yields the
    base URL and the key. Leaving it deletes the application and stops Serve and Ray.
    RuntimeError when a port is taken or the application does not start."""
    from cluster.cli import serve as serve_cmd
    from cluster.cli.ports import check_ports
    from cluster.cli.stop_signals import StartInterrupted, StopSignals
    from cluster.deploy.serve_env import apply_serve_env, free_ports

    http_port, grpc_port, metrics_port = free_ports(3)
    # Before anything imports ray.serve: Serve's settings (and free ports for its other
    # listeners) for the Ray instance this process starts.
    apply_serve_env(tls=False, taken=(http_port, grpc_port, metrics_port))
    where = argparse.Namespace(
        host="127.0.0.1",
        port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        address=None,
        log_level=log_level,
    )
    problem = check_ports(serve_cmd.local_listeners(where))
    if problem:
        raise RuntimeError(problem)
    api_key = secrets.token_urlsafe(24)
    # While Ray starts and the app deploys a signal is only recorded (cluster/cli/stop_signals.py);
    # afterwards it interrupts the run as before.
    signals = StopSignals()
    signals.install()
    try:
        try:
            serve_cmd.start(config, where, api_key, uuid.uuid4().hex, signals)
            signals.check()
        except StartInterrupted:
            raise KeyboardInterrupt from None
        except Exception as err:
            raise RuntimeError(f"could not start kvray: {err}") from err
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _raise_interrupt)
        yield f"http://127.0.0.1:{where.port}", api_key
    finally:
        logger.info("stopping the local kvray application, Serve and Ray")
        serve_cmd.shutdown(None, drain_timeout_s=0.0)


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt
