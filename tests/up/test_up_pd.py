"""Whole completions through prefill/decode disaggregation, as a user runs them: the unchanged
`openai` client against ``wavepp up --model DIR --stages 2 --decode vllm`` (2 WavePP stage
processes prefill and hand their KV over; one real vLLM server with WavePP's connector
decodes).

One ``wavepp up`` (and so one vLLM start-up, which dominates the module's time) serves all
the tests, in order (the kills last):

1. 20 prompts, 10 of them sharing a 64-token prefix: ``completions.create(max_tokens=16)``
   and ``stream=True`` give the same greedy tokens as vLLM alone (the same vLLM server, asked
   directly, computing the prompt itself: prefix caching is off there); the repeats of the
   shared prefix report ``usage.prompt_tokens_details.cached_tokens`` > 0.
2. ``chat.completions.create`` (the gateway's tokenizer carries a chat template) gives the
   tokens vLLM alone gives for the templated conversation, whole and streamed;
3. the metrics the autoscalers read (every ``seriesQuery`` of the chart's prometheus-adapter
   rules, and vLLM's ``vllm:num_requests_waiting``/``running``) are scraped from the processes
   that export them: the gateway's ``/metrics`` and the decode server's;
4. the last stage killed while it holds a prefill's blocks (under a load of long prompts, whole
   and streamed): each request in flight at the kill, or sent before the restarted stage's
   replica answers again, gets its tokens or a clean error (the JSON error shape, or an error
   event), none hangs, none fails after that; ``wavepp up`` restarts the stage, the pipeline
   answers with vLLM alone's tokens again, and no stage keeps a lease or a pinned block past
   the handoff lease;
5. the decode process killed mid-handoff and mid-stream (under a load of long prompts while
   vLLM pulls their KV): every request it caught fails cleanly, naming each stage's view of
   its handoff (the stream with an error event, the others with the JSON error shape), and no
   stage keeps a lease or a pinned block (last: ``wavepp up`` restarts the decode server, a
   whole vLLM start-up, which no later test waits for).

Skipped, with the reason, where ``.venv-vllm`` (scripts/vllm-venv.sh) is absent.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from bench_support import load_benchmark
from prometheus_client.parser import text_string_to_metric_families
from up_support import UpService, build_tokenizer, start_up, stop_up

from wavepp.api.kv_handoff import PARAMS_KEY, HandoffParams
from wavepp.gateway.chat_template import load_chat_template
from wavepp.operator.builders import BACKLOG_METRIC
from wavepp.runtime.config import RuntimeConfig

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
from wavepp.integrations.vllm.pull import pull_request, stage_stats  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CHART_TEMPLATES = sorted(REPO.glob("charts/*/templates/*.yaml"))
DECODE_SCALING_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
    ),
]


CHAT_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "[UNK]",
    "chat_template": "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}",
}


def _make_checkpoint(out: Path) -> Path:
    """benchmarks/pd_handoff.py's checkpoint: a random float32 Llama whose scaled output
    projection makes greedy choices robust to two engines' float differences."""
    return load_benchmark("pd_handoff").make_checkpoint(out)


@pytest.fixture(scope="module")
def pd_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpService]:
    tmp = tmp_path_factory.mktemp("pd")
    model = _make_checkpoint(tmp / "model")
    # the gateway's tokenizer, with a chat template (vLLM runs without one: token ids only)
    tokenizer = build_tokenizer(tmp / "tokenizer", vocab_size=1024)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(CHAT_TOKENIZER_CONFIG))
    began = time.monotonic()
    service = start_up(
        tmp,
        None,
        [
            "--model", str(model), "--stages", "2", "--tokenizer", str(tokenizer),
            "--decode", "vllm", "--decode-python", str(VLLM_PYTHON),
            "--decode-args", "--max-num-seqs 8 --max-model-len 1024",
            "--startup-timeout-s", "600",
        ],
        timeout_s=660,
    )  # fmt: skip
    print(f"wavepp up --decode vllm serving after {time.monotonic() - began:.0f} s")
    serving = next(line for line in service.lines if "wavepp up: serving" in line)
    assert f"decode on {service.processes()['decode']['decode-0']}" in serving, serving
    try:
        yield service
    finally:
        decode_pid = service.processes()["pids"]["decode-0"]  # a restarted one's, if killed
        assert stop_up(service.proc) == 0, "".join(service.lines[-40:])
        with pytest.raises(ProcessLookupError):  # the vLLM server and its engine stopped
            os.killpg(decode_pid, 0)


