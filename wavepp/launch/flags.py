"""Checks of the flags the pipeline processes (``wavepp stage``, ``admission``, ``gateway``)
share, and the one-line error text of every configuration error.

A bad value raises :class:`ArgError`, whose message names the flag (or environment variable);
the command prints it on one line and exits with its configuration exit code. Environment
variables the operator sets in a pod: ``WAVEPP_RANK`` (the stage rank), ``WAVEPP_PIPELINE``
(the pool), ``WAVEPP_NAMESPACE`` (in every NATS name), ``WAVEPP_METRICS_PORT``.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from pydantic import BaseModel

RANK_ENV = "WAVEPP_RANK"
POOL_ENV = "WAVEPP_PIPELINE"
NAMESPACE_ENV = "WAVEPP_NAMESPACE"  # the pod's namespace (downward API): in every NATS name
METRICS_PORT_ENV = "WAVEPP_METRICS_PORT"
_UNEXPANDED = re.compile(r"^\$\([A-Za-z_][A-Za-z0-9_]*\)$")
ModelT = TypeVar("ModelT", bound="BaseModel")


class ArgError(ValueError):
    """A bad command-line value; the message names the flag."""


class FlagError(Exception):
    """A flag's value a command cannot run with: ``flag`` names it (or the spec, ``--config``;
    or TRACE), the message says why; the command prints ``wavepp CMD: FLAG: MESSAGE`` and
    exits 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def describe_error(exc: BaseException) -> str:
    """One line for ``exc``: pydantic errors as ``field: message; ...`` (no input dumps or
    links), anything else with its whitespace folded."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        parts = []
        for err in errors():
            where = ".".join(str(p) for p in err.get("loc", ())) or "value"
            parts.append(f"{where}: {' '.join(str(err.get('msg', '')).split())}")
        return "; ".join(parts)
    return " ".join(str(exc).split())


def model_from_file(flag: str, path: str, model: type[ModelT]) -> ModelT:
    """The ``model`` (a pydantic model) validated from the JSON file at ``path``, ``flag``'s value.

    Raises:
        ArgError: ``FLAG PATH: why``: the file cannot be read or does not validate.
    """
    try:
        return model.model_validate_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ArgError(f"{flag} {path}: {describe_error(exc)}") from None


def resolve_rank(value: str | None, env: dict[str, str] | os._Environ[str]) -> int:
    """The stage rank from ``--rank`` or, when absent or unexpanded, ``$WAVEPP_RANK``.

    Args:
        value: the ``--rank`` argument: an integer, ``$(WAVEPP_RANK)`` left unexpanded (a pod
            without that variable), or None.
        env: the process environment.

    Returns:
        The rank (not yet checked against the stage count).

    Raises:
        ArgError: neither gives an integer (names the flag and the value).
    """
    if value is not None and not _UNEXPANDED.match(value.strip()):
        source, raw = "--rank", value
    elif env.get(RANK_ENV):
        source, raw = f"${RANK_ENV}", env[RANK_ENV]
    else:
        raise ArgError(f"--rank {value}: give an integer, or set ${RANK_ENV}")
    try:
        return int(raw.strip())
    except ValueError:
        raise ArgError(f"{source} {raw!r}: must be an integer") from None


def check_port(flag: str, port: int | None) -> None:
    """Raise ArgError naming ``flag`` unless ``port`` is None or in [0, 65535] (0: any free)."""
    if port is not None and not 0 <= port <= 65535:
        raise ArgError(f"{flag} {port}: must be in [0, 65535]")


def check_flag(flag: str, value: object, ok: bool, rule: str) -> None:
    """Raise ArgError ``FLAG VALUE: must be RULE`` unless ``ok``."""
    if not ok:
        raise ArgError(f"{flag} {value}: must be {rule}")


def apply_nats_tls(args: argparse.Namespace) -> None:
    """Check the ``--nats-tls-*`` files and export them for ``natsio.connect`` and children.

    Raises:
        ArgError: cert/key without a CA, one of cert/key alone, a missing file, or PEM files
            that do not load (the flag is named).
    """
    from wavepp.runtime.transport.natsio import NatsTLS

    ca, cert, key = args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key
    if ca is None:
        if cert or key:
            raise ArgError("--nats-tls-cert/--nats-tls-key need --nats-tls-ca")
        return
    tls = NatsTLS(ca=ca, cert=cert, key=key)
    try:
        tls.check()
        tls.ssl_context()
    except ValueError as exc:
        raise ArgError(str(exc)) from exc
    except (OSError, ssl.SSLError) as exc:
        raise ArgError(f"--nats-tls-ca/--nats-tls-cert/--nats-tls-key: cannot load: {exc}") from exc
    os.environ.update(tls.to_env())


def check_creds(path: str | None) -> None:
    """Raise ArgError when ``--nats-creds`` names no readable file."""
    if path is not None and not Path(path).is_file():
        raise ArgError(f"--nats-creds {path}: no such file")


def check_port_free(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound now, else one line saying why (port 0 is free).

    A check, not a reservation: another process may still take the port before the server
    binds it; the server then reports the bind error itself.
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"{host}:{port} cannot be bound: {exc.strerror or exc}"
    return None


def positive_ints(flag: str, text: str) -> tuple[int, ...]:
    """The comma-separated integers of ``flag`` (empty items skipped): at least one, each >= 1.

    Raises:
        FlagError: naming ``flag``: an item is not an integer, or none is given, or one is < 1.
    """
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise FlagError(flag, f"{text!r}: need comma-separated integers, e.g. 1,16,128") from None
    if not values or min(values) < 1:
        raise FlagError(flag, f"{text!r}: need integers >= 1")
    return values
