"""A served replica's closed-loop target counts the way back of a round's requests
(``engineOptions.returnMicrobatches``, default ``SERVED_RETURN_MICROBATCHES``): one micro-batch
more in flight than stages; 0 or a mode without the closed-loop target keeps S."""

from __future__ import annotations

import pytest

from wavepp.api.spec import WavePipelineSpec
from wavepp.launch.runtime_config import SERVED_RETURN_MICROBATCHES, runtime_configs_from_spec

RAW = {"model": {"name": "tiny-llama"}, "stages": 2, "engine": "emulated"}


def _config(**raw: object):  # noqa: ANN202 - RuntimeConfig
    spec = WavePipelineSpec.model_validate(RAW | raw)
    return runtime_configs_from_spec(spec, pool="p")[0]


def test_a_served_replica_counts_one_microbatch_for_the_way_back() -> None:
    config = _config()
    assert SERVED_RETURN_MICROBATCHES == 1
    assert config.resolved_return_microbatches == 1
    assert config.resolved_max_inflight == 3


@pytest.mark.parametrize(
    ("raw", "inflight"),
    [
        ({"engineOptions": {"returnMicrobatches": 0}}, 2),
        ({"engineOptions": {"returnMicrobatches": 2}}, 4),
        ({"engineOptions": {"maxInflight": 5}}, 5),
        ({"scheduler": {"mode": "sync"}}, 2),  # no closed-loop target: the way back is not read
    ],
)
def test_the_option_max_inflight_and_the_mode_decide_what_is_in_flight(
    raw: dict, inflight: int
) -> None:
    assert _config(**raw).resolved_max_inflight == inflight