def _client(service: UpService) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.endpoint}/v1", api_key="unused", max_retries=0)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _stage_addrs(service: UpService) -> list[str]:
    """The stages' transfer servers: from a handoff the gateway answers (then pulled, so that
    its own lease ends)."""
    answer = _post(
        f"{service.endpoint}/v1/completions",
        {"prompt": [3, 4, 5], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = HandoffParams.from_json(answer["kv_transfer_params"][PARAMS_KEY])
    pull_request(params, timeout_s=30.0)
    return [s.addr for s in params.stages]


def _wait_no_pins(addrs: list[str], timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [stage_stats(a) for a in addrs]
        if all(s["leases"] == 0 and s["pinned_blocks"] == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, f"pins left on the stages: {stats}"
        time.sleep(0.2)


def test_openai_client_gets_vllms_own_greedy_tokens_and_the_prefix_is_reused(
    pd_service: UpService,
) -> None:
    client = _client(pd_service)
    model = client.models.list().data[0].id
    decode_url = pd_service.processes()["decode"]["decode-0"]
    rng = random.Random(5)
    shared = [rng.randrange(2, 1024) for _ in range(64)]
    prompts = [shared + [rng.randrange(2, 1024) for _ in range(5 + i)] for i in range(10)]
    prompts += [[rng.randrange(2, 1024) for _ in range(20 + 3 * i)] for i in range(10)]

    def run(prompt: list[int]) -> tuple[list[int], list[int], list[int], int]:
        """(vLLM alone's tokens, the gateway's, the gateway's streamed, cached tokens)."""
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        streamed: list[int] = []
        usage = None
        for chunk in client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                streamed += chunk.choices[0].model_extra["token_ids"]
            else:
                usage = chunk.usage
        alone = _post(
            f"{decode_url}/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
             "return_token_ids": True},
        )["choices"][0]["token_ids"]  # fmt: skip
        assert len(alone) == 16 and whole.usage.completion_tokens == 16
        assert whole.usage.prompt_tokens == len(prompt)
        assert usage is not None and usage.completion_tokens == len(streamed) == 16
        tokens = whole.choices[0].model_extra["token_ids"]
        return alone, tokens, streamed, whole.usage.prompt_tokens_details.cached_tokens

    addrs = _stage_addrs(pd_service)
    transfers = [stage_stats(a)["transfers"] for a in addrs]
    # the first prompt alone (it leaves the shared prefix on the stages), then the rest at
    # once (vLLM batches their decodes)
    answers = [run(prompts[0])]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers += list(pool.map(run, prompts[1:]))
    # vLLM decoded from the stages' KV: it pulled every completion's handoff (whole and
    # streamed) from both stages, instead of computing the prompts itself as it does alone
    pulled = [stage_stats(a)["transfers"] - n for a, n in zip(addrs, transfers, strict=True)]
    assert pulled == [2 * len(prompts)] * len(addrs), pulled
    mismatches = [(i, a) for i, a in enumerate(answers) if not a[0] == a[1] == a[2]]
    cached = [a[3] for a in answers]
    print(f"token-equal prompts: {len(prompts) - len(mismatches)}/{len(prompts)}; cached {cached}")
    assert not mismatches, mismatches
    # the shared 64-token prefix (whole blocks) is reused by every repeat, and only by those
    assert cached[0] == 0 and all(c == 64 for c in cached[1:10]), cached
    assert all(c == 0 for c in cached[10:]), cached


def test_chat_goes_through_the_chat_template(pd_service: UpService) -> None:
    client = _client(pd_service)
    model = client.models.list().data[0].id
    decode_url = pd_service.processes()["decode"]["decode-0"]
    messages = [
        {"role": "system", "content": " ".join(f"w{i}" for i in range(100, 170))},
        {"role": "user", "content": "w5 w6 w7 w8"},
    ]
    template = load_chat_template(str(pd_service.state_dir.parent / "tokenizer"))
    assert template is not None
    prompt = template(messages)
    alone = _post(
        f"{decode_url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
         "return_token_ids": True},
    )["choices"][0]["token_ids"]  # fmt: skip
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].model_extra["token_ids"] == alone
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 16
    streamed: list[int] = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    ):
        streamed += chunk.choices[0].model_extra["token_ids"]
    assert streamed == alone


