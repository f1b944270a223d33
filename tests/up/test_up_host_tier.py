"""``wavepp up --host-memory-gib`` honoured end to end (spec -> admission service -> stage
processes) on the emulated engine, with a device pool of 8 blocks a stage that a filler of 8
blocks empties: the reused prefix can only come back through the stages' host tiers, and every
stage counts the blocks it loaded (``wavepp_stage_host_kv_blocks_total``). The same requests
through ``wavepp replay``: tests/cli/test_replay_host_tier.py."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from up_support import start_up, stop_up

from wavepp.runtime.transport.natsio import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BLOCK = 16
# 0.001 GiB: 2^30 / 1000 / (512 B x 4 layers x 16 tokens) = 32 host blocks per stage
HOST_GIB = "0.001"


def _prefill(endpoint: str, token_ids: list[int]) -> dict:
    body = json.dumps({"tenant": "default", "token_ids": token_ids}).encode()
    request = urllib.request.Request(
        f"{endpoint}/v1/prefill", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _loaded(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    match = re.search(r'^wavepp_stage_host_kv_blocks_total\{op="loaded"[^}]*\} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def test_up_flag_reaches_the_stages_and_the_admission(tmp_path: Path) -> None:
    spec = {
        "engine": "emulated",
        "model": {"name": "tiny-llama"},
        "stages": 2,
        "cache": {"blockSize": BLOCK},
        "engineOptions": {"kvBlocks": 8, "timeScale": 0.01},
        "telemetry": {"metricsPort": free_port()},
    }
    service = start_up(tmp_path, spec, ["--host-memory-gib", HOST_GIB], timeout_s=180.0)
    try:
        shared = list(range(1, 4 * BLOCK + 1))
        first = _prefill(service.endpoint, shared + [500] * BLOCK)
        filler = _prefill(service.endpoint, list(range(600, 600 + 8 * BLOCK)))
        second = _prefill(service.endpoint, shared + [900] * BLOCK)
        answers = [first, filler, second]
        assert first["num_cached_tokens"] == 0 and filler["num_cached_tokens"] == 0, answers
        assert second["num_cached_tokens"] == 4 * BLOCK, answers
        urls = service.processes()["stage_metrics"]
        assert sorted(urls) == ["default-r0-0", "default-r0-1"]
        # each stage loaded the 4 blocks (more only if an attempt was planned again)
        loaded = [_loaded(urls[name]) for name in sorted(urls)]
        assert min(loaded) >= 4, (loaded, answers)
    finally:
        code = stop_up(service.proc)
    assert code == 0, "".join(service.lines[-40:])
