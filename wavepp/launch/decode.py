"""The decode side of ``wavepp up``: running decode servers (``--decode-url URL``, repeatable)
and local vLLM decode instances (``--decode vllm``, ``--decode-replicas N``) started with
WavePP's KV connector.

A local decode instance is vLLM's OpenAI-compatible server in vLLM's own environment
(``--decode-python PY``: a Python where ``import vllm`` works; default this one)::

    PY -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
       --host 127.0.0.1 --port P --dtype D --max-model-len L --no-enable-prefix-caching
       --kv-transfer-config '{"kv_connector": "WavePPConnector", "kv_role": "kv_consumer",
                              "kv_connector_module_path": "wavepp.integrations.vllm.connector"}'
       [CPU: --enforce-eager --block-size 32 --gpu-memory-utilization 0.1]
       [no tokenizer files in DIR: --skip-tokenizer-init]

with ``PYTHONPATH`` = the folder holding this ``wavepp`` package (the connector needs only the
standard library, torch and vLLM) and, on CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, 1
unless set). Prefix caching is off: every decode request brings its prompt's KV from the
stages. ``--decode-args "..."`` appends vLLM options (shell words) after these.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import wavepp
from wavepp.launch.flags import FlagError

__all__ = [
    "CONNECTOR_CONFIG",
    "CPU_BLOCK_SIZE",
    "DecodeServer",
    "check_vllm_python",
    "decode_servers",
]

CONNECTOR_CONFIG = {
    "kv_connector": "WavePPConnector",
    "kv_role": "kv_consumer",
    "kv_connector_module_path": "wavepp.integrations.vllm.connector",
}
"""vLLM's ``--kv-transfer-config`` of a WavePP decode instance."""

CPU_BLOCK_SIZE = 32
"""vLLM's CPU attention takes KV blocks of a multiple of 32 tokens."""

CPU_MEMORY_UTILIZATION = 0.1
"""vLLM's ``--gpu-memory-utilization`` on CPU: the fraction of host memory it may plan for."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class DecodeServer:
    """One local decode instance: its child name, URL, command line and environment."""

    name: str
    url: str
    command: list[str]
    env: dict[str, str]


def check_vllm_python(python: str) -> None:
    """Raise FlagError (``--decode-python``) unless ``python`` runs and finds ``vllm``."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FlagError("--decode-python", f"{python}: cannot run it ({exc})") from None
    if done.returncode != 0:
        raise FlagError(
            "--decode-python",
            f"{python}: vllm is not importable there; name a Python whose environment has vLLM "
            "(e.g. a virtual environment's bin/python after `pip install vllm`)",
        )


def decode_servers(
    *,
    python: str,
    model_dir: str,
    model_name: str,
    dtype: str,
    max_model_len: int,
    ports: list[int],
    on_cpu: bool,
    extra_args: str = "",
    environ: dict[str, str] | None = None,
) -> list[DecodeServer]:
    """The local decode instances (module docstring), one per port in ``ports``; pure apart
    from reading ``model_dir``'s file names.

    Raises:
        FlagError: ``--decode-args`` is not valid shell words.
    """
    try:
        extra = shlex.split(extra_args)
    except ValueError as exc:
        raise FlagError("--decode-args", f"{extra_args!r}: {exc}") from None
    base_env = dict(os.environ if environ is None else environ)
    base_env.pop("VIRTUAL_ENV", None)
    env = {**base_env, "PYTHONPATH": str(Path(wavepp.__file__).resolve().parent.parent)}
    if on_cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    has_tokenizer = any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES)
    servers = []
    for i, port in enumerate(ports):
        command = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(CONNECTOR_CONFIG),
        ]  # fmt: skip
        if on_cpu:
            command += ["--enforce-eager", "--block-size", str(CPU_BLOCK_SIZE)]
            command += ["--gpu-memory-utilization", str(CPU_MEMORY_UTILIZATION)]
        if not has_tokenizer:
            command.append("--skip-tokenizer-init")
        servers.append(
            DecodeServer(f"decode-{i}", f"http://127.0.0.1:{port}", command + extra, dict(env))
        )
    return servers
