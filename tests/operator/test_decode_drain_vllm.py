"""A decode pod's drain, on a real vLLM: the command the operator renders for a decode pod
(``decode_command``: vLLM's OpenAI server with WavePP's connector and ``--shutdown-timeout`` =
``decode.pool.drainSeconds``), run as a process on a random-weight checkpoint (host and port
moved to a free local one). SIGTERM arrives while a request streams, as the kubelet sends it
to a decode pod that is scaled down once its preStop hook returned:

- the request in flight finishes: every token it asked for, ``finish_reason`` ``length``;
- a request sent after SIGTERM is not served by this pod (the pod has left the Service by
  then: the preStop hook waits for that);
- the process exits on its own once drained, within the grace period the pod gets.

vLLM starts in about a minute on CPU, so this runs only with ``WAVEPP_BENCH_E2E=1`` (and
``.venv-vllm``, scripts/vllm-venv.sh); CI covers the rendered drain offline
(test_decode_scaling).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from bench_support import load_benchmark

from wavepp.api.spec import check_spec
from wavepp.operator.decode_builders import DECODE_TEARDOWN_S, decode_command
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.transport.natsio import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRAIN_S = 120
NUM_TOKENS = 96

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
    ),
    pytest.mark.skipif(
        os.environ.get("WAVEPP_BENCH_E2E") != "1",
        reason="starts vLLM (about 1 min on CPU); WAVEPP_BENCH_E2E=1 runs it",
    ),
    pytest.mark.timeout(1800),
]


def _make_checkpoint(out: Path) -> Path:
    """benchmarks/pd_handoff.py's random float32 Llama (a head size vLLM's CPU attention
    supports)."""
    return load_benchmark("pd_handoff").make_checkpoint(out)


def _command(model_dir: Path, port: int) -> list[str]:
    raw = {
        "model": {"name": "tiny-llama", "path": str(model_dir), "dtype": "float32"},
        "stages": 1,
        "resources": {"gpusPerStage": 0},
        "decode": {
            "pool": {
                "image": "unused",
                "python": str(VLLM_PYTHON),
                "resources": {"gpus": 0},
                "drainSeconds": DRAIN_S,
                "maxModelLen": 256,
                "args": ["--skip-tokenizer-init"],  # a random checkpoint has no tokenizer
            }
        },
    }
    spec, issues = check_spec(raw, default_image="i", default_nats_url="nats://n")
    assert spec is not None, issues
    command = decode_command(spec)
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    assert command[command.index("--shutdown-timeout") + 1] == str(DRAIN_S)
    return command


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def test_sigterm_lets_the_request_in_flight_finish(tmp_path: Path) -> None:
    _make_checkpoint(tmp_path / "ckpt")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "HOME": str(tmp_path)}
    log = (tmp_path / "vllm.log").open("wb")
    proc = subprocess.Popen(
        _command(tmp_path / "ckpt", port), env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200  # minutes on a busy 2-core machine
        ready = False
        while not ready and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    ready = r.status == 200
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        assert ready, "vLLM not ready:\n" + (tmp_path / "vllm.log").read_text()[-3000:]
        body = {
            "model": "tiny-llama", "prompt": [1, 2, 3, 4, 5], "max_tokens": NUM_TOKENS,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 0,
        }  # fmt: skip
        stream = urllib.request.urlopen(_post(f"{base}/v1/completions", body), timeout=120)
        events = [stream.readline()]  # the first token is out: the request is running
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(1.0)  # the engine has seen the shutdown
        refused: object
        try:
            late = body | {"stream": False, "max_tokens": 4}
            with urllib.request.urlopen(_post(f"{base}/v1/completions", late), timeout=60) as r:
                refused = json.loads(r.read())
        except (urllib.error.URLError, OSError) as exc:
            refused = exc
        events += list(stream)
        token_ids, finish = [], None
        for line in events:
            text = line.decode().strip()
            if not text.startswith("data:") or text.endswith("[DONE]"):
                continue
            event = json.loads(text[5:])
            assert "choices" in event, event  # an error event: the request was cut
            for choice in event["choices"]:
                token_ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
        assert (len(token_ids), finish) == (NUM_TOKENS, "length"), events[-3:]
        # the late request got no completion from this pod
        late_tokens = (
            refused.get("choices", [{}])[0].get("token_ids") if isinstance(refused, dict) else None
        )
        finish_late = (
            refused.get("choices", [{}])[0].get("finish_reason")
            if isinstance(refused, dict)
            else None
        )
        assert not (late_tokens and finish_late == "length"), refused
        proc.wait(timeout=DRAIN_S + DECODE_TEARDOWN_S)
        # vLLM's own account: the request was still running when SIGTERM came, and drained
        log_text = (tmp_path / "vllm.log").read_text(errors="replace")
        assert "draining in-flight requests count=1" in log_text, log_text[-3000:]
        print(
            f"drain: {NUM_TOKENS} tokens finished after SIGTERM; exited "
            f"{time.monotonic() - signalled:.1f} s after it (rc {proc.returncode}); "
            f"late request: {refused!r:.200}"
        )
    finally:
        stop_processes([proc])
        log.close()