def _metric_names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_autoscalers_metrics_are_exported_by_the_gateway_and_the_decode_server(
    pd_service: UpService,
) -> None:
    # the metrics the chart's prometheus-adapter rules serve to the HPAs: vLLM's (vllm:...)
    # come from the decode servers, WavePP's from the gateway
    rules = "\n".join(path.read_text() for path in CHART_TEMPLATES)
    served = set(re.findall(r"seriesQuery:\s*'([A-Za-z_:][A-Za-z0-9_:]*)", rules))
    assert BACKLOG_METRIC in served, served  # the prefill pool's HPA (operator.builders)
    decode = _metric_names(f"{pd_service.processes()['decode']['decode-0']}/metrics")
    gateway = _metric_names(f"{pd_service.endpoint}/metrics")
    assert DECODE_SCALING_METRICS <= decode, sorted(n for n in decode if "request" in n)
    missing = {n for n in served if n not in (decode if n.startswith("vllm:") else gateway)}
    assert not missing, f"named by the chart's adapter rules, exported by no process: {missing}"
    # rules that select by a name pattern (vLLM's names: ':' in text, '_' in OpenMetrics)
    patterns = re.findall(r'seriesQuery:\s*\'\{__name__=~"([^"]+)"', rules)
    assert patterns, "the chart's decode rule selects vLLM's metrics by a __name__ pattern"
    for pattern in patterns:
        matched = {n for n in decode | gateway if re.fullmatch(pattern, n)}
        assert matched, f"no process exports a metric matching the adapter rule's {pattern!r}"


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, 1024) for _ in range(length)]


