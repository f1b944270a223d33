"""Stateful property test (hypothesis) of a stage's two KV tiers: the device ``BlockPool`` and
its ``HostTier``, driven through ``StageKVManager`` (probe, reserve, first chunk at a random
L*, compute, release, expiry) so that blocks spill, load, are pinned and released at random.

Asserted after every step:

- both tiers' structural invariants (``check_invariants``);
- exclusive tiers: no hash is indexed in both;
- each host slot's ref count equals the pins the live probed requests hold on it, and a
  pinned slot still holds the hash its probe found (pinned never evicted, never reused), or
  none once a failed log wrote it (then the plan that would load it is refused);
- each tier's events, replayed as set operations, give that tier's cached hash set;
- bytes: a model of every device block's and host slot's content, updated only by computing
  and by applying the transfer log in order when a plan takes it (as a stage's engine does
  before it runs the chunk): with what is pending applied, every hashed device block and
  indexed host slot holds the content of its hash, and every block a chunk treats as cached or
  loaded holds the content of its prompt's hash there (no plan reads wrong KV), also after the
  engine failed partway through a log (``BlockPool.discard_transfers``).

Not asserted: a prefix-closed set per tier. Loading moves a chain's prefix to the device while
its tail stays on the host (the hit is the device run and then the host run for that reason),
and LRU across requests may leave an unreachable tail, as in the device pool alone
(test_kvcache_properties.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wavepp.runtime.kv import BlockPool, HostTier, StageKVManager, Transfer, hash_prompt_blocks

_NUM_BLOCKS = 6
_NUM_SLOTS = 4
_BLOCK_SIZE = 2
_prompts = st.lists(st.integers(0, 1), min_size=1, max_size=4)


class _Request:
    def __init__(self, choices: list[int], expiry_s: float) -> None:
        self.token_ids = [t for c in choices for t in (c, 5)] + [9]  # a partial last block
        self.block_hashes = hash_prompt_blocks(self.token_ids, _BLOCK_SIZE, "m", "")
        self.num_total = -(-len(self.token_ids) // _BLOCK_SIZE)
        self.expiry_s = expiry_s
        self.host_slots: tuple[int, ...] = ()
        self.reserved = False
        self.started = False


class TwoTierMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.now_s = 0.0
        self.host = HostTier(_NUM_SLOTS)
        self.pool = BlockPool(_NUM_BLOCKS, _BLOCK_SIZE, host=self.host)
        self.manager = StageKVManager(self.pool, clock=lambda: self.now_s)
        self.requests: dict[str, _Request] = {}
        self.device_bytes: list[object] = [None] * _NUM_BLOCKS
        self.host_bytes: list[object] = [None] * _NUM_SLOTS
        self.shadow = {"device": set(), "host": set()}
        self.num_ids = 0
        self.num_loads = 0  # coverage, read by the test below
        self.num_refused_loads = 0

    def _copy(
        self,
        transfers: Sequence[Transfer],
        device: list[object] | None = None,
        host: list[object] | None = None,
    ) -> None:
        """Apply copies to the bytes model (this machine's, or the lists given)."""
        device = self.device_bytes if device is None else device
        host = self.host_bytes if host is None else host
        for transfer in transfers:
            if transfer.kind == "spill":
                host[transfer.slot] = device[transfer.block_id]
            else:
                device[transfer.block_id] = host[transfer.slot]

    def _pick(self, data: st.DataObject, **state: bool) -> str:
        ids = sorted(
            rid
            for rid, r in self.requests.items()
            if all(getattr(r, key) == value for key, value in state.items())
        )
        return data.draw(st.sampled_from(ids))

    def _has(self, **state: bool) -> bool:
        return any(
            all(getattr(r, key) == value for key, value in state.items())
            for r in self.requests.values()
        )

    @rule(choices=_prompts, lease_s=st.sampled_from([1.0, 3.0]))
    def probe(self, choices: list[int], lease_s: float) -> None:
        self._probe(choices, lease_s)

    def _probe(self, choices: list[int], lease_s: float) -> str:
        self.num_ids += 1
        request_id = f"r{self.num_ids}"
        request = _Request(choices, self.now_s + lease_s)
        device = self.pool.cached_block_hashes()
        hosted = self.host.cached_block_hashes()
        num_device = 0
        while num_device < len(request.block_hashes) and request.block_hashes[num_device] in device:
            num_device += 1
        num_host = 0
        while (
            num_device + num_host < len(request.block_hashes)
            and request.block_hashes[num_device + num_host] in hosted
        ):
            num_host += 1
        hit = self.manager.probe_pin(request_id, request.block_hashes, lease_s)
        assert hit == num_device + num_host
        assert self.manager.num_host_hit_blocks(request_id) == num_host
        request.host_slots = tuple(
            self.host.slot_of(h) for h in request.block_hashes[num_device : num_device + num_host]
        )
        self.requests[request_id] = request
        return request_id

    @precondition(lambda self: self._has(reserved=False))
    @rule(data=st.data())
    def reserve(self, data: st.DataObject) -> None:
        self._reserve(self._pick(data, reserved=False))

    def _reserve(self, request_id: str) -> bool:
        request = self.requests[request_id]
        table = self.manager.reserve(request_id, request.num_total, 1.0)
        if table is None:  # refused: nothing held, host pins included
            del self.requests[request_id]
            return False
        request.reserved = True
        request.expiry_s = self.now_s + 1.0
        return True

    @precondition(lambda self: self._has(reserved=True, started=False))
    @rule(data=st.data())
    def first_chunk(self, data: st.DataObject) -> None:
        """The plan: L* anywhere up to this stage's hit; loads, then the engine runs."""
        request_id = self._pick(data, reserved=True, started=False)
        hit = self.manager.num_hit_blocks(request_id) + self.manager.num_host_hit_blocks(request_id)
        self._first_chunk(request_id, data.draw(st.integers(0, hit), label="L*"), data)

    @rule(choices=_prompts, data=st.data())
    def serve(self, choices: list[int], data: st.DataObject) -> None:
        """One whole request in one step, at L* = its hit: fills the device pool, so blocks
        spill, and brings back what the host tier holds (loads)."""
        request_id = self._probe(choices, 1.0)
        if not self._reserve(request_id):
            return
        hit = self.manager.num_hit_blocks(request_id) + self.manager.num_host_hit_blocks(request_id)
        self._first_chunk(request_id, hit, data)
        if request_id in self.requests:
            del self.requests[request_id]
            assert self.manager.release(request_id)

    def _first_chunk(self, request_id: str, num_agreed: int, data: st.DataObject) -> None:
        request = self.requests[request_id]
        num_device = self.manager.num_hit_blocks(request_id)
        try:
            num_cached = self.manager.start_chunk(request_id, num_agreed * _BLOCK_SIZE)
        except ValueError:
            # only a host copy lost to a failed log refuses the plan; the micro-batch fails
            # and the scheduler releases the request
            loads = request.host_slots[: max(0, num_agreed - num_device)]
            assert any(self.host.slot_hash(slot) is None for slot in loads)
            del self.requests[request_id]
            assert self.manager.release(request_id)
            self.num_refused_loads += 1
            return
        request.started, request.host_slots = True, ()
        transfers = self.pool.take_transfers()
        self.num_loads += sum(t.kind == "load" for t in transfers)
        if data.draw(st.booleans(), label="copies fail"):
            self._fail_copies(data, transfers)
            return  # the micro-batch fails: it reads and computes nothing
        self._copy(transfers)  # the engine's preparation, before the chunk runs
        table = self.manager.block_table(request_id)
        for index in range(num_cached // _BLOCK_SIZE):  # what the chunk reads as cached
            assert self.device_bytes[table[index]] == request.block_hashes[index], (
                f"block {index} of {request_id} reads wrong KV"
            )
        for index in range(num_cached // _BLOCK_SIZE, len(table)):  # what it computes
            full = index < len(request.block_hashes)
            self.device_bytes[table[index]] = request.block_hashes[index] if full else "partial"
        self.manager.mark_computed(request_id, len(request.token_ids))

    def _fail_copies(self, data: st.DataObject, transfers: list[Transfer]) -> None:
        """The engine raises after some of the log's copies ran; the pool forgets the log."""
        self._copy(transfers[: data.draw(st.integers(0, len(transfers)), label="copies run")])
        self.pool.discard_transfers(transfers)

    @rule(data=st.data())
    def pending_copies_fail(self, data: st.DataObject) -> None:
        """A log of spills fails (its slots may be pinned by probes that will plan loads)."""
        self._fail_copies(data, self.pool.take_transfers())

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        request_id = self._pick(data)
        del self.requests[request_id]
        assert self.manager.release(request_id)

    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def advance_clock_and_expire(self, seconds: float) -> None:
        self.now_s += seconds
        expected = {rid for rid, r in self.requests.items() if r.expiry_s <= self.now_s}
        assert set(self.manager.expire()) == expected
        for request_id in expected:
            del self.requests[request_id]

    @invariant()
    def tiers_hold(self) -> None:
        pool, host = self.pool, self.host
        pool.check_invariants()
        host.check_invariants()
        device, hosted = pool.cached_block_hashes(), host.cached_block_hashes()
        assert not device & hosted, "a hash is indexed in both tiers"
        pins = [0] * _NUM_SLOTS
        for request_id, request in self.requests.items():
            assert self.manager.num_host_hit_blocks(request_id) == len(request.host_slots)
            for slot in request.host_slots:
                pins[slot] += 1
            num_device = self.manager.num_hit_blocks(request_id) if not request.started else 0
            for offset, slot in enumerate(request.host_slots):  # None: lost to failed copies
                assert host.slot_hash(slot) in (request.block_hashes[num_device + offset], None)
        assert [host.ref_cnt(s) for s in range(_NUM_SLOTS)] == pins
        for event in pool.take_events():
            apply = self.shadow[event.tier].update if event.kind == "stored" else None
            if apply is not None:
                apply(event.block_hashes)
            else:
                self.shadow[event.tier].difference_update(event.block_hashes)
        assert self.shadow["device"] == set(device)
        assert self.shadow["host"] == set(hosted)
        # the log stays pending until a plan takes it (as on a stage); the bookkeeping
        # holds for the bytes the engine will have once it applies what is pending
        device_bytes, host_bytes = list(self.device_bytes), list(self.host_bytes)
        self._copy(host.pending_transfers(), device_bytes, host_bytes)
        for block_id in range(_NUM_BLOCKS):
            block_hash = pool.block_hash(block_id)
            if block_hash is not None:
                assert device_bytes[block_id] == block_hash, f"device block {block_id}"
        for block_hash in hosted:
            slot = host.slot_of(block_hash)
            assert host_bytes[slot] == block_hash, f"host slot {slot}"

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request_id in list(self.requests):
            self.manager.release(request_id)
        self.pool.check_invariants()
        self.host.check_invariants()
        assert self.pool.num_pinned_blocks == 0
        assert self.host.num_pinned == 0


TestTwoTierMachine = TwoTierMachine.TestCase
TestTwoTierMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
