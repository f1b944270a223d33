"""WavePP against vLLM on the same checkpoint and prompts, side by side.

Both servers serve one random-weight Hugging Face Llama checkpoint (``CHECKPOINT_SHAPE``:
hidden 512, 8 layers, 8 heads, 2 KV heads, float32; made in ``--work-dir`` unless ``--model``
names one) on 2 pipeline stages with prefix caching and KV blocks of 32 tokens:

- vLLM's OpenAI server from its own environment (``--vllm-python``, made by
  ``scripts/vllm-venv.sh``): ``--pipeline-parallel-size 2 --enable-prefix-caching --block-size 32
  --dtype float32``, ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-cache-gib``, one core per stage
  (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), its default batched-token budget;
- ``wavepp up --model DIR --stages 2`` with ``cache.blockSize`` 32, ``engineOptions.kvBlocks`` =
  vLLM's KV capacity per stage in blocks (read from vLLM's ``/metrics``, else computed by
  ``kv_capacity_tokens``) and ``--max-outstanding`` = the largest concurrency (a closed-loop
  client at C never has more than C requests out, so any cap >= C leaves it unthrottled).

Prompts: the first ``--requests`` requests of the Mooncake trace, ``--tokens-per-block`` (16)
tokens per trace block (``wavepp.bench.trace.TokenMapper``). Each (concurrency, repeat) round
draws its tokens with its own seed, so a round never finds the previous round's prompts in
either cache: what is cached is the trace's own prefix reuse within the round.

One closed-loop HTTP client at concurrency C (the next request starts when one ends) sends
``POST /v1/completions`` with the token-id prompt, ``max_tokens`` 1, ``temperature`` 0 (greedy),
alternating the servers (vLLM first on even repeats, WavePP first on odd ones). Server start-up
and a short warm-up are not timed. Per concurrency it prints both throughputs (prompt tokens,
cached and new, per second of wall time from the first request to the last answer; the median of
the repeats), their ratio WavePP / vLLM, TTFT p50/p99 (request latency: one output token), the
cached fraction (``usage.prompt_tokens_details.cached_tokens`` over prompt tokens) and the
first-token mismatches between the servers (prompts whose greedy first token is not the same in
both servers' runs of a round, summed over the rounds; 0 expected with float32). With ``--json``
the last line is one JSON object (``report_json``).

    scripts/vllm-venv.sh
    python benchmarks/vs_vllm.py --concurrency 8,32 --requests 300 --repeats 2 --json

This is a benchmark, not a test: it measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vs_vllm_stats import (
    SERVERS,
    RunResult,
    kv_capacity_tokens,
    parse_concurrency,
    report_json,
    round_seed,
    summarize,
    table_lines,
    trace_prompts,
    vllm_num_blocks,
)

from wavepp.bench.signals import exit_on_sigterm
from wavepp.bench.vllm_args import add_vllm_args, missing_vllm

BLOCK_SIZE = 32
"""Tokens per KV block in both servers (vLLM's CPU attention needs a multiple of 32)."""
STAGES = 2
CHECKPOINT_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
FLOAT32_BYTES = 4


def make_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write (once) the random-weight float32 Llama checkpoint of ``CHECKPOINT_SHAPE``."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**CHECKPOINT_SHAPE, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out_dir))
    return out_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, urllib.error.URLError):
        return 0, ""


