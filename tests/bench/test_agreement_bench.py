"""Admission cadence microbenchmark over a real nats-server (small)."""

from __future__ import annotations

import pytest

from wavepp.bench.agreement import AgreementSetting, format_table, run_agreement_bench


async def test_agreement_bench_measures_each_setting() -> None:
    settings = [
        AgreementSetting(1, 1),
        AgreementSetting(3, 4, batch_limit=2),
        AgreementSetting(2, 4, replicas=2, workload="short-suffix"),
    ]
    results = await run_agreement_bench(
        settings, num_requests=12, num_prompt_tokens=256, suffix_tokens=32, block_size=16
    )
    assert [(r["stages"], r["in_flight"], r["replicas"]) for r in results] == [
        (1, 1, 1),
        (3, 4, 1),
        (2, 4, 2),
    ]
    for r in results:
        assert r["agreements_per_s"] > 0
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert len(r["replica_p99_ms"]) == r["replicas"]
        assert r["cpu_us_per_agreement"] > 0
        # in-process stages: their round handlers' CPU is split out of this process's
        assert r["cpu_us_split"]["stages"] > 0 and r["cpu_us_split"]["controller"] > 0
    assert results[0]["mean_agreed_blocks"] == 0  # mixed: nothing cached beforehand
    assert results[2]["mean_agreed_blocks"] == (256 - 32) // 16
    assert results[0]["rounds"] == 12  # one at a time: one request per round
    assert results[1]["rounds"] >= 6  # at most 2 per round
    table = format_table(results)
    assert table.count("\n") == 4 and "short-suffix" in table


async def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="workload"):
        await run_agreement_bench([AgreementSetting(1, 1, workload="nope")])
    with pytest.raises(ValueError, match="suffix_tokens"):
        await run_agreement_bench([AgreementSetting(1, 1)], num_prompt_tokens=8, suffix_tokens=9)


async def test_stage_kv_servers_can_run_in_processes_of_their_own() -> None:
    """``stage_processes``: each stage KV server a spawned process (as in production); its CPU
    is counted, the short-suffix prefixes are cached there (L* covers them), and every process
    is gone after."""
    import multiprocessing

    [row] = await run_agreement_bench(
        [AgreementSetting(2, 4, workload="short-suffix", stage_processes=True)],
        num_requests=16,
        num_prompt_tokens=256,
        suffix_tokens=32,
        block_size=16,
    )
    assert row["stage_processes"] is True and row["agreements_per_s"] > 0
    assert row["cpu_us_split"]["stages"] >= 0  # /proc ticks (10 ms): 0 for so short a run
    assert row["mean_agreed_blocks"] == (256 - 32) // 16  # each prompt's shared prefix, cached
    assert row["cpu_us_per_agreement"] >= row["cpu_us_split"]["controller"]
    assert not multiprocessing.active_children()


async def test_the_run_is_a_steady_state_that_releases_what_it_admitted() -> None:
    """``held_requests``: each replica keeps the latest admitted requests (as requests in
    prefill) and releases older ones in batches: a stage ends holding exactly that many."""
    rows = await run_agreement_bench(
        [
            AgreementSetting(2, 4, workload="short-suffix", held_requests=5),
            AgreementSetting(2, 4, workload="short-suffix", held_requests=0),
        ],
        num_requests=40,
        num_prompt_tokens=256,
        suffix_tokens=32,
        block_size=16,
    )
    assert [r["held_at_end"] for r in rows] == [5, 0]


