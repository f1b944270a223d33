"""The decode side of ``wavepp up``: running decode servers (``--decode-url URL``, repeatable)
and local vLLM decode instances (``--decode vllm``, ``--decode-replicas N``) started with
WavePP's KV connector.

A local decode instance is vLLM's OpenAI-compatible server in vLLM's own environment
(``--decode-python PY``: a Python where ``import vllm`` works; default this one), its command
line ``PY`` + ``wavepp.api.vllm_decode.vllm_decode_args`` (the one owner of it; the operator's
decode pool runs the same) on ``127.0.0.1``, with ``PYTHONPATH`` = the folder holding this
``wavepp`` package (the connector needs only the standard library, torch and vLLM) and, on CPU,
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, 1 unless set) and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (unless set): the model then runs in vLLM's engine-core
process (its uni-process executor) instead of a worker process of its own, which vLLM's CPU
platform would start and pin to cores (``OMP_PLACES``). One interpreter fewer to start, and the
instance's threads are not pinned to cores the local stages share; the server and its engine
core stay one process group, so stopping the group stops the engine. ``--decode-args "..."``
appends vLLM options (shell words) after these. ``plan_decode`` resolves the decode flags into the
servers to start and the endpoints the gateway sends to.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import wavepp
from wavepp.api.vllm_decode import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_GIB,
    TOKENIZER_FILES,
    vllm_decode_args,
    vllm_tracing,
)
from wavepp.launch.flags import FlagError
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.transport.natsio import free_port

CPU_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch between a worker process per model replica (1) and the model in its
engine-core process (0); a local CPU instance gets 0 unless its environment says otherwise."""


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
        env.setdefault(CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB)
        env.setdefault(CPU_MULTIPROCESSING_ENV, "0")
    has_tokenizer = any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES)
    servers = []
    for i, port in enumerate(ports):
        command = [python] + vllm_decode_args(
            model_dir=model_dir,
            model_name=model_name,
            host="127.0.0.1",
            port=port,
            dtype=dtype,
            max_model_len=max_model_len,
            on_cpu=on_cpu,
            has_tokenizer=has_tokenizer,
        )
        servers.append(
            DecodeServer(f"decode-{i}", f"http://127.0.0.1:{port}", command + extra, dict(env))
        )
    return servers


_URL = re.compile(r"^https?://[^/\s]+/?$")


def plan_decode(
    args: argparse.Namespace, first: RuntimeConfig, on_cpu: bool
) -> tuple[list[DecodeServer], list[str]]:
    """The decode side from ``--decode``, ``--decode-url``, ``--decode-python``,
    ``--decode-replicas``, ``--decode-args`` and ``--decode-max-tokens`` (``launch.decode``):
    (local instances to start, every endpoint URL). With an OTLP exporter in the replicas'
    telemetry (``spec.telemetry.otlpEndpoint``) the local instances export their request spans
    to the same endpoint (``vllm_decode.vllm_tracing``; before ``--decode-args``, which may
    override it).

    Raises:
        FlagError: a ``--decode-url`` that is not ``http(s)://host:port``; ``--decode vllm``
            without a checkpoint directory (``--model DIR`` or ``model.path``), with
            ``--decode-replicas`` < 1, or with a ``--decode-python`` where vllm is not
            importable; ``--decode-max-tokens`` < 2.
    """
    for url in args.decode_url:
        if not _URL.match(url):
            raise FlagError("--decode-url", f"{url!r}: must be http(s)://HOST:PORT")
    if args.decode_max_tokens < 2:
        raise FlagError("--decode-max-tokens", f"{args.decode_max_tokens}: must be >= 2")
    servers: list[DecodeServer] = []
    if args.decode == "vllm":
        if not first.model_dir:
            raise FlagError(
                "--decode", "vllm needs the served checkpoint's directory: give --model DIR"
            )
        if args.decode_replicas < 1:
            raise FlagError("--decode-replicas", f"{args.decode_replicas}: must be >= 1")
        python = args.decode_python or sys.executable
        check_vllm_python(python)
        # the replicas' OTLP endpoint: vLLM's request spans join the gateway's traces there
        trace_args, trace_env = vllm_tracing(first.telemetry.exporter, first.telemetry.endpoint)
        servers = decode_servers(
            python=python,
            model_dir=first.model_dir,
            model_name=first.model.name,
            dtype=first.model.dtype,
            max_model_len=first.model.max_position,
            ports=[free_port() for _ in range(args.decode_replicas)],
            on_cpu=on_cpu,
            extra_args=f"{shlex.join(trace_args)} {args.decode_args}".strip(),
            environ={**os.environ, **trace_env},
        )
    elif args.decode_python or args.decode_args:
        flag = "--decode-python" if args.decode_python else "--decode-args"
        raise FlagError(flag, "applies to --decode vllm only")
    return servers, [s.url for s in servers] + [u.rstrip("/") for u in args.decode_url]