def test_stage_killed_mid_prefill_fails_its_requests_cleanly_and_the_pipeline_recovers(
    pd_service: UpService,
) -> None:
    client = openai.OpenAI(
        base_url=f"{pd_service.endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    decode_url = pd_service.processes()["decode"]["decode-0"]
    addrs = _stage_addrs(pd_service)
    _wait_no_pins(addrs, 10.0)
    stage_pids = {n: p for n, p in pd_service.processes()["pids"].items() if n.startswith("stage-")}
    victim = max(stage_pids)  # the last stage (one replica: stage-<replica>-<rank>)
    victim_addr = max(addrs, key=lambda a: stage_stats(a)["first_layer"])
    # (sent, finished, completion tokens or the error)
    records: list[tuple[float, float, list[int] | openai.APIError]] = []
    stop = threading.Event()

    def load(seed: int) -> None:
        """Long distinct prompts (a prefill of many blocks), whole (even seed) or streamed."""
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = _prompt(rng, 700)
            sent = time.monotonic()
            try:
                if seed % 2 == 0:
                    answer = client.completions.create(
                        model=model, prompt=prompt, max_tokens=2, temperature=0
                    )
                    outcome: list[int] | openai.APIError = answer.choices[0].model_extra[
                        "token_ids"
                    ]
                else:
                    outcome = []
                    for chunk in client.completions.create(
                        model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True
                    ):
                        outcome += chunk.choices[0].model_extra["token_ids"]
            except openai.APIError as exc:
                outcome = exc
            records.append((sent, time.monotonic(), outcome))

    threads = [threading.Thread(target=load, args=(seed,), daemon=True) for seed in (40, 41, 42)]
    for thread in threads:
        thread.start()
    # the kill lands while the victim holds blocks that no handoff lease holds: a request
    # between its agreement and its prefill's end
    deadline = time.monotonic() + 120
    while True:
        stats = stage_stats(victim_addr, timeout_s=5.0)
        if stats["pinned_blocks"] > stats["lease_pinned_blocks"]:
            break
        assert time.monotonic() < deadline, f"no prefill seen on {victim}: {stats}"
    os.kill(stage_pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    while pd_service.processes()["restarts"].get(victim, 0) < 1:
        assert time.monotonic() < killed + 120, "wavepp up did not restart the stage"
        time.sleep(0.1)
    restarted = time.monotonic()
    while not any(sent > restarted and isinstance(o, list) for sent, _, o in list(records)):
        assert time.monotonic() < killed + 240, (
            f"no answer after the restart: {[(round(s - killed, 1), o) for s, _, o in records]}\n"
            + "".join(pd_service.lines[-30:])
        )
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(150)
    in_flight = [(done - sent, o) for sent, done, o in records if sent < killed < done]
    print(
        f"stage kill mid-prefill: {len(in_flight)} in flight at the kill: "
        f"{[(round(t, 1), o if isinstance(o, list) else type(o).__name__) for t, o in in_flight]}; "
        f"restarted {restarted - killed:.1f} s after the kill"
    )
    assert in_flight, "no request was in flight at the kill"
    recovered = min(sent for sent, _, o in records if sent > restarted and isinstance(o, list))
    for sent, done, outcome in records:
        # tokens, or the JSON error shape (a status) or a final error event, with a message;
        # none waits out the client's timeout
        assert done - sent < 100 and not isinstance(outcome, openai.APITimeoutError), outcome
        if isinstance(outcome, list):
            assert len(outcome) == 2, outcome
        else:
            assert outcome.message and sent < recovered, (sent - killed, outcome)
    # the re-formed pipeline hands over KV that decodes to vLLM alone's tokens
    prompt = _prompt(random.Random(43), 300)
    alone = _post(
        f"{decode_url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
         "return_token_ids": True},
    )["choices"][0]["token_ids"]  # fmt: skip
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert answer.choices[0].model_extra["token_ids"] == alone
    now = pd_service.processes()["pids"]
    assert now[victim] != stage_pids[victim]
    assert all(now[n] == pid for n, pid in stage_pids.items() if n != victim)
    # nothing the failed requests held stays on either stage: a lease of a prefill that no
    # decode request pulls ends at its expiry (handoff_lease_s)
    addrs = _stage_addrs(pd_service)
    expired = sum(stage_stats(a)["expired"] for a in addrs)
    waited = time.monotonic()
    _wait_no_pins(addrs, RuntimeConfig.model_fields["handoff_lease_s"].default + 30.0)
    print(
        f"no pins {time.monotonic() - waited:.1f} s after the load; leases ended unpulled: "
        f"{sum(stage_stats(a)['expired'] for a in addrs) - expired}"
    )


STAGE_VIEW = re.compile(
    r"\S+:\d+: (held, not pulled \(released now\)"
    r"|request_id: '[^']+' holds no handoff lease on layers \[\d+, \d+\): "
    r"(released|released after its pull|its pull broke off \(.+\))"
    r"|expires: the handoff lease of '[^']+' ended at [0-9.]+)"
)


def _stage_views(message: str) -> list[str]:
    """The stages' views of a failed request's handoff at the end of the gateway's error."""
    _, _, views = message.partition("; the stages' handoff: ")
    return views.split("; ") if views else []


def test_decode_killed_mid_handoff_and_mid_stream_fails_cleanly_and_leaves_no_pins(
    pd_service: UpService,
) -> None:
    """The decode process (vLLM's server and its engine) is killed while a stream is decoding,
    vLLM has pulled handoffs of the load, and others are open on the stages (prefilled and
    handed to the gateway, not yet pulled, or being pulled). To make the moment certain on a
    loaded machine the decode is first stopped (SIGSTOP), the stages' leases read, then it is
    killed: the handoffs open at that reading are the ones counted. Which of them were under
    way at the kill is left to timing; each ends one of the counted ways (its pull broken off,
    its lease's end, or released unpulled by the gateway, which names it in the error)."""
    client = openai.OpenAI(
        base_url=f"{pd_service.endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    addrs = _stage_addrs(pd_service)
    _wait_no_pins(addrs, 10.0)
    before = [stage_stats(a) for a in addrs]
    decode_pid = pd_service.processes()["pids"]["decode-0"]
    outcomes: list[list[int] | openai.APIError] = []
    streamed = [0]  # tokens of the stream under way; -1 between streams
    stop = threading.Event()

    def stream() -> None:
        """One long stream after another (it is mid-stream at the kill)."""
        while not stop.is_set():
            tokens: list[int] | openai.APIError = []
            try:
                for chunk in client.completions.create(
                    model=model, prompt=list(range(10, 90)), max_tokens=900, temperature=0,
                    stream=True,
                ):  # fmt: skip
                    tokens += chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
                    streamed[0] = len(tokens)
            except openai.APIError as exc:
                tokens = exc
            streamed[0] = -1
            outcomes.append(tokens)

    def load(seed: int) -> None:
        """Long distinct prompts, whole: a handoff of many blocks each."""
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                answer = client.completions.create(
                    model=model, prompt=_prompt(rng, 600), max_tokens=4, temperature=0
                )
                outcomes.append(answer.choices[0].model_extra["token_ids"])
            except openai.APIError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=stream, daemon=True)]
    threads += [threading.Thread(target=load, args=(s,), daemon=True) for s in (50, 51, 52)]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    # the kill: vLLM has pulled the load's handoffs (it is pulling), at least one more is open,
    # and the stream is under way; read with the decode stopped, so nothing moves between the
    # reading and the kill
    while True:
        assert time.monotonic() < began + 180, [stage_stats(a) for a in addrs]
        stats = [stage_stats(a) for a in addrs]
        pulled = [s["transfers"] - b["transfers"] for s, b in zip(stats, before, strict=True)]
        if not (min(pulled) >= 2 and sum(s["leases"] for s in stats) and 2 <= streamed[0]):
            time.sleep(0.05)
            continue
        os.killpg(decode_pid, signal.SIGSTOP)
        time.sleep(0.3)  # what the decode sent before it stopped reaches the gateway
        stats = [stage_stats(a) for a in addrs]
        # the stream is well before its end: what vLLM had sent is drained, none is left
        if sum(s["leases"] for s in stats) and 2 <= streamed[0] <= 800:
            break
        os.killpg(decode_pid, signal.SIGCONT)
    open_at_kill = sum(s["leases"] for s in stats)
    os.killpg(decode_pid, signal.SIGKILL)
    killed = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(150)
    assert not any(t.is_alive() for t in threads), "a request hangs after the decode's kill"
    errors = [o for o in outcomes if isinstance(o, openai.APIError)]
    print(
        f"decode killed {killed - began:.1f} s into the load with {open_at_kill} handoff(s) "
        f"open; {len(outcomes) - len(errors)} answered before it, {len(errors)} errors: "
        f"{[e.message for e in errors]}"
    )
    # every request the kill caught failed cleanly, naming each stage's view of its handoff:
    # the stream with an error event, the others with the JSON error shape (502, or 503 when
    # the connection was lost before an answer)
    assert any("broke off the stream" in e.message for e in errors), [e.message for e in errors]
    for error in errors:
        views = _stage_views(error.message)
        assert len(views) == len(addrs), error.message
        assert all(STAGE_VIEW.fullmatch(v) for v in views), error.message
        if isinstance(error, openai.APIStatusError):
            body = error.body if isinstance(error.body, dict) else {}
            assert error.status_code in (502, 503), error
            assert body.get("error", body).get("field") == "decode", error.body
    # nothing is left on the stages: every handoff open at the kill ended there, its pull
    # broken off, released unpulled by the gateway, or at its lease's end (handoff_lease_s)
    after = _wait_no_pins(addrs, RuntimeConfig.model_fields["handoff_lease_s"].default + 30.0)
    ended = sum(
        a["broken"] - b["broken"] + a["expired"] - b["expired"]
        for a, b in zip(after, before, strict=True)
    )
    unpulled = sum(e.message.count("held, not pulled") for e in errors)
    print(
        f"no pins {time.monotonic() - killed:.1f} s after the kill; broken or expired: {ended}, "
        f"released unpulled: {unpulled}"
    )
    assert ended + unpulled >= open_at_kill >= 1, (ended, unpulled, open_at_kill)
