"""What every subcommand shares: the flags of the pipeline processes (``--nats-*``, where a
replica's configuration comes from, ``--model DIR``), the ``--help`` formatter, the exit code of a configuration error, and start-up checks run before anything
starts (a busy port, an unreachable NATS). What the flags resolve to is ``wavepp.launch``'s.

Flag naming scheme (the same meaning has the same name in every subcommand):

| meaning                                   | flag                                         |
| ----------------------------------------- | -------------------------------------------- |
| the message bus                           | ``--nats-url``, ``--nats-creds``, ``--nats-tls-*`` (``--nats-<thing>``) |
| the serving HTTP API (gateway, up)         | ``--host``, ``--port``                       |
| health endpoints (stage, admission)        | ``--health-host``, ``--health-port``         |
| Prometheus ``/metrics``                    | ``--metrics-port``                           |
| a pool's name                              | ``--pool``; a file is ``--<what>-file`` or ``--<what>-config`` (``--pool-file``) |
| requests of one replica in flight          | ``--max-outstanding``                        |
| durations                                  | ``--<what>-s`` (seconds)                     |
| results written by a command               | ``--out`` (a folder; default: a fresh one)   |

Exit codes: 0 done, 1 a failure while running, 2 a usage or configuration error found at start
(one line on stderr naming the flag or field). A process the operator starts has
``$WAVEPP_CONFIG_EXIT_CODE`` = 78 (``wavepp.api.spec.CONFIG_EXIT_CODE``, EX_CONFIG) in its
environment: its configuration errors then exit 78, which the operator reads as "refused its
config" (Degraded/InvalidRuntimeConfig, not restarted); transient start-up failures (a busy
port, an unreachable NATS) stay 2 (:func:`config_exit_code`).

"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

CONFIG_EXIT_CODE_ENV = "WAVEPP_CONFIG_EXIT_CODE"


def config_exit_code(env: Mapping[str, str]) -> int:
    """The exit code of a configuration error: ``$WAVEPP_CONFIG_EXIT_CODE`` when it is an integer
    in [1, 125] (the operator's containers set 78), else 2."""
    try:
        code = int(env.get(CONFIG_EXIT_CODE_ENV, ""))
    except ValueError:
        return 2
    return code if 1 <= code <= 125 else 2


class HelpFormatter(argparse.HelpFormatter):
    """Shows every default once: ``(default: X)`` is appended unless the help already says
    ``default``; a default of None, False or "" is shown only when the help explains it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        hidden = action.default is None or action.default is False or action.default == ""
        if action.option_strings and not hidden:  # not `in (None, False, "")`: 0 == False
            if not (isinstance(action.default, bool) and action.nargs == 0):
                text += " (default: %(default)s)"
        return text


def finite_float(text: str) -> float:
    """argparse ``type`` of every float flag: a finite number (``inf``/``nan`` are refused,
    naming the flag, exit 2, as argparse does for any bad value)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def fail(command: str, flag: str, message: str) -> int:
    """Print ``wavepp COMMAND: FLAG: MESSAGE`` on stderr; returns 2 (a usage error)."""
    print(f"wavepp {command}: {flag}: {message}", file=sys.stderr)
    return 2


def progress_bar(console: Console) -> Progress:
    """The progress bar of a long command on ``console``: the task's description, the bar,
    done of total and the time elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def fresh_out_dir(prefix: str) -> str:
    """A new, empty folder under the system's temporary directory (``wavepp-<prefix>-XXXX``)."""
    return tempfile.mkdtemp(prefix=f"wavepp-{prefix}-")


def check_nats_reachable(url: str, timeout_s: float = 30.0) -> str | None:
    """None once a TCP connection to some server of ``url`` opens, trying every 0.2 s for
    ``timeout_s`` seconds (a server that starts later is waited for); else one line naming the
    URL and why (a comma-separated list: any one reachable is enough)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reasons = []
        for one in url.split(","):
            one = one.strip()
            parsed = urlparse(one if "://" in one else f"nats://{one}")
            host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
            try:
                with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                    return None
            except OSError as exc:
                reasons.append(f"{host}:{port}: {exc.strerror or exc}")
        if time.monotonic() >= deadline:
            return f"{url}: no NATS server reachable in {timeout_s:g} s ({'; '.join(reasons)})"
        time.sleep(0.2)


def startup_failure(
    nats_url: str, nats_timeout_s: float, ports: Sequence[tuple[str, str, int | None]] = ()
) -> str | None:
    """Why a pod command cannot start although its configuration is good (it exits 2; the
    operator restarts the pod): the first of ``ports`` ``(flag, host, port)`` that cannot be
    bound (:func:`check_port_free`; a port None: nothing to bind), or else no NATS server of
    ``nats_url`` answered within ``nats_timeout_s`` seconds (:func:`check_nats_reachable`).
    None: neither."""
    from wavepp.launch.flags import check_port_free

    for flag, host, port in ports:
        if port is not None:
            busy = check_port_free(host, port)
            if busy:
                return f"{flag}: {busy}"
    unreachable = check_nats_reachable(nats_url, nats_timeout_s)
    return f"--nats-url {unreachable}" if unreachable else None


def add_nats_wait_arg(parser: argparse.ArgumentParser) -> None:
    """``--nats-connect-timeout-s``: how long a pod command waits for NATS before exit 2."""
    parser.add_argument(
        "--nats-connect-timeout-s",
        type=float,
        default=30.0,
        help="wait this long for the NATS server to accept connections, then exit 2",
    )


def add_replica_config_args(parser: argparse.ArgumentParser, *, runtime_config_help: str) -> None:
    """Where a replica's RuntimeConfig comes from (read by ``runtime_config_from_args``):
    ``--runtime-config F`` or ``--config SPEC --replica I``, and ``--model DIR``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--runtime-config", help=runtime_config_help)
    source.add_argument(
        "--config", help="WavePipeline spec (YAML/JSON, e.g. /etc/wavepp/spec.json); with --replica"
    )
    parser.add_argument("--replica", type=int, default=None, help="replica index (with --config)")
    add_model_dir_arg(parser)


def add_nats_args(
    parser: argparse.ArgumentParser, *, url_help: str = "NATS server URL (with JetStream)"
) -> None:
    """``--nats-url`` (required), ``--nats-creds``, ``--nats-tls-*`` and the connect wait."""
    parser.add_argument("--nats-url", required=True, help=url_help)
    parser.add_argument("--nats-creds", default=None, help="NATS credentials file (.creds)")
    add_nats_tls_args(parser)
    add_nats_wait_arg(parser)


def add_model_dir_arg(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``: serve the Hugging Face checkpoint in DIR (overrides the config's model)."""
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="Hugging Face checkpoint directory (config.json + safetensors): the model and "
        "RuntimeConfig.model_dir, overriding the configuration's model",
    )


def add_nats_tls_args(parser: argparse.ArgumentParser) -> None:
    """``--nats-tls-ca/--nats-tls-cert/--nats-tls-key`` (PEM files; see ``NatsTLS``)."""
    parser.add_argument(
        "--nats-tls-ca", default=None, help="CA of the NATS server's certificate: connect over TLS"
    )
    parser.add_argument("--nats-tls-cert", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--nats-tls-key", default=None, help="client key (mutual TLS)")
