"""A small GatewayConfig for tests that start a gateway or its server without a spec."""

from __future__ import annotations

from typing import Any

from wavepp.gateway.config import GatewayConfig, ReplicaInfo
from wavepp.gateway.tenants import TenantPolicy


def tiny_gateway_config(**overrides: Any) -> GatewayConfig:
    """One two-stage replica ``p-r0`` of pool ``p`` serving tiny-llama (block 16, vocab 1000,
    prompts up to 64 tokens) to the tenant ``default``; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "pool": "p",
        "replicas": [ReplicaInfo(pipeline="p-r0", num_stages=2)],
        "model_name": "tiny-llama",
        "model_id": "tiny-llama",
        "block_size": 16,
        "vocab_size": 1000,
        "max_prompt_tokens": 64,
        "tenants": [TenantPolicy(name="default", cache_salt="s")],
    }
    return GatewayConfig(**(fields | overrides))
