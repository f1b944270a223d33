"""What the gateway believes of the bus: heartbeats, results, stored results, KV events (pure).

The gateway acts on four kinds of message from the replicas; a client of the NATS server could
publish any of them. ``BusGuard`` decides, per message, whether it is one the replica sent:

| message                   | accepted when                                                       |
| ------------------------- | ------------------------------------------------------------------- |
| ``Heartbeat``             | on its replica's subject, naming that replica; with a bus key: its   |
|                           | tag checks with the replica's key, its ``seq`` is above the last     |
|                           | accepted one of its instance and ``sent_at_s`` is within             |
|                           | ``max_heartbeat_age_s`` of now; and at most one per                  |
|                           | ``min_heartbeat_interval_s`` per replica (rate limit, always), save  |
|                           | the first ``draining`` beat after a beat that was not: a drain's     |
|                           | first beat is never lost to beats bunched in transit                |
| ``PrefillResult`` (subj.) | for a replica this request was routed to; with a key, signed by it   |
| ``PrefillResult`` (store) | for this key, by a replica of the pool; with a key, signed by it     |
| ``KVEventBatch``          | a rank of the replica; with a key, signed by the replica             |

A replica not configured joins at run time (``add_replica``) only on a heartbeat naming it that,
with a bus key, carries its replica's tag: an unsigned beat adds nothing. At most ``max_added``
such replicas are known at once; ``forget_replica`` drops one with its state (the gateway does so
when it forgets the replica). Names are bounded by ``Heartbeat``'s own limits.

Without a bus key (an insecure deployment) tags, sequence numbers and ages are not checked; the
rate limit, the routing checks and the bound on added replicas still are. Refusals are counted per kind (``num_refused``).
No I/O; the clock is passed in.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable

from wavepp.api.messages import KVEventBatch
from wavepp.api.prefill import Heartbeat, PrefillResult
from wavepp.api.signing import BusKey

_INSTANCES_KEPT = 8  # per replica: the last instances whose heartbeat numbers are remembered


class BusGuard:
    """See the module docstring.

    Args:
        bus_key: the deployment's bus key (each replica's is derived); None: insecure mode.
        replicas: the pool's replica names.
        min_heartbeat_interval_s: at most one heartbeat per replica is accepted this often
            (the admission service sends one every 0.5 s), seconds > 0.
        max_heartbeat_age_s: a signed heartbeat stamped further than this from now (wall clock,
            either way) is refused: a repeated one cannot keep a dead replica routed. Seconds
            > 0; covers clock skew between hosts.
        max_added: replicas beyond ``replicas`` known at once (the gateway's ``max_replicas``).

    Raises:
        ValueError: a bound not > 0.
    """

    def __init__(
        self,
        bus_key: BusKey | None,
        replicas: Iterable[str],
        *,
        min_heartbeat_interval_s: float = 0.1,
        max_heartbeat_age_s: float = 30.0,
        max_added: int = 256,
    ) -> None:
        if not min_heartbeat_interval_s > 0:
            raise ValueError(f"min_heartbeat_interval_s={min_heartbeat_interval_s}: must be > 0")
        if not max_heartbeat_age_s > 0:
            raise ValueError(f"max_heartbeat_age_s={max_heartbeat_age_s}: must be > 0")
        self.replicas = list(replicas)
        self._configured = frozenset(self.replicas)
        self.max_added = max_added
        self._bus_key = bus_key
        self._keys = {
            name: None if bus_key is None else bus_key.for_replica(name) for name in self.replicas
        }
        self.min_heartbeat_interval_s = min_heartbeat_interval_s
        self.max_heartbeat_age_s = max_heartbeat_age_s
        self._last_beat_s: dict[str, float] = {}
        # Whether each replica's last accepted beat said draining (the rate limit's one
        # exception; a sender alternating states gets at most two beats per interval).
        self._draining: dict[str, bool] = {}
        self._seqs: dict[str, OrderedDict[str, int]] = {name: OrderedDict() for name in replicas}
        self.num_refused: Counter[str] = Counter()

    def add_replica(self, name: str, beat: Heartbeat) -> bool:
        """Know replica ``name`` (one that joined the pool at run time) on ``beat``, a heartbeat
        naming it: with a bus key only when the beat carries the tag of ``name``'s key (derived
        like the configured ones'), so only a holder of the bus key can add a replica; and
        while fewer than ``max_added`` replicas were added (and not forgotten). A refused beat
        leaves nothing behind (counted in ``num_refused["heartbeat_unknown"]``).

        Returns:
            whether ``name`` is known now (a configured or already added one: True).
        """
        if name in self._keys:
            return True
        key = None if self._bus_key is None else self._bus_key.for_replica(name)
        if (
            beat.pipeline != name
            or len(self._keys) - len(self._configured) >= self.max_added
            or (key is not None and not key.verify(beat))
        ):
            self.num_refused["heartbeat_unknown"] += 1
            return False
        self.replicas.append(name)
        self._keys[name] = key
        self._seqs[name] = OrderedDict()
        return True

    def forget_replica(self, name: str) -> None:
        """Drop an added replica and its state (heartbeat numbers, rate limit); configured
        replicas and unknown names are left as they are."""
        if name in self._configured or name not in self._keys:
            return
        self.replicas.remove(name)
        del self._keys[name], self._seqs[name]
        self._last_beat_s.pop(name, None)
        self._draining.pop(name, None)

    def _authentic(self, replica: str, msg: Heartbeat | PrefillResult | KVEventBatch) -> bool:
        if replica not in self._keys:
            return False
        key = self._keys[replica]
        return key is None or key.verify(msg)

    def heartbeat(self, replica: str, beat: Heartbeat, now_s: float, wall_s: float) -> bool:
        """Whether to act on ``beat``, received on ``replica``'s heartbeat subject.

        Args:
            now_s: monotonic seconds (the rate limit).
            wall_s: wall-clock seconds (``time.time()``; the age of a signed heartbeat).
        """
        if beat.pipeline != replica or not self._authentic(replica, beat):
            self.num_refused["heartbeat"] += 1
            return False
        if self._keys[replica] is not None:
            seqs = self._seqs[replica]
            last = seqs.get(beat.instance)
            if (last is not None and beat.seq <= last) or abs(
                wall_s - beat.sent_at_s
            ) > self.max_heartbeat_age_s:
                self.num_refused["heartbeat_repeated"] += 1
                return False
        last_s = self._last_beat_s.get(replica)
        starts_drain = beat.draining and not self._draining.get(replica, False)
        if (
            last_s is not None
            and now_s - last_s < self.min_heartbeat_interval_s
            and not starts_drain
        ):
            self.num_refused["heartbeat_rate"] += 1
            return False
        self._last_beat_s[replica] = now_s
        self._draining[replica] = beat.draining
        if self._keys[replica] is not None:
            seqs[beat.instance] = beat.seq
            seqs.move_to_end(beat.instance)
            while len(seqs) > _INSTANCES_KEPT:
                seqs.popitem(last=False)
        return True

    def result(self, result: PrefillResult, routed: Collection[str]) -> bool:
        """Whether ``result`` (from the result subject) answers a request routed to
        ``routed`` (the replicas its intake was published to)."""
        if result.replica not in routed or not self._authentic(result.replica, result):
            self.num_refused["result"] += 1
            return False
        return True

    def stored(self, key: str, result: PrefillResult) -> bool:
        """Whether a results-bucket entry under ``key`` (``{tenant}.{request_id}``) is one a
        replica of the pool stored."""
        if f"{result.tenant}.{result.request_id}" != key or not self._authentic(
            result.replica, result
        ):
            self.num_refused["stored_result"] += 1
            return False
        return True

    def kv_events(self, replica: str, batch: KVEventBatch, num_stages: int) -> bool:
        """Whether to apply ``batch``, received on ``replica``'s KV event subject."""
        if not 0 <= batch.rank < num_stages or not self._authentic(replica, batch):
            self.num_refused["kv_events"] += 1
            return False
        return True
