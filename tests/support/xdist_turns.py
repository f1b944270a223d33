"""Turns for the suite's pytest-xdist workers (a pytest plugin: tests/conftest.py loads it).

A test marked ``serial`` (its assertions measure wall time: another worker's load would be
noise in them) runs while no other worker of the run runs a test. The lock is a readers-writer
lock over two files in the temporary directory, named by the run's id (xdist's testrunuid, the
same in every worker of one run): every test holds ``room`` shared, a serial one exclusive.

Invariant: the lock files exist for the whole run. A worker that finished must not remove
them: another still holding ``room`` would hold a lock on a removed file, and a third would
make a new file and take it exclusive at once, beside the holder. The controller fixes the run's
id and removes the files once every worker has exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"  # set by xdist in each worker
SUFFIXES = (".gate", ".room")


def lock_base(run_id: str) -> Path:
    """Where the lock files of the run ``run_id`` live (suffixes ``SUFFIXES``)."""
    return Path(tempfile.gettempdir()) / f"wavepp-pytest-{run_id}"


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a") as file:
        fcntl.flock(file, mode)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@contextlib.contextmanager
def turn(run_id: str, exclusive: bool) -> Iterator[None]:
    """Hold ``room`` shared, or exclusive when ``exclusive``, among the holders of ``run_id``.
    Each first passes ``gate``, which an exclusive holder keeps until it has the room: once one
    waits, no new shared holder starts (it is not starved). Blocks until granted."""
    base = lock_base(run_id)
    with contextlib.ExitStack() as stack:
        with _flock(base.with_suffix(".gate"), fcntl.LOCK_EX):
            stack.enter_context(
                _flock(base.with_suffix(".room"), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            )
        yield


def remove_locks(run_id: str) -> None:
    """Remove the run's lock files (once no worker of the run runs any more)."""
    for suffix in SUFFIXES:
        lock_base(run_id).with_suffix(suffix).unlink(missing_ok=True)


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    """The controller fixes the run's id (xdist's ``--testrunuid``, which its workers get) so
    that it can remove the lock files at the end."""
    if _is_controller(config) and getattr(config.option, "testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller ends after every worker: the run's lock files go."""
    run_id = getattr(config.option, "testrunuid", None)
    if _is_controller(config) and run_id:
        remove_locks(run_id)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return (yield)
    with turn(run_id, item.get_closest_marker("serial") is not None):
        return (yield)