@dataclass
class Server:
    """A server process in its own process group, its log and its base URL."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    ready_path: str
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    model: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        """Start and wait until ``ready_path`` answers 200 and ``/v1/models`` names the model.
        Raises RuntimeError (with the log's tail) when it exits or is not ready in time."""
        began = time.monotonic()
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() - began > timeout_s:
                raise RuntimeError(f"{self.name} not ready in {timeout_s} s:\n{self.tail()}")
            status, _ = _get(self.url + self.ready_path)
            if status == 200:
                status, body = _get(self.url + "/v1/models")
                if status == 200:
                    self.model = json.loads(body)["data"][0]["id"]
                    break
            time.sleep(1.0)
        self.startup_s = time.monotonic() - began

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT (both servers drain on it), then SIGTERM and SIGKILL to the process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # NOTE: children left in the group once the leader exits (vLLM's workers) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def vllm_server(args: argparse.Namespace, model_dir: Path, work: Path) -> Server:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
    }
    port = free_port()
    argv = [
        str(args.vllm_python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--served-model-name", "vs-vllm", "--host", "127.0.0.1", "--port", str(port)),
        *("--pipeline-parallel-size", str(STAGES), "--enable-prefix-caching"),
        *("--block-size", str(BLOCK_SIZE), "--dtype", "float32", "--skip-tokenizer-init"),
        "--enable-prompt-tokens-details",
        *("--max-model-len", str(CHECKPOINT_SHAPE["max_position_embeddings"])),
        *("--gpu-memory-utilization", str(args.vllm_memory_utilization)),
    ]
    return Server("vllm", argv, env, port, work / "vllm.log", "/health")


def wavepp_server(
    args: argparse.Namespace, model_dir: Path, work: Path, kv_blocks: int, max_outstanding: int
) -> Server:
    spec = {
        "model": {"name": "vs-vllm", "dtype": "float32"},
        "stages": STAGES,
        "replicas": 1,
        "engine": "torch",
        "cache": {"blockSize": BLOCK_SIZE},
        "engineOptions": {"kvBlocks": kv_blocks},
    }
    spec_path = work / "wavepp-spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    port = free_port()
    argv = [
        *(sys.executable, "-m", "wavepp.cli", "up", "--config", str(spec_path)),
        *("--model", str(model_dir), "--stages", str(STAGES), "--port", str(port)),
        *("--max-outstanding", str(max_outstanding), "--state-dir", str(work / "wavepp-state")),
    ]
    return Server("wavepp", argv, dict(os.environ), port, work / "wavepp.log", "/readyz")


async def drive(
    server: Server, prompts: list[list[int]], concurrency: int, repeat: int, timeout_s: float
) -> RunResult:
    """One closed-loop client at ``concurrency`` over ``prompts`` (in order) against
    ``server``'s ``/v1/completions``; returns what it measured."""
    import aiohttp

    n = len(prompts)
    ttfts = [float("nan")] * n
    tokens: list[int | None] = [None] * n
    cached: list[int | None] = [None] * n
    ok = [False] * n
    errors: list[str] = []
    next_index = iter(range(n))
    url = server.url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in next_index:
            body = {
                "model": server.model,
                "prompt": prompts[i],
                "max_tokens": 1,
                "temperature": 0.0,
                "return_token_ids": True,
            }
            sent = time.monotonic()
            try:
                async with session.post(url, json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        errors.append(f"HTTP {resp.status}: {text[:300]}")
                        continue
                answer = json.loads(text)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            ttfts[i] = time.monotonic() - sent
            ok[i] = True
            token_ids = answer["choices"][0].get("token_ids") or [None]
            tokens[i] = token_ids[0]
            details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
            cached[i] = details.get("cached_tokens")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall_s = time.monotonic() - began
    done = [i for i in range(n) if ok[i]]
    reported = all(cached[i] is not None for i in done) and bool(done)
    return RunResult(
        server=server.name,
        concurrency=concurrency,
        repeat=repeat,
        wall_s=wall_s,
        prompt_tokens=sum(len(prompts[i]) for i in done),
        cached_tokens=sum(cached[i] or 0 for i in done) if reported else None,
        ttfts_s=ttfts,
        first_tokens=tokens,
        errors=len(errors),
        first_error=errors[0] if errors else "",
    )


def _progress(message: str) -> None:
    print(f"vs_vllm: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    concurrencies = parse_concurrency(args.concurrency)
    if args.requests < 1 or args.repeats < 1:
        raise ValueError("--requests and --repeats must be >= 1")
    if missing := missing_vllm(args):
        _progress(missing)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else make_checkpoint(work / "checkpoint")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    warmup = trace_prompts(
        args.trace, args.warmup, tokens_per_block=args.tokens_per_block, vocab_size=vocab, seed=0
    )
    rounds = {
        (ci, rep): trace_prompts(
            args.trace,
            args.requests,
            tokens_per_block=args.tokens_per_block,
            vocab_size=vocab,
            seed=round_seed(ci, rep, args.repeats),
        )
        for ci in range(len(concurrencies))
        for rep in range(args.repeats)
    }
    first = rounds[(0, 0)]
    vllm = vllm_server(args, model_dir, work)
    servers: dict[str, Server] = {"vllm": vllm}
    runs: list[RunResult] = []
    try:
        _progress(f"starting vLLM (log {vllm.log_path})")
        vllm.start(args.startup_timeout_s)
        _progress(f"vLLM ready in {vllm.startup_s:.1f} s")
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        computed = kv_capacity_tokens(
            int(args.kv_cache_gib * 2**30),
            layers_per_stage=-(-config["num_hidden_layers"] // STAGES),
            kv_heads=config["num_key_value_heads"],
            head_dim=head_dim,
            dtype_bytes=FLOAT32_BYTES,
        )
        from_metrics = vllm_num_blocks(_get(vllm.url + "/metrics")[1])
        kv_blocks = from_metrics or computed // BLOCK_SIZE
        wavepp = wavepp_server(args, model_dir, work, kv_blocks, max(concurrencies))
        servers["wavepp"] = wavepp
        _progress(f"starting WavePP with {kv_blocks} KV blocks per stage (log {wavepp.log_path})")
        wavepp.start(args.startup_timeout_s)
        _progress(f"WavePP ready in {wavepp.startup_s:.1f} s")
        for server in servers.values():
            asyncio.run(drive(server, warmup, min(concurrencies), -1, args.request_timeout_s))
        for ci, c in enumerate(concurrencies):
            for rep in range(args.repeats):
                order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
                for name in order:
                    result = asyncio.run(
                        drive(servers[name], rounds[(ci, rep)], c, rep, args.request_timeout_s)
                    )
                    runs.append(result)
                    _progress(
                        f"C={c} repeat {rep} {name}: {result.tokens_per_s:,.0f} tokens/s, "
                        f"{result.wall_s:.1f} s, {result.errors} errors "
                        f"{result.first_error[:200]}".rstrip()
                    )
    finally:
        for server in servers.values():
            server.stop()
    rows = summarize(runs)
    setup = {
        "model": str(model_dir),
        "checkpoint": {k: config.get(k) for k in CHECKPOINT_SHAPE} | {"dtype": "float32"},
        "trace": str(args.trace),
        "requests": len(first),
        "prompt_tokens": sum(len(p) for p in first),
        "tokens_per_block": args.tokens_per_block,
        "concurrency": concurrencies,
        "repeats": args.repeats,
        "stages": STAGES,
        "block_size": BLOCK_SIZE,
        "kv_blocks_per_stage": kv_blocks,
        "kv_blocks_source": "vllm metrics" if from_metrics else "computed",
        "kv_cache_gib": args.kv_cache_gib,
        "wavepp_max_outstanding": max(concurrencies),
        "startup_s": {"vllm": round(vllm.startup_s, 1), "wavepp": round(wavepp.startup_s, 1)},
    }
    print(
        f"WavePP vs vLLM: {setup['requests']} prompts, {setup['prompt_tokens']:,} prompt tokens "
        f"({args.tokens_per_block} per trace block), {args.repeats} repeat(s) alternated; "
        f"{STAGES} stages, KV {kv_blocks} x {BLOCK_SIZE} tokens per stage; start-up vLLM "
        f"{vllm.startup_s:.1f} s, WavePP {wavepp.startup_s:.1f} s (not timed)"
    )
    print("\n".join(table_lines(rows)))
    if args.json:
        print(json.dumps(report_json(rows, setup, runs)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--concurrency", default="8,32", help="closed-loop concurrencies")
    parser.add_argument("--requests", type=int, default=300, help="first N trace requests")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server and concurrency")
    add_vllm_args(parser, startup_timeout_s=1800.0)
    parser.add_argument("--warmup", type=int, default=8, help="untimed prompts per server")
    parser.add_argument("--model", help="checkpoint directory (default: make one in --work-dir)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-threads-bind", default="0|1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--vllm-memory-utilization", type=float, default=0.3)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_sigterm()  # a killed run stops both servers (``run``'s finally)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        _progress(str(exc))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
