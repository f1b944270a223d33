"""The Mooncake conversation trace shipped in the repository (data/traces/README.md)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "traces" / "conversation_trace.jsonl"
# Upstream's bytes: kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl.
TRACE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
TRACE_BYTES = 3_029_533
TRACE_RECORDS = 12_031
