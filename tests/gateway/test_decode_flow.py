"""``DecodeFlow``'s failure paths, fast and deterministic: the decode endpoint is an aiohttp
stand-in (a vLLM that refuses a connection, answers an error, or breaks a stream off exactly
where the test says; the real vLLM path is tests/up/test_up_pd.py) and each "stage" a TCP
server speaking the handoff protocol's ``release`` op, recording what it was asked to release.
Every failure must answer the documented error shape (JSON, or a final SSE error event) and
release the handoff lease on every stage at once."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from wavepp.api.kv_handoff import LENGTH_BYTES, PARAMS_KEY, encode_json, parse_json_frame
from wavepp.api.prefill import PrefillResult
from wavepp.gateway.decode import DecodePool
from wavepp.gateway.decode_flow import DecodeFlow, release_handoff
from wavepp.gateway.validation import CompletionRequest, ParsedRequest, Sampling
from wavepp.runtime.transport.natsio import free_port

pytestmark = pytest.mark.timeout(60)


class FakeStage:
    """Answers ``release`` ok once per request id (then "no lease"), as a stage does; with
    ``refusal``, refuses every release with it (a stage whose lease already ended)."""

    def __init__(self, refusal: str = "") -> None:
        self.refusal = refusal
        self.released: list[str] = []
        self.server: asyncio.Server | None = None
        self.addr = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(LENGTH_BYTES)
        ask = parse_json_frame(await reader.readexactly(int.from_bytes(head, "big")))
        first = ask["op"] == "release" and ask["request_id"] not in self.released
        self.released.append(ask["request_id"])
        refusal = self.refusal or (not first and "no lease")
        writer.write(encode_json({"ok": False, "error": refusal} if refusal else {"ok": True}))
        await writer.drain()
        writer.close()


def _result(stages: list[FakeStage]) -> PrefillResult:
    handoff = {
        "request_id": "r1",
        "num_tokens": 4,
        "expires": 9e9,
        "token": "ab" * 32,
        "stages": [[s.addr, i, i + 1] for i, s in enumerate(stages)],
    }
    return PrefillResult(
        request_id="r1",
        tenant="default",
        num_prompt_tokens=4,
        num_cached_tokens=0,
        kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: handoff},
    )


def _batch(stream: bool) -> CompletionRequest:
    prompt = ParsedRequest("default", "r1", [1, 2, 3, 4], handoff=True)
    return CompletionRequest([prompt], "tiny", stream=stream, sampling=Sampling(8))


async def _fake_decode(
    behaviour: str, aborted: asyncio.Event | None = None
) -> tuple[web.AppRunner, str]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["kv_transfer_params"][PARAMS_KEY]["request_id"] == "r1"
        if behaviour == "error":
            return web.json_response({"error": {"message": "max_tokens too big"}}, status=400)
        if behaviour == "500":  # vLLM's answer when its KV connector failed the load
            return web.json_response({"error": {"message": "Internal server error"}}, status=500)
        if behaviour == "ok" and not body["stream"]:
            choice = {"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length"}
            return web.json_response({"choices": [choice], "usage": {"completion_tokens": 2}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "", "token_ids": [5]}]}
        await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if behaviour == "slow":  # one token every 0.2 s, until the gateway closes the request
            try:
                for _ in range(100):
                    await asyncio.sleep(0.2)
                    await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            except (ConnectionResetError, asyncio.CancelledError):
                assert aborted is not None
                aborted.set()
                raise
            return out
        if behaviour == "ok":
            usage = {"choices": [], "usage": {"completion_tokens": 1}}
            await out.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return out
        # "break": the connection ends mid-stream, no [DONE] (a killed server)
        assert request.transport is not None
        request.transport.close()
        return out

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _gateway(
    flow: DecodeFlow, result: PrefillResult, stream: bool, codes: list[int], chat: bool = False
):
    async def handle(request: web.Request) -> web.StreamResponse:
        async def prefill() -> tuple[int, object, dict]:
            return 200, result, {}

        batch = _batch(stream)
        batch.include_usage = True
        return await flow.complete(
            request, batch, prefill=prefill, cache_salt="s", answered=codes.append, chat=chat
        )

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handle)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1/completions"


async def test_every_decode_failure_answers_an_error_and_releases_the_lease() -> None:
    stages = [FakeStage(), FakeStage()]
    for stage in stages:
        await stage.start()
    result = _result(stages)
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cases = {}
    runners = []
    try:
        # 1. no endpoint reachable: 503 naming decode, lease released on both stages
        flow = DecodeFlow(DecodePool([down]), model_name="tiny", connect_timeout_s=2)
        codes: list[int] = []
        runner, url = await _gateway(flow, result, False, codes)
        runners.append(runner)
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as response:
            cases["down"] = (response.status, await response.json())
        await flow.close()
        assert cases["down"][0] == 503 and cases["down"][1]["error"]["field"] == "decode"
        assert codes == [503] and [s.released for s in stages] == [["r1"], ["r1"]]
        assert flow.pool.num_in_flight(down) == 0

        # 2. the down endpoint is passed over for the next one, which answers an error: 400
        erring, erring_url = await _fake_decode("error")
        runners.append(erring)
        flow = DecodeFlow(DecodePool([down, erring_url]), model_name="tiny", connect_timeout_s=2)
        codes = []
        runner, url = await _gateway(flow, result, False, codes)
        runners.append(runner)
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as response:
            status, body = response.status, await response.json()
        await flow.close()
        assert status == 400 and "max_tokens too big" in body["error"]["message"], body
        assert codes == [400] and [len(s.released) for s in stages] == [2, 2]
        assert flow.pool.order(0.0)[0] == erring_url  # the refused one is marked down

        # 3. a stream broken off after one token: that token, then a final error event
        breaking, breaking_url = await _fake_decode("break")
        runners.append(breaking)
        flow = DecodeFlow(DecodePool([breaking_url]), model_name="tiny")
        codes = []
        runner, url = await _gateway(flow, result, True, codes)
        runners.append(runner)
        async with aiohttp.ClientSession() as session, session.post(url, json={}) as response:
            assert response.status == 200
            events = [
                json.loads(line[5:])
                for line in (await response.text()).splitlines()
                if line.startswith("data:") and "[DONE]" not in line
            ]
        await flow.close()
        assert events[0]["choices"][0]["token_ids"] == [5]
        assert events[-1]["error"]["field"] == "decode"
        assert "after 1 tokens" in events[-1]["error"]["message"], events[-1]
        assert codes == [502] and [len(s.released) for s in stages] == [3, 3]
        assert flow.pool.num_in_flight(breaking_url) == 0
    finally:
        for runner in runners:
            await runner.cleanup()
        for stage in stages:
            assert stage.server is not None
            stage.server.close()


async def test_a_failed_decode_names_each_stages_view_of_the_handoff() -> None:
    """vLLM answers a failed KV load (lease lost, pull timed out) with a bare 500: the
    gateway's error adds what each stage says of the handoff, so the cause reaches the
    client; the same for a stream broken off."""
    ended = "expires: the handoff lease of 'r1' ended at 5.000"
    stages = [FakeStage(), FakeStage(refusal=ended)]
    for stage in stages:
        await stage.start()
    result = _result(stages)
    runners = []
    try:
        for behaviour, stream in (("500", False), ("break", True)):
            stages[0].released.clear()  # a new lease, held until the gateway releases it
            decode, decode_url = await _fake_decode(behaviour)
            runners.append(decode)
            flow = DecodeFlow(DecodePool([decode_url]), model_name="tiny")
            codes: list[int] = []
            runner, url = await _gateway(flow, result, stream, codes)
            runners.append(runner)
            async with aiohttp.ClientSession() as session, session.post(url, json={}) as answer:
                if stream:
                    lines = (await answer.text()).splitlines()
                    body = json.loads(next(x for x in lines[::-1] if x.startswith("data:"))[5:])
                else:
                    assert answer.status == 502
                    body = await answer.json()
            await flow.close()
            message = body["error"]["message"]
            assert codes == [502] and body["error"]["field"] == "decode", body
            assert "; the stages' handoff: " in message, message
            held, lost = message.split("; the stages' handoff: ")[1].split("; ", 1)
            assert held.startswith(stages[0].addr) and "held, not pulled" in held, message
            assert lost == f"{stages[1].addr}: {ended}", message
        assert message.startswith(f"decode endpoint {decode_url} broke off the stream"), message
    finally:
        for runner in runners:
            await runner.cleanup()
        for stage in stages:
            assert stage.server is not None
            stage.server.close()


async def test_release_of_a_malformed_or_unreachable_handoff_is_logged_not_raised() -> None:
    assert await release_handoff({"do_remote_prefill": True}) == 0
    unreachable = {
        PARAMS_KEY: {
            "request_id": "r",
            "num_tokens": 1,
            "expires": 9e9,
            "token": "00",
            "stages": [[f"127.0.0.1:{free_port()}", 0, 1]],
        }
    }
    assert await release_handoff(unreachable, timeout_s=2.0) == 0


async def test_chat_answers_and_streams_in_chat_shapes() -> None:
    stages = [FakeStage()]
    await stages[0].start()
    decode, decode_url = await _fake_decode("ok")
    runners = [decode]
    try:
        for stream in (False, True):
            flow = DecodeFlow(DecodePool([decode_url]), model_name="tiny")
            codes: list[int] = []
            runner, url = await _gateway(flow, _result(stages), stream, codes, chat=True)
            runners.append(runner)
            async with aiohttp.ClientSession() as session, session.post(url, json={}) as response:
                text = await response.text()
            await flow.close()
            assert codes == [200]
            if not stream:
                answer = json.loads(text)
                assert answer["object"] == "chat.completion"
                assert answer["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
                assert answer["usage"]["completion_tokens"] == 2
                continue
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            first, usage = json.loads(events[0]), json.loads(events[1])
            assert first["object"] == "chat.completion.chunk"
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
        assert stages[0].released == []  # nothing failed: the decode side pulled (released)
    finally:
        for runner in runners:
            await runner.cleanup()
        assert stages[0].server is not None
        stages[0].server.close()


async def test_a_client_leaving_mid_stream_aborts_the_decode_and_releases_the_lease() -> None:
    stages = [FakeStage()]
    await stages[0].start()
    aborted = asyncio.Event()
    decode, decode_url = await _fake_decode("slow", aborted)
    flow = DecodeFlow(DecodePool([decode_url]), model_name="tiny")
    codes: list[int] = []
    runner, url = await _gateway(flow, _result(stages), True, codes)
    try:
        async with aiohttp.ClientSession() as session:
            response = await session.post(url, json={})
            first = await response.content.readline()
            assert first.startswith(b"data: ")
            response.close()  # the client goes away mid-stream
        await asyncio.wait_for(aborted.wait(), 10)  # the decode request was closed too
        for _ in range(100):
            if codes:
                break
            await asyncio.sleep(0.05)
        assert codes == [499] and stages[0].released == ["r1"]
        assert flow.pool.num_in_flight(decode_url) == 0
    finally:
        await flow.close()
        await runner.cleanup()
        await decode.cleanup()
        assert stages[0].server is not None
        stages[0].server.close()
