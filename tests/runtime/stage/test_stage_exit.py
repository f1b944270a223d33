"""A stage process's event loop ends without waiting for threads still blocked in a call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from wavepp.runtime.stage.process import TensorParallelLost, run_leaving_threads, stage_exit_code


def _in_thread(target, timeout_s: float) -> bool:  # noqa: ANN001 - a no-argument callable
    """Whether ``target()`` returned within ``timeout_s`` (run in a daemon thread)."""
    done = threading.Event()

    def run() -> None:
        try:
            target()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def test_returns_while_a_to_thread_call_is_still_blocked() -> None:
    # A group formation or collective stuck on a dead peer: the loop must not join it.
    blocked = threading.Event()
    release = threading.Event()
    tasks_cancelled = []

    async def main() -> None:
        async def waits() -> None:
            try:
                await asyncio.to_thread(lambda: (blocked.set(), release.wait(60)))
            except asyncio.CancelledError:
                tasks_cancelled.append(True)
                raise

        asyncio.get_running_loop().create_task(waits())
        while not blocked.is_set():
            await asyncio.sleep(0.01)

    try:
        assert _in_thread(lambda: run_leaving_threads(main()), 10.0)
        assert tasks_cancelled == [True]  # the task left behind was cancelled, not abandoned
    finally:
        release.set()


def test_asyncio_run_would_have_waited_for_it() -> None:
    # What the test above guards against: asyncio.run joins the executor's threads.
    release = threading.Event()

    async def main() -> None:
        asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        await asyncio.sleep(0)

    try:
        assert not _in_thread(lambda: asyncio.run(main()), 1.0)
    finally:
        release.set()


def test_what_main_raised_is_raised() -> None:
    async def main() -> None:
        raise RuntimeError("stage failed")

    with pytest.raises(RuntimeError, match="stage failed"):
        run_leaving_threads(main())


def test_the_exit_code_of_each_way_main_ends(capsys) -> None:  # noqa: ANN001
    """0 for a return or a KeyboardInterrupt; 1 for a lost TP follower and for any other
    exception, which does not propagate (the caller's os._exit must run, or interpreter exit
    joins blocked threads) and leaves its traceback on stderr."""

    async def returns() -> None:
        return None

    async def interrupted() -> None:
        raise KeyboardInterrupt

    async def tp_lost() -> None:
        raise TensorParallelLost("follower 1 exited")

    async def fails() -> None:
        raise RuntimeError("serve failed")

    assert stage_exit_code(returns()) == 0
    assert stage_exit_code(interrupted()) == 0
    assert stage_exit_code(tp_lost()) == 1
    assert "wavepp stage: follower 1 exited" in capsys.readouterr().err
    assert stage_exit_code(fails()) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: serve failed" in err
