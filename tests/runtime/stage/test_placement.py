"""Stage placement (``runtime.stage.placement``): each stage's share of a launcher's cores,
``--cores`` parsing, and the pin a stage process applies to itself (and its later threads);
``LocalPipeline`` hands its stages their shares with ``pin_cores``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.model_config import ModelConfig
from wavepp.runtime.serving.local import LocalPipeline
from wavepp.runtime.stage.placement import (
    launcher_cores,
    parse_cores,
    pin_to,
    stage_cores,
)


def test_each_stage_gets_a_disjoint_contiguous_equal_share() -> None:
    assert [stage_cores(range(8), 2, i) for i in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # ids in ascending order whatever the order given; the remainder goes to nobody
    assert [stage_cores([6, 2, 4, 0, 9], 2, i) for i in range(2)] == [(0, 2), (4, 6)]
    assert stage_cores([3], 1, 0) == (3,)
    with pytest.raises(ValueError, match="index=2"):
        stage_cores(range(4), 2, 2)
    with pytest.raises(ValueError, match=r"engineOptions.pinCores: 3 stages on 2 cores"):
        stage_cores([0, 1], 3, 2)
    with pytest.raises(ValueError, match="num_stages=0"):
        stage_cores(range(4), 0, 0)


def test_cores_flag_is_parsed_and_bad_values_name_it() -> None:
    assert parse_cores("0,3,1") == (0, 3, 1)
    for bad in ("", "a", "1,,2", "-1", "2,2"):
        with pytest.raises(ValueError, match="--cores"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="--cores 1000000: not cores this process may use"):
        pin_to([1_000_000])


def test_a_core_outside_the_affinity_is_refused_even_beside_allowed_ones() -> None:
    """The kernel keeps the allowed part of a mask and drops the rest without a word: a stage
    given ``--cores 0,99`` on a 2-core host would run on core 0 alone."""
    allowed = launcher_cores()
    outside = max(allowed) + 1
    code = (
        "import os\n"
        "from wavepp.runtime.stage.placement import pin_to\n"
        f"pin_to([{allowed[0]}, {outside}])\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ
    )
    assert done.returncode != 0, f"pinned to {done.stdout.strip()}, {outside} dropped silently"
    assert f"--cores {allowed[0]},{outside}: not cores this process may use ({outside};" in (
        done.stderr
    )


def test_a_pinned_process_and_the_threads_it_starts_run_on_its_cores_only() -> None:
    core = min(launcher_cores())
    code = (
        "import os, threading\n"
        "from wavepp.runtime.stage.placement import pin_to\n"
        f"pin_to([{core}])\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), seen[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout.split("\n")[0]
    assert out == f"[{core}] [{core}]"


@pytest.mark.parametrize("pin", [False, True])
def test_local_pipeline_hands_each_stage_its_share_with_pin_cores(pin: bool, tmp_path) -> None:  # noqa: ANN001
    from wavepp.cli import build_parser
    from wavepp.runtime.planning import CostModel

    model = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2)
    config = RuntimeConfig(model=model, num_stages=2, pin_cores=pin)
    pipeline = LocalPipeline(
        config, CostModel(c=1e-3, g=0.0, b=1e-5, a=0.0), nats_url="nats://x", log_dir=str(tmp_path)
    )
    for rank in range(2):
        argv = pipeline.stage_command(rank, "tcp://127.0.0.1:1")[3:]
        parsed = build_parser(argv[:1]).parse_args(argv)
        share = stage_cores(launcher_cores(), 2, rank) if pin else None
        assert parsed.cores == (None if share is None else ",".join(map(str, share)))
