"""HTTP from tests to the processes they started: a status probe and a JSON POST (stdlib)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_status(url: str) -> int:
    """The status of a GET of ``url`` within 1 s; 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def post_json(
    url: str, body: dict[str, Any], timeout_s: float = 30.0
) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; the status and the JSON answer (an error's body too, {} if none)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
