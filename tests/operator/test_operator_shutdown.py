"""The operator's shutdown: a reconcile daemon that kopf has not stopped yet when the cleanup
handler closed the API client ends quietly (once seen under load: three 'unexpected error
reconciling ... the client has been closed' and a failed e2e test)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import kopf

from wavepp.operator.handlers import OperatorOptions, OperatorState, cleanup, pipeline_daemon


class ClosedClient:
    """What lightkube's client does once closed: every request raises."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Cannot send a request, as the client has been closed.")


class NeverStopped:
    def __bool__(self) -> bool:
        return False

    async def wait(self, timeout: float | None = None) -> None:  # pragma: no cover - not reached
        return None


async def test_a_daemon_after_cleanup_ends_quietly() -> None:
    client = ClosedClient()
    state = OperatorState(OperatorOptions(), client=client)  # type: ignore[arg-type]
    memo = SimpleNamespace(state=state)
    await cleanup(memo=memo)
    assert client.closed and state.closing
    await pipeline_daemon(
        name="p",
        namespace="ns",
        memo=memo,
        stopped=NeverStopped(),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
    )
    assert state.unexpected_errors == []


async def test_a_daemon_whose_client_fails_while_running_still_retries() -> None:
    state = OperatorState(OperatorOptions(), client=ClosedClient())  # type: ignore[arg-type]
    memo = SimpleNamespace(state=state)
    try:
        await pipeline_daemon(
            name="p",
            namespace="ns",
            memo=memo,
            stopped=NeverStopped(),  # type: ignore[arg-type]
            logger=logging.getLogger("test"),
        )
    except kopf.TemporaryError as exc:
        assert "retrying" in str(exc)
    else:  # pragma: no cover - the assertion below names the failure
        raise AssertionError("a failing pass must raise kopf.TemporaryError (kopf retries it)")
    assert len(state.unexpected_errors) == 1
