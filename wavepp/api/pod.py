"""What the operator's pods and the processes in them agree on, beside the spec: where a
gateway pod finds a tenant's API keys, where a stage pod serves KV transfers to decode pods, and how long before its grace period an admission ends
its drain. The operator renders these; ``wavepp.launch`` (the processes' configuration, and
``wavepp up`` standing in for the pods) reads them.
"""

from __future__ import annotations

API_KEYS_DIR = "/etc/wavepp-keys"  # gateway only: {API_KEYS_DIR}/{tenant}/keys, a Secret each
API_KEYS_ENTRY = "keys"  # the entry of a tenant's apiKeySecret that lists its keys

HANDOFF_PORT = 8082
"""A stage pod's KV transfer (handoff) port: with a ``decode`` section its stage listens on
``0.0.0.0:HANDOFF_PORT`` and advertises ``$POD_IP_ENV`` (``wavepp.api.kv_handoff``'s protocol)."""

POD_IP_ENV = "POD_IP"
"""The stage pod's IP (downward API ``status.podIP``): the host decode pods pull KV from."""

DRAIN_EXIT_MARGIN_S = 5.0
"""Seconds: an admission pod's grace period is ``rollout.drainTimeoutSeconds``; its drain
(serving what its intake holds after SIGTERM) ends this much earlier, leaving time to answer
and exit cleanly."""


def api_keys_path(tenant: str) -> str:
    """Where the gateway reads ``tenant``'s keys: its ``apiKeySecret``'s mount."""
    return f"{API_KEYS_DIR}/{tenant}/{API_KEYS_ENTRY}"
