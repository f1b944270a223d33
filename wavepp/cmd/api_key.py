"""``wavepp api-key``: make a new API key for a tenant and store only its hash.

Prints the new key once on stdout (give it to the tenant; it is not kept anywhere) and appends
its ``sha256:`` line to ``--append FILE`` (a tenant's ``apiKeysFile`` for ``wavepp up``, or the
``keys`` entry of its ``apiKeySecret``). ``--not-after TIME`` on an existing key's line is how a
rotation ends the old key; ``--expire-others-after SECONDS`` does it here: every other key in the
file without a ``not-after`` gets ``now + SECONDS`` (the rotation window). Format:
``wavepp.gateway.auth``.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

KEY_PREFIX = "wpp-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--append", default=None, help="key file to append the new key's sha256 line to"
    )
    parser.add_argument(
        "--expire-others-after",
        type=float,
        default=None,
        help="rotation: give the file's other keys not-after = now + SECONDS",
    )


def new_key() -> str:
    """A new random API key (256 bits, URL-safe)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def rotate(path: Path, key: str, expire_others_after_s: float | None, now: datetime) -> None:
    """Append ``key``'s hash line to ``path``; with ``expire_others_after_s``, end the others.

    Raises:
        KeyFileError: the file (with the new key) would not load (e.g. three valid keys).
    """
    from wavepp.gateway.auth import key_line, parse_key_file

    lines = path.read_text().splitlines() if path.exists() else []
    if expire_others_after_s is not None:
        until = now + timedelta(seconds=expire_others_after_s)
        until_text = until.isoformat().replace("+00:00", "Z")
        lines = [
            f"{line} not-after={until_text}"
            if line.strip() and not line.lstrip().startswith("#") and "not-after=" not in line
            else line
            for line in lines
        ]
    lines.append(key_line(key))
    text = "\n".join(lines) + "\n"
    parse_key_file(text, path.stem, now_s=now.timestamp())
    path.parent.mkdir(parents=True, exist_ok=True)  # e.g. examples/keys/ (git ignores it)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # one rename: the gateway never reads half a file


def run(args: argparse.Namespace) -> int:
    from wavepp.gateway.auth import KeyFileError

    if args.expire_others_after is not None and (
        args.append is None or args.expire_others_after < 0
    ):
        print(
            "wavepp api-key: --expire-others-after: needs --append and SECONDS >= 0",
            file=sys.stderr,
        )
        return 2
    key = new_key()
    if args.append:
        try:
            rotate(Path(args.append), key, args.expire_others_after, datetime.now(UTC))
        except (OSError, KeyFileError) as exc:
            print(f"wavepp api-key: --append {args.append}: {exc}", file=sys.stderr)
            return 2
    print(key)
    return 0
