"""`wavepp up --model DIR --stages 2` as real processes, driven as the prefill side of vLLM's
disaggregated-serving protocol over HTTP: a completion with ``kv_transfer_params:
{"do_remote_decode": true}`` is answered with the ``kv_transfer_params`` a decode request
consumes; pulling with them (the decode side's client, ``integrations.vllm.pull``) gets every
layer's K/V from both stages, equal to what a monolithic transformers forward of the checkpoint
caches; the pull's release ends the lease on every stage (no pin left); a completion without
the field leaves no lease."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp
import pytest
from up_support import start_up, stop_up

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from wavepp.api.kv_handoff import PARAMS_KEY, HandoffError, HandoffParams  # noqa: E402
from wavepp.bench.checkpoints import save_random_checkpoint  # noqa: E402
from wavepp.integrations.vllm.pull import pull_request, stage_stats  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NUM_LAYERS = 4


async def post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


def stats(addrs: list[str]) -> list[dict]:
    return [stage_stats(a) for a in addrs]


async def wait_no_pins(addrs: list[str], timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = await asyncio.to_thread(stats, addrs)
        if all(s["leases"] == 0 and s["pinned_blocks"] == 0 for s in now):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"pins left on the stages: {now}")
        await asyncio.sleep(0.2)


def reference_kv(model: object, token_ids: list[int]) -> list[object]:
    """Per layer [2, num_tokens, num_kv_heads, head_dim], as transformers caches it."""
    with torch.inference_mode():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values  # type: ignore[operator]
    return [
        torch.stack(
            [cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)]
        )
        for i in range(NUM_LAYERS)
    ]


async def test_completion_hands_its_kv_to_a_decode_client(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny-llama"
    model = save_random_checkpoint("llama", ckpt, num_layers=NUM_LAYERS, vocab_size=256)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 256) for _ in range(40)]
    service = start_up(tmp_path / "up", None, ["--model", str(ckpt), "--stages", "2"])
    try:
        url = f"{service.endpoint}/v1/completions"
        async with aiohttp.ClientSession() as session:
            status, plain = await post(session, url, {"prompt": prompt, "max_tokens": 1})
            assert status == 200, plain
            assert plain["kv_transfer_params"] is None
            status, bad = await post(
                session, url, {"prompt": prompt, "kv_transfer_params": {"do_remote_decode": "1"}}
            )
            assert status == 400 and bad["error"]["field"] == "kv_transfer_params.do_remote_decode"
            status, answer = await post(
                session,
                url,
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "do_remote_prefill": False,
                        "remote_engine_id": None,
                        "remote_block_ids": None,
                        "remote_host": None,
                        "remote_port": None,
                    },
                },
            )
        assert status == 200, answer
        transfer = answer["kv_transfer_params"]
        assert (transfer["do_remote_prefill"], transfer["do_remote_decode"]) == (True, False)
        params = HandoffParams.from_json(transfer[PARAMS_KEY])
        assert params.num_tokens == len(prompt)
        assert [(s.first_layer, s.last_layer) for s in params.stages] == [(0, 2), (2, 4)]
        assert params.expires > time.time()
        # the same first token as without the handoff (the prefix is reused: same KV)
        assert answer["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        addrs = [s.addr for s in params.stages]
        held = await asyncio.to_thread(stats, addrs)
        assert [s["leases"] for s in held] == [1, 1], held
        assert all(s["pinned_blocks"] > 0 for s in held), held

        forged = HandoffParams(
            params.request_id, params.num_tokens, params.expires, "0" * 64, params.stages
        )
        with pytest.raises(HandoffError, match="token"):
            await asyncio.to_thread(pull_request, forged, timeout_s=10.0)

        pulled = await asyncio.to_thread(pull_request, params, timeout_s=30.0)
        expected = reference_kv(model, prompt)
        assert len(pulled.layers) == NUM_LAYERS
        for i, (got, want) in enumerate(zip(pulled.layers, expected, strict=True)):
            assert got.shape == want.shape, (i, got.shape, want.shape)
            torch.testing.assert_close(
                got, want.to(got.dtype), atol=1e-4, rtol=1e-4, msg=f"layer {i}"
            )
        assert pulled.num_bytes == sum(t.numel() * t.element_size() for t in pulled.layers)
        await wait_no_pins(addrs)  # released by the pull
        with pytest.raises(HandoffError, match="no handoff lease"):
            await asyncio.to_thread(pull_request, params, timeout_s=10.0)
    finally:
        assert stop_up(service.proc) == 0, "".join(service.lines[-40:])
