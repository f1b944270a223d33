"""Where a process finds the bus key (``wavepp.api.signing``): its environment.

    WAVEPP_BUS_KEY        the key as hex (>= 32 hex digits); ``wavepp up`` sets it for its
                          children, generated at start
    WAVEPP_BUS_KEY_FILE   a file holding the hex key (a mounted Kubernetes Secret)

Neither set: no key, messages go unsigned and unchecked (``load_bus_key`` logs a warning once per
process). Both set: ``WAVEPP_BUS_KEY`` wins.
"""

from __future__ import annotations

import logging
import os

from wavepp.api.signing import BusKey

log = logging.getLogger(__name__)

BUS_KEY_ENV = "WAVEPP_BUS_KEY"
BUS_KEY_FILE_ENV = "WAVEPP_BUS_KEY_FILE"

_warned = False


class BusKeyError(ValueError):
    """A bus key that is set but unusable (one line naming the variable and the fault)."""


def load_bus_key(environ: dict[str, str] | None = None) -> BusKey | None:
    """The deployment's bus key from the environment; None (warned once) when there is none.

    Raises:
        BusKeyError: the variable is set but not hex, too short, or its file is unreadable.
    """
    global _warned
    env = os.environ if environ is None else environ
    text = env.get(BUS_KEY_ENV, "")
    source = BUS_KEY_ENV
    path = env.get(BUS_KEY_FILE_ENV, "")
    if not text and path:
        source = f"{BUS_KEY_FILE_ENV}={path}"
        try:
            with open(path, encoding="ascii") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise BusKeyError(f"{source}: cannot read the bus key: {exc}") from exc
    if not text:
        if not _warned:
            log.warning(
                "no bus key (%s / %s unset): messages on the bus are neither signed nor checked; "
                "any client of the NATS server can forge plans, done messages and results",
                BUS_KEY_ENV,
                BUS_KEY_FILE_ENV,
            )
            _warned = True
        return None
    try:
        return BusKey.from_hex(text)
    except ValueError as exc:
        raise BusKeyError(f"{source}: {exc} (want >= 32 hex digits)") from exc


def bus_key_or_new() -> BusKey:
    """The key from the environment, or a new one (nothing is changed or warned)."""
    if os.environ.get(BUS_KEY_ENV) or os.environ.get(BUS_KEY_FILE_ENV):
        key = load_bus_key()
        if key is not None:
            return key
    return BusKey.generate()


def ensure_bus_key() -> BusKey:
    """The key from the environment, or a new one put there (so that children inherit it):
    what ``wavepp up`` calls before it starts its processes (no warning: a key is made)."""
    key = None
    if os.environ.get(BUS_KEY_ENV) or os.environ.get(BUS_KEY_FILE_ENV):
        key = load_bus_key()
    if key is None:
        key = BusKey.generate()
        os.environ[BUS_KEY_ENV] = key.hex()
    return key
