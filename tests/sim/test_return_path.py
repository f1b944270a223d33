"""At small C the closed loop loses its return path once per round, and nothing else.

MiniMax-M2.7, high reuse, C = S or 2S: the in-flight work is S micro-batches of C / S requests
each, and a micro-batch's fixed cost c (16.3 ms at PP4, 8.6 ms at PP8) is larger than the return
path, so neither splitting a request (one more c per round on every stage) nor packing more
requests into fewer micro-batches (a longer crossing) shortens a round. A request's successor
arrives only after its last stage finished, so a round lasts the crossing of S micro-batches plus

    return path = (S - 1) hops + done on the bus + the successor's agreement round trip
                  + the scheduler's host time + the plan on the bus + stage 0's preparation

and every stage's idle time over the run is exactly (S - 1) micro-batches of fill and drain plus
one return path per round. Anything the scheduler adds (an under-full wait that runs to its
deadline, a returning group planned split, a slot freed late) shows up as idle beyond that.
Without speculative planning these cells measure 0.943-0.949 of the bound: the return path,
not a scheduling fault. With it (``RuntimeConfig.speculative_planning``, the default; the
scheduler plans the successor's micro-batch from its predicted L* while the agreement's round
trip is under way, and publishes it when the reply matches), the host time runs during the round
trip instead of after it, so the two terms become max(round trip, host time): 1.65 ms instead of
2.65 ms per round here (0.951-0.958 of the bound, docs/bench/simulator.md).
"""

from __future__ import annotations

import pytest

from wavepp.bench.grid import GridSpec, Setting
from wavepp.bench.workloads import preset_workload
from wavepp.launch.grid import runtime_config
from wavepp.sim.bus import SimLatencies
from wavepp.sim.run import simulate

# The simulator's measured latencies (``wavepp sim``): KV round trip 1 ms, bus 0.5 ms, hop 0.2 ms,
# preparation 0.2 ms, host time 1.65 ms per micro-batch.
MEASURED = SimLatencies(
    kv_rtt_s=1e-3, bus_latency_s=5e-4, hop_s=2e-4, prepare_s=2e-4, schedule_s=1.65e-3
)
ROUNDS = 8


def _return_path_s(num_stages: int, lat: SimLatencies, *, speculative: bool) -> float:
    if speculative:
        # The plan is built from the predicted L* as the agreement starts; it goes out once
        # both the reply is in and the host time is spent.
        agreement_and_plan_s = max(lat.kv_rtt_s, lat.schedule_s)
    else:
        # The successor's agreement (one round trip), then the host time before the plan.
        agreement_and_plan_s = lat.kv_rtt_s + lat.schedule_s
    return (
        (num_stages - 1) * lat.hop_s
        + lat.bus_latency_s  # the last stage's done
        + agreement_and_plan_s
        + lat.bus_latency_s  # the plan
        + lat.prepare_s  # stage 0 prepares it (nothing else to run meanwhile)
    )


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plan-after-reply"])
@pytest.mark.parametrize(("num_stages", "concurrency"), [(4, 4), (8, 8), (8, 16)])
def test_small_c_idles_only_the_return_path_once_per_round(
    num_stages: int, concurrency: int, speculative: bool
) -> None:
    spec = GridSpec(time_scale=1.0, num_stages=num_stages)
    config, planner_cost = runtime_config(
        spec, Setting("minimax-m2.7", concurrency, "high", "wave")
    )
    config = config.model_copy(update={"speculative_planning": speculative})
    workload = preset_workload("high", ROUNDS * concurrency, vocab_size=config.model.vocab_size)
    report = simulate(config, planner_cost, workload, concurrency=concurrency, latencies=MEASURED)
    summary = report.summary()
    assert summary["failed"] == 0
    # S micro-batches per round, each C / S whole requests (none split, none travelling alone).
    assert summary["microbatches"] == ROUNDS * num_stages
    assert set(report.stats.microbatch_tokens) == {summary["new_tokens"] // summary["microbatches"]}
    if speculative:
        # Every round's plan but the first's (the pipeline fills from an empty planning set)
        # came from a speculation whose prediction held.
        assert report.stats.num_speculations_discarded == 0
        assert report.stats.num_speculative_plans >= summary["microbatches"] - num_stages
    else:
        assert report.stats.num_speculative_plans == 0
    path_s = _return_path_s(num_stages, MEASURED, speculative=speculative)
    for rank, busy_s in enumerate(report.stats.busy_s_by_stage(num_stages)):
        microbatch_s = busy_s / summary["microbatches"]
        idle_s = report.wall_s - busy_s
        extra_per_round_s = (idle_s - (num_stages - 1) * microbatch_s) / ROUNDS
        assert extra_per_round_s == pytest.approx(path_s, abs=5e-5), (rank, extra_per_round_s)
