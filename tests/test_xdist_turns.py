"""The turns of the suite's pytest-xdist workers (tests/support/xdist_turns.py), in a real run
of three workers on a small suite of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"

# Three files, three workers, --dist loadfile: one file each. a's worker finishes first; b's
# test runs (holding its turn shared) until c's serial test asks for its turn after a's worker
# ended; the serial test must wait for b's.
SUITE = {
    "test_a.py": """
        import os, pathlib
        def test_finishes_first():
            (pathlib.Path(os.environ["TURNS_DIR"]) / "a-done").touch()
    """,
    "test_b.py": """
        import json, os, pathlib, time
        def test_holds_a_shared_turn():
            out = pathlib.Path(os.environ["TURNS_DIR"])
            start = time.time()
            (out / "b-started").touch()
            deadline = time.monotonic() + 60
            while not (out / "c-asking").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2.0)  # c's serial test asks meanwhile
            (out / "b.json").write_text(json.dumps([start, time.time()]))
    """,
    "test_c.py": """
        import json, os, pathlib, time
        import pytest
        def test_waits_for_a_to_finish_and_b_to_start():
            out = pathlib.Path(os.environ["TURNS_DIR"])
            deadline = time.monotonic() + 60
            while not ((out / "a-done").exists() and (out / "b-started").exists()):
                assert time.monotonic() < deadline, "a and b never ran"
                time.sleep(0.05)
            time.sleep(1.0)  # a's worker ends its session
            (out / "c-asking").touch()
        @pytest.mark.serial
        def test_serial():
            out = pathlib.Path(os.environ["TURNS_DIR"])
            (out / "c.json").write_text(json.dumps([time.time(), time.time()]))
    """,
}


def test_a_serial_test_waits_for_a_running_one_after_another_worker_finished(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: wall time\n")
    for name, text in SUITE.items():
        (suite / name).write_text(textwrap.dedent(text))
    env = {
        **os.environ,
        "PYTHONPATH": str(SUPPORT),
        "TURNS_DIR": str(tmp_path),
        "TMPDIR": str(tmp_path),  # where the run's lock files live
    }
    run_id = "turns-test"
    args = [sys.executable, "-m", "pytest", "-p", "xdist_turns", "-n", "3", "--dist", "loadfile"]
    args += ["-p", "no:cacheprovider", "-q", "--testrunuid", run_id]
    result = subprocess.run(args, cwd=suite, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    b_start, b_end = json.loads((tmp_path / "b.json").read_text())
    c_start, _ = json.loads((tmp_path / "c.json").read_text())
    assert c_start >= b_end, (b_start, b_end, c_start)  # the serial test waited for b's
    # The controller removed the lock files once every worker had ended.
    assert not list(tmp_path.glob(f"wavepp-pytest-{run_id}*"))
