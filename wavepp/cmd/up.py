"""``wavepp up``: the whole service on this machine, as processes.

Starts an embedded nats-server with JetStream, then for each replica of the spec S ``wavepp
stage`` processes and one ``wavepp admission``, then one ``wavepp gateway``; waits until the
gateway's ``/readyz`` answers 200, prints ``wavepp up: serving http://HOST:PORT ...`` and
supervises: a gateway or admission process that dies is restarted (its requests are in
JetStream); a stage that dies once serving is restarted with the same arguments, as a kubelet
would, and its replica re-forms its group in place (``stage.rendezvous``) while the other
replicas serve (the gateway routes around it); a stage that dies during startup, or more than
``--max-stage-restarts`` times, stops everything (exit 1). Ctrl-C or SIGTERM stops all children
(gateway, admissions, stages: SIGTERM, wait, kill) and the nats-server, and exits 0; an
admission drains for ``spec.rollout.drainTimeoutSeconds`` less the operator's margin and is
killed only after that (``launch.up.drain_times``). Spec fields only the operator applies are
named in one warning line each at start (``launch.up.operator_only_warnings``); metrics servers
bind ``--host`` as the gateway does.

``--config FILE`` is a WavePipeline spec in YAML or JSON (the custom resource's ``spec``, or the
whole resource); without it, tiny-llama on 2 torch stages. ``--model DIR`` serves a Hugging
Face checkpoint directory and ``--stages S`` sets the stage count, with or without ``--config``
(``wavepp.launch.up``: the spec, the host's GPUs, ``spec.telemetry``: a stated ``metricsPort``
P serves replica i's admission metrics on port P + i and each stage's own on the ports after
those (``launch.up.stage_metrics_port``); the gateway's series are on its own ``/metrics``). A
checkpoint's ``tokenizer.json`` is the gateway's tokenizer unless
``--tokenizer`` names another. ``STATE_DIR/processes.json`` lists
the endpoints,
the child pids and each component's NATS credentials file (for tests and operators),
``STATE_DIR/logs/`` (or ``--log-dir``) their output and the nats-server's.

The bus is authenticated by default: at every start, fresh keys in ``STATE_DIR/nats-auth/``
(mode 0700): a nats-server config that trusts only them, and one ``.creds`` per component with
only its own subjects (``wavepp.api.permissions``); anonymous clients are refused.
``--insecure-nats`` turns that off for debugging, with a warning at start and in the serving
line. The nats-server is watched (``runtime.serving.nats_watchdog``): restarted when it exits
or disabled JetStream (a full disk) and space came back; failed restarts are retried with a
backoff; after 60 s of them up stops (one line, exit 1). ``--jetstream-dir``/``-max-bytes``: store.

This module parses the flags; ``wavepp.launch.up_run.run_up`` runs it: what to run is resolved
by ``wavepp.launch.up.plan_up`` and the children are supervised by
``runtime.serving.processes.Supervisor``.
"""

from __future__ import annotations

import argparse

from wavepp.cmd.common import finite_float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="", help="WavePipeline spec (YAML or JSON)")
    parser.add_argument(
        "--model",
        default="",
        metavar="DIR",
        help="serve this Hugging Face checkpoint directory (config.json + safetensors; its "
        "tokenizer.json for text prompts), replacing the spec's model",
    )
    parser.add_argument(
        "--stages", type=int, default=None, help="pipeline stages S, replacing the spec's"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="T",
        help="processes computing each stage, one per device (spec.tensorParallelSize), "
        "replacing the spec's",
    )
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory per GPU for each stage's host KV tier (0: none), replacing the "
        "spec's cache.hostMemoryGiB",
    )
    parser.add_argument(
        "--planner-cost-model",
        default="",
        metavar="FILE",
        help="the chunk planner's CostModel JSON, e.g. one fitted for the served checkpoint by "
        "`wavepp calibrate --model DIR --out FILE` (default: the packaged CPU fit)",
    )
    parser.add_argument("--pool", default="default", help="pool name (NATS subjects, results)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    parser.add_argument(
        "--state-dir",
        default="",
        help="logs, configs, JetStream store (default: a fresh wavepp-up-* temporary folder)",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="local tokenizer path (for text prompts; without it, the checkpoint's tokenizer.json)",
    )
    parser.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default="prefix",
        help="which replica a request goes to",
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=8, help="requests per replica past the gateway"
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests queued or running in the gateway, all tenants; past it: 429",
    )
    parser.add_argument(
        "--tenant-max-concurrency", type=int, default=None, help="per tenant, queued or running"
    )
    parser.add_argument(
        "--tenant-tokens-per-s",
        type=finite_float,
        default=None,
        help="per tenant prompt-token rate",
    )
    parser.add_argument(
        "--tenant-limits",
        default="",
        help='JSON per tenant, e.g. {"acme": {"max_concurrency": 4, "tokens_per_s": 5000, '
        '"burst_tokens": 20000}}; overrides the two flags above',
    )
    parser.add_argument(
        "--ack-wait-s", type=finite_float, default=10.0, help="intake redelivery delay"
    )
    parser.add_argument(
        "--request-timeout-s",
        type=finite_float,
        default=120.0,
        help="a request unanswered this long: 504",
    )
    parser.add_argument(
        "--replica-timeout-s",
        type=finite_float,
        default=3.0,
        help="a replica without a heartbeat this long leaves the pool",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=finite_float,
        default=300.0,
        help="not serving this long after start: stop everything, exit 2",
    )
    parser.add_argument(
        "--log-dir",
        default="",
        help="the children's and nats-server's logs (default STATE_DIR/logs)",
    )
    parser.add_argument(
        "--jetstream-dir", default="", help="JetStream's store (default STATE_DIR/jetstream)"
    )
    parser.add_argument(
        "--jetstream-max-bytes",
        type=int,
        default=0,
        help="JetStream's disk limit in bytes (0: the server's default, from free space); also "
        "the NATS account's limit, which the gateway exports (wavepp_gateway_jetstream_store_*)",
    )
    parser.add_argument(
        "--insecure-nats",
        action="store_true",
        help="DEBUGGING ONLY: no NATS credentials; any local process may read every prompt and "
        "publish on every subject",
    )
    parser.add_argument(
        "--decode",
        choices=["vllm"],
        default=None,
        help="start local vLLM decode instances with WavePP's KV connector: /v1/completions "
        "then serves whole completions (prefill here, decode there)",
    )
    parser.add_argument(
        "--decode-url",
        action="append",
        default=[],
        metavar="URL",
        help="a running decode server (OpenAI-compatible vLLM with WavePP's connector as "
        "kv_consumer), e.g. http://10.0.0.5:8100; repeatable",
    )
    parser.add_argument(
        "--decode-python",
        default="",
        metavar="PY",
        help="the Python that runs vLLM for --decode vllm (e.g. a virtual environment's "
        "bin/python; default: this one)",
    )
    parser.add_argument(
        "--decode-replicas", type=int, default=1, help="local decode instances (--decode vllm)"
    )
    parser.add_argument(
        "--decode-args",
        default="",
        help='more vLLM server options for --decode vllm, as shell words (e.g. "--max-num-seqs 8")',
    )
    parser.add_argument(
        "--decode-max-tokens",
        type=int,
        default=4096,
        help="largest max_tokens of a decoded completion (with decode endpoints)",
    )
    parser.add_argument(
        "--max-stage-restarts",
        type=int,
        default=10,
        help="restarts of one stage process before wavepp up gives up (exit 1)",
    )


def run(args: argparse.Namespace) -> int:
    from wavepp.launch.up_run import run_up

    return run_up(args)