@pytest.mark.parametrize(("per_stage", "connections"), [(False, 2), (True, 4)])
async def test_the_stages_of_a_process_share_one_connection_unless_asked(
    per_stage: bool, connections: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process stages share one NATS connection (the controller has its own); with
    ``connection_per_stage`` each stage has its own, as before."""
    import wavepp.bench.agreement as agreement

    names: list[str] = []
    connect = agreement.connect

    async def counting_connect(url: str, **kwargs: object) -> object:
        names.append(str(kwargs.get("name")))
        return await connect(url, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(agreement, "connect", counting_connect)
    [row] = await run_agreement_bench(
        [AgreementSetting(3, 2, workload="short-suffix", connection_per_stage=per_stage)],
        num_requests=6,
        num_prompt_tokens=128,
        suffix_tokens=32,
        block_size=16,
    )
    assert len(names) == connections, names
    assert row["connection_per_stage"] is per_stage
    assert row["mean_agreed_blocks"] == (128 - 32) // 16  # every stage answered


async def test_stage_hosts_serve_the_ranks_not_kept_in_this_process() -> None:
    """``stage_hosts`` processes share the ranks from ``stages_in_process`` on; the rest stay
    beside the controller. L* covers the cached prefix on both kinds of stage."""
    import multiprocessing

    [row] = await run_agreement_bench(
        [AgreementSetting(3, 4, workload="short-suffix", stage_hosts=1, stages_in_process=1)],
        num_requests=16,
        num_prompt_tokens=256,
        suffix_tokens=32,
        block_size=16,
    )
    assert row["stage_hosts"] == [[1, 2]]
    assert row["mean_agreed_blocks"] == (256 - 32) // 16
    assert row["held_at_end"] == 16  # fewer requests than held_requests: none released yet
    assert "| 1-2 |" in format_table([row])
    assert not multiprocessing.active_children()


def test_one_stage_host_takes_the_upper_half_of_the_ranks_by_default() -> None:
    from wavepp.bench.agreement import _stage_layout

    assert _stage_layout(AgreementSetting(8, 1, stage_hosts=1)) == [[4, 5, 6, 7]]
    assert _stage_layout(AgreementSetting(3, 1, stage_hosts=2)) == [[1], [2]]
    assert _stage_layout(AgreementSetting(4, 1, stage_hosts=1, stages_in_process=0)) == [
        [0, 1, 2, 3]
    ]
    assert _stage_layout(AgreementSetting(4, 1, stage_hosts=1, stages_in_process=9)) == []
    assert _stage_layout(AgreementSetting(4, 1)) == []  # no hosts: all in this process
    assert _stage_layout(AgreementSetting(2, 1, stage_processes=True)) == [[0], [1]]


async def test_bad_layout_and_held_settings_name_the_field() -> None:
    for field in ("stage_hosts", "stages_in_process", "held_requests"):
        with pytest.raises(ValueError, match=field):
            await run_agreement_bench([AgreementSetting(1, 1, **{field: -1})])


@pytest.mark.parametrize("flag", ["--stage-hosts", "--stages-in-process", "--held"])
def test_cli_refuses_a_negative_layout_or_held_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from wavepp import cli

    assert cli.main(["bench", "agreement", flag, "-1"]) == 2
    assert f"{flag}: -1: must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--stage-hosts", "1", "--stage-processes"], "--stage-hosts: not with --stage-processes"),
        (["--stages-in-process", "2"], "--stages-in-process: needs --stage-hosts"),
        (["--stage-hosts", "0", "--stages-in-process", "2"], "--stages-in-process: needs"),
        (
            ["--connection-per-stage", "--stage-processes"],
            "--connection-per-stage: not with --stage-processes",
        ),
    ],
)
def test_cli_refuses_a_layout_flag_it_would_ignore(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from wavepp import cli

    assert cli.main(["bench", "agreement", "--stages", "2", "--requests", "1", *flags]) == 2
    assert named in capsys.readouterr().err


async def test_open_loop_arrivals_do_not_wait_for_answers() -> None:
    """``rate``: requests arrive as a Poisson process and are agreed at once, however many are
    outstanding: far past what the stages answer, most are outstanding together, and rounds
    (at most one in flight) batch them; every one is agreed and, with nothing held, released."""
    [fast, slow] = await run_agreement_bench(
        [
            AgreementSetting(
                2, 1, workload="short-suffix", rate=1e6, rounds_in_flight=1, held_requests=0
            ),  # fmt: skip
            AgreementSetting(2, 1, workload="short-suffix", rate=500.0),
        ],
        num_requests=30,
        num_prompt_tokens=256,
        suffix_tokens=32,
        block_size=16,
    )
    assert fast["in_flight"] is None and fast["offered_per_s"] == 1e6
    assert fast["max_outstanding"] >= 20  # all arrived within ~30 us: a closed loop of 1 has 1
    assert fast["rounds"] < 10 and fast["rounds_in_flight"] == 1
    assert fast["held_at_end"] == 0 and fast["mean_agreed_blocks"] == (256 - 32) // 16
    # 30 arrivals at 500/s take ~60 ms: the rate, not the stages, bounds the run
    assert slow["agreements_per_s"] < 2000 and slow["max_outstanding"] >= 1
    assert "open 1e+06/s" in format_table([fast]) and "open 500/s" in format_table([slow])


async def test_a_rate_or_rounds_limit_out_of_range_names_the_field() -> None:
    with pytest.raises(ValueError, match="rate"):
        await run_agreement_bench([AgreementSetting(1, 1, rate=0.0)])
    with pytest.raises(ValueError, match="rounds_in_flight"):
        await run_agreement_bench([AgreementSetting(1, 1, rounds_in_flight=0)])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rate", "100", "--concurrency", "4"], "--rate: not with --concurrency"),
        (["--rate", "0"], "--rate: '0': need numbers > 0"),
        (["--rate", "fast"], "--rate: 'fast': need numbers > 0"),
        (["--rounds-in-flight", "0"], "--rounds-in-flight: '0': need integers >= 1"),
    ],
)
def test_cli_refuses_a_bad_open_loop_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from wavepp import cli

    assert cli.main(["bench", "agreement", "--stages", "2", "--requests", "1", *flags]) == 2
    assert named in capsys.readouterr().err
