"""Starting a stage's tensor-parallel followers: one process per device inside the stage pod.

``wavepp stage`` with ``RuntimeConfig.tensor_parallel_size`` T > 1 (``--tensor-parallel-size``
or the spec's ``tensorParallelSize``) is TP rank 0, the leader. It hosts a loopback ``TCPStore``
on a free port, starts T - 1 followers (``python -m wavepp.runtime.stage.tp_launch``, the
RuntimeConfig JSON on their stdin), and all T form the stage's TP group over it (gloo on the
CPU, NCCL on ``cuda:t``, one GPU per process). A follower builds its shard of the stage's engine
and serves the leader's broadcasts (``engine.tensor_parallel.serve_follower``); it exits when
the leader does (it watches its parent) or when the group fails. The leader stops the stage
when a follower exits (``FollowerWatch``), so the pod restarts whole.

The store has no authentication and any local process can reach a loopback port. The group's
keys are under ``wavepp/{secret}/tp/`` (``storekey.store_prefix`` of the pipeline, the stage rank
and the store's port, so a new one per start) and its values are tagged on the CPU
(``storekey.SignedStore``): a local process without the key cannot write junk under them ahead
of the followers, have junk read as a peer's address, nor take a follower's seat (its address
would carry no valid tag). The key is the deployment's bus key, or without one (an insecure
deployment) a fresh random key per launch (:func:`tp_key`): the leader starts its followers, so
it needs no one else's. The leader hands the key to the followers in their environment
(``WAVEPP_BUS_KEY``; never on the command line, which any local user can read).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from wavepp.api.signing import BusKey
from wavepp.runtime.config import RuntimeConfig
from wavepp.runtime.procs import stop_processes
from wavepp.runtime.stage.engine.tensor_parallel import TPGroup, serve_follower, tp_device
from wavepp.runtime.stage.storekey import guarded_store, store_prefix
from wavepp.runtime.transport.buskey import BUS_KEY_ENV, BUS_KEY_FILE_ENV

log = logging.getLogger(__name__)


def tp_prefix(bus_key: BusKey | None, pipeline: str, stage_rank: int, port: int) -> str:
    """The TP group's key prefix in the leader's store on ``port`` (pure):
    ``wavepp/{secret}/tp/`` with a bus key, ``wavepp/tp/`` without one."""
    return store_prefix(bus_key, pipeline, f"tp/{stage_rank}/{port}", "tp")


def tp_key(bus_key: BusKey | None) -> BusKey:
    """The key of one launch's TP store (its namespace and tags): the deployment's bus key, or
    without one a fresh random 32-byte key (``secrets.token_bytes``) that only the leader and
    the followers it starts hold."""
    return bus_key if bus_key is not None else BusKey(secrets.token_bytes(32))


def _process_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` from ``/proc/{pid}/stat``; None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ...: comm may hold spaces and parentheses; the state follows the last ')'
    rest = stat[stat.rfind(")") + 1 :].split()
    return rest[0] if rest else None


def _loopback_store(size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The leader's store on 127.0.0.1 and a free port: listening on loopback only (torch's
    store has no authentication; the followers are in the same pod)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    return dist.TCPStore(
        "127.0.0.1",
        port,
        size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )


def follower_env(environ: dict[str, str], bus_key: BusKey | None) -> dict[str, str]:
    """A follower's environment: ``environ`` with the leader's pid and exactly the leader's bus
    key in ``WAVEPP_BUS_KEY`` (none when it has none; ``WAVEPP_BUS_KEY_FILE`` dropped), so both
    name the same :func:`tp_prefix`."""
    env = environ | {"WAVEPP_TP_PARENT_PID": str(os.getpid())}
    env.pop(BUS_KEY_FILE_ENV, None)
    env.pop(BUS_KEY_ENV, None)
    if bus_key is not None:
        env[BUS_KEY_ENV] = bus_key.hex()
    return env


def form_tp_group(
    store: dist.TCPStore,
    tp_rank: int,
    size: int,
    device: str,
    timeout: datetime.timedelta,
    bus_key: BusKey | None = None,
    pipeline: str = "",
    stage_rank: int = 0,
) -> TPGroup:
    """This process's TPGroup over ``store`` (the leader's, on ``store.port``): its keys under
    :func:`tp_prefix`, its values tagged (``storekey.SignedStore``) with a bus key on the CPU
    (gloo; NCCL's store values stay untagged, see docs/reliability.md); every TP
    rank must be given the same key, pipeline and stage rank. Blocks until all ``size`` ranks
    joined."""
    prefix = tp_prefix(bus_key, pipeline, stage_rank, store.port)
    tag_key = None if device.startswith("cuda") else bus_key  # gloo only, as in rendezvous
    prefixed = dist.PrefixStore(prefix, guarded_store(store, tag_key, timeout))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        pg: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, tp_rank, size)
    else:
        pg = dist.ProcessGroupGloo(prefixed, tp_rank, size, timeout)
    return TPGroup(rank=tp_rank, size=size, pg=pg, device=device)


class FollowerSet:
    """The leader's followers (processes) and its TPGroup."""

    def __init__(self, tp: TPGroup, procs: list[subprocess.Popen[bytes]], store: dist.Store):
        self.tp = tp
        self.procs = procs
        self._store = store  # NOTE: the followers' group lives on it: keep it for the stage's life

    def exited(self) -> list[tuple[int, int]]:
        """``(tp_rank, exit code)`` of each follower that has exited."""
        return [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]

    def stopped(self) -> list[int]:
        """TP ranks of the followers that are stopped (SIGSTOP, a debugger): state ``T`` or
        ``t`` in ``/proc/{pid}/stat`` (Linux; elsewhere none is reported). Such a follower
        blocks every collective of the group until its timeout."""
        ranks = []
        for i, p in enumerate(self.procs):
            if p.poll() is None and _process_state(p.pid) in ("T", "t"):
                ranks.append(i + 1)
        return ranks

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the followers (then kill those still there after ``timeout_s``)."""
        stop_processes(self.procs, timeout_s)


def start_followers(
    config: RuntimeConfig, rank: int, timeout_s: float = 120.0, *, bus_key: BusKey | None = None
) -> FollowerSet:
    """Start stage ``rank``'s T - 1 followers and form the TP group (the caller is TP rank 0).

    ``bus_key``: the deployment's (``load_bus_key``), None in an insecure deployment; the
    group's keys go under :func:`tp_prefix` of :func:`tp_key` of it (a fresh random key
    without one), and the followers get that key in their environment. Blocking: call from a
    thread.

    Raises:
        RuntimeError: a follower did not join within ``timeout_s`` (or exited).
    """
    size = config.tensor_parallel_size
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _loopback_store(size, timeout)
    payload = config.model_dump_json().encode()
    procs = []
    key = tp_key(bus_key)
    env = follower_env(dict(os.environ), key)
    for tp_rank in range(1, size):
        command = [sys.executable, "-m", "wavepp.runtime.stage.tp_launch"]
        command += ["--stage-rank", str(rank), "--tp-rank", str(tp_rank)]
        command += ["--port", str(store.port)]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        procs.append(proc)
    log.info("stage %d: started %d tensor-parallel followers", rank, len(procs))
    try:
        device = tp_device(config.device, 0)
        tp = form_tp_group(store, 0, size, device, timeout, key, config.pipeline, rank)
    except Exception:
        FollowerSet(TPGroup(), procs, store).stop()
        raise
    return FollowerSet(tp, procs, store)


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-leader", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """A follower process: the RuntimeConfig JSON on stdin; serves until the leader stops."""
    parser = argparse.ArgumentParser(prog="wavepp-tp-follower")
    parser.add_argument("--stage-rank", type=int, required=True)
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    parent = os.environ.get("WAVEPP_TP_PARENT_PID", "")
    if parent.isdigit():
        _exit_with_parent(int(parent))
    config = RuntimeConfig.model_validate_json(sys.stdin.buffer.read())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s stage{args.stage_rank}.tp{args.tp_rank} %(levelname)s: %(message)s",
    )
    torch.set_num_threads(config.torch_threads)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", args.port, size, False, timeout=timeout)
    device = tp_device(config.device, args.tp_rank)
    key_hex = os.environ.get(BUS_KEY_ENV, "")  # the leader's tp_key (start_followers)
    bus_key = BusKey.from_hex(key_hex) if key_hex else None
    tp = form_tp_group(
        store, args.tp_rank, size, device, timeout, bus_key, config.pipeline, args.stage_rank
    )
    from wavepp.runtime.stage.build import build_engine

    engine = build_engine(config, args.stage_rank, tp)
    log.info("follower ready: %s", device)
    served = serve_follower(engine, tp)
    log.info("follower leaves after %d micro-batches", served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
