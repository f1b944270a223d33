"""The resolved runtime configuration shared by the scheduler and every stage process.

One pydantic model, serialised to JSON and handed to each ``wavepp stage`` process, so that all
stages agree on the model, the partition, the block size and the mode.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wavepp.api.layer_split import split_layers
from wavepp.api.subjects import ReplicaSubjects, replica_prefix
from wavepp.runtime.families import TENSOR_PARALLEL
from wavepp.runtime.model_config import ModelConfig
from wavepp.telemetry.settings import TelemetrySettings

Mode = Literal["wave", "sync"]


class AgreementMode(StrEnum):
    """When a request's prefix agreement runs; selects the admission strategy
    (``scheduling.admission.STRATEGIES``). The values are the ``--agreement`` flag's."""

    ASYNC = "async"  # concurrently with execution, off the critical path (AsyncAdmission)
    SYNC = "sync"  # in the scheduling loop, one request at a time (SyncAdmission)


class BaselineConfig(BaseModel):
    """The TensorRT-LLM baseline's fidelity switches (docs/bench/baseline.md): each models one
    way TensorRT-LLM's PP executor behaves. They apply in ``mode="sync"`` only, as
    ``RuntimeConfig.resolved_baseline`` (``BASELINE_OFF`` in wave mode), read by the planner
    policy (``planning.planner_for``: budget accounting, one chunk in flight) and the admission
    strategy (``AdmissionStrategy.host_floor_s``, ``agrees_in_lockstep``) only."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    # NOTE: what the static policy charges a request's first chunk against chunk_tokens
    # (TRT-LLM's max_num_tokens) before its cached prefix is known: "none" the whole remaining
    # prompt, "estimated" the prompt minus the prefix that live requests hold (TensorRT-LLM
    # PR 11637's estimate under MAX_UTILIZATION), "exact" only the new tokens (PR 15066).
    budget_accounting: Literal["none", "estimated", "exact"] = "none"
    # NOTE: a request's next chunk waits until its previous one came back from the last stage
    # (TRT-LLM _add_inflight_ids; the micro-batch scheduler skips requests in execution).
    one_chunk_inflight: bool = True
    # NOTE: the simulator agrees on prefixes without KV round trips and gives every stage the
    # smallest stage's capacity (TRT-LLM ranks stay in lockstep: equal pools, identical
    # operations in identical order). The real runtime still agrees over NATS.
    lockstep_admission: bool = True
    # NOTE: TRT-LLM rank 0's host loop between the oldest micro-batch's return and the next
    # launch (fetch, schedule, prepare resources, prepare inputs), seconds; the sync scheduler's
    # own time from a free slot to the publish counts toward it (it tops up, never adds).
    # Default and range: TensorRT-LLM PRs 15584 and 17257 (figures: docs/bench/baseline.md).
    iteration_overhead_s: float = Field(0.005, ge=0.0, le=1.0)
    # NOTE: whether an admitted request reuses the prefix every stage holds (TensorRT-LLM's
    # KvCacheConfig.enable_block_reuse). False: its agreed prefix is 0 blocks, so it computes
    # its whole prompt; the stages' cached blocks stay as they are. TensorRT-LLM's DSA cache
    # manager (MLA + DSA models: GLM-5.x, DeepSeek-V3.2) asserts block reuse disabled
    # (NVIDIA/TensorRT-LLM PR 8405); docs/bench/layouts.md measures what it changes.
    prefix_reuse: bool = True


# Every switch off: what wave mode (and the dynamic policy's budget) sees.
BASELINE_OFF = BaselineConfig(
    budget_accounting="exact",
    one_chunk_inflight=False,
    lockstep_admission=False,
    iteration_overhead_s=0.0,
    prefix_reuse=True,
)


class RuntimeConfig(BaseModel):
    """Everything a pipeline's processes must agree on.

    ``mode`` sets the defaults of the three WavePP mechanisms; each can be overridden for
    ablations (docs/design.md 'The baseline'):

    | mechanism        | wave (WavePP)                       | sync (baseline)                     |
    | ---------------- | ----------------------------------- | ----------------------------------- |
    | agreement        | async, fills a bounded queue        | in the scheduling loop, per request |
    | chunk_policy     | dynamic (equal cost per micro-batch) | static (``chunk_tokens`` per batch) |
    | local_prepare    | on plan arrival, before activations | after activations arrive            |
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    pipeline: str = Field("default", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    # NOTE: the Kubernetes namespace of the pipeline (``$WAVEPP_NAMESPACE`` in a pod; "local"
    # for ``wavepp up``): every NATS subject, stream and bucket carries it and the name, so two
    # same-named pipelines in two namespaces share nothing on one NATS server.
    namespace: str = Field("local", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    model: ModelConfig = ModelConfig()
    engine: Literal["torch", "emulated"] = "torch"
    # NOTE: a Hugging Face checkpoint directory (config.json + safetensors) as each stage
    # process sees it; the torch engine reads its stage's layers from it, and ``model`` must be
    # the one derived from its config.json (``wavepp.runtime.hf_config.load_model_dir``).
    # None: the torch engine's seeded random Llama weights.
    model_dir: str | None = None
    # NOTE: processes (one per device: cuda:i, or the CPU) computing one stage with tensor
    # parallelism (``stage/engine/tensor_parallel.py``); `wavepp stage` starts them. The torch
    # engine only, for the families in ``families.TENSOR_PARALLEL``; anything else is refused.
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # NOTE: hybrid models (kimi_linear): each linear-attention layer stores its recurrent state
    # after every k-th block of a request, and the agreement's L* is a multiple of k blocks.
    # Memory per stored state and KDA layer: heads * head_dim^2 * 4 B (+ the conv tail), so
    # k trades state memory against reusable prefix granularity (k * block_size tokens).
    state_interval_blocks: int = Field(1, ge=1, le=4096)
    cost_model: dict[str, object] | None = None  # CostModel.to_dict() for the emulated engine
    time_scale: float = Field(1.0, gt=0)
    num_stages: int = Field(4, ge=1, le=64)
    partition: list[int] | None = None
    block_size: int = Field(16, ge=1, le=4096)
    # NOTE: KV capacity per stage in blocks of block_size tokens: one entry (all stages) or one
    # per stage. The default 4096 is for the torch engine's tiny models; callers that build an
    # emulated engine's config without an explicit capacity get the one derived from the
    # emulated model and device (wavepp.launch.capacity.replica_capacity).
    num_kv_blocks: list[int] = Field(default_factory=lambda: [4096])
    # NOTE: the host tier below each stage's device pool, in blocks of block_size tokens (one
    # entry, all stages, or one per stage; 0: no host tier), and the seconds one block takes
    # from host to device on each stage (unscaled: the simulator and the emulated engine
    # multiply by time_scale). Resolved from cache.hostMemoryGiB / --host-memory-gib and the
    # model's KV bytes per token by wavepp.launch.capacity.
    num_host_kv_blocks: list[int] = Field(default_factory=lambda: [0])
    host_load_s_per_block: list[float] = Field(default_factory=lambda: [0.0])
    mode: Mode = "wave"
    chunk_tokens: int = Field(8192, ge=1)
    # NOTE: the engine's largest micro-batch, new tokens; both policies stay within it, and the
    # physical bound (docs/bench/bound.md) uses it.
    max_microbatch_tokens: int = Field(16384, ge=1)
    # NOTE: wave mode sizes each micro-batch from the work of every request in the system
    # (c + W / S, docs/bench/bound.md) instead of from chunk_tokens; False for the ablation.
    closed_loop_fill: bool | None = None
    # NOTE: the closed-loop target counts the way back of a finished micro-batch's requests
    # (answer, resubmission, intake, agreement, plan) as this many micro-batch times after
    # their crossing of the S stages, and splits each round into up to max_inflight
    # micro-batches (SchedulerCore.closed_loop_target_s); read only with the closed-loop
    # target. 0: the zero-latency picture of docs/bench/bound.md (S micro-batches a round), as
    # the simulator's closed loop returns a request at once; a served replica's requests come
    # back through its clients, the gateway and the intake (launch.runtime_config: 1).
    return_microbatches: int = Field(0, ge=0)
    chunk_policy: Literal["dynamic", "static"] | None = None
    # NOTE: the baseline's emulation switches (sync mode only; see BaselineConfig).
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    # NOTE: None: async in wave mode, sync in sync mode (an ablation overrides it).
    agreement: AgreementMode | None = None
    local_prepare: bool | None = None
    prefix_wait: bool | None = None
    prefix_wait_min_fraction: float = Field(0.25, ge=0.0, le=1.0)
    # NOTE: wave mode plans the next micro-batch while the agreements it waits for are under
    # way, with each request's L* predicted from the prefixes agreed before, and publishes it
    # when every reply matches (else plans again); the stages see the same plans either way
    # (wavepp/runtime/scheduling/speculation.py). False: plan only after the replies.
    speculative_planning: bool = True
    admission_lookahead_tokens: int | None = Field(None, ge=1)
    max_inflight: int | None = Field(None, ge=1)
    max_prepared: int = Field(64, ge=1)
    max_agreements_in_flight: int = Field(16, ge=1)
    lease_s: float = Field(30.0, gt=0)
    # NOTE: KV handoff to a decode engine (wavepp.runtime.stage.handoff_server). Each stage
    # serves pulls on handoff_listen ("host:port"; port 0: any free one; "": no server, and a
    # request asking for a handoff fails); handoff_advertise is the host the decode engine
    # dials ("": the listen host). A handed-off request's blocks stay pinned at most
    # handoff_lease_s seconds after its prefill, until pulled and released.
    handoff_listen: str = Field("127.0.0.1:0", pattern=r"^$|^[^\s:]*:\d{1,5}$")
    handoff_advertise: str = ""
    handoff_lease_s: float = Field(60.0, gt=0)
    # NOTE: blocks one owner (one admission instance: ``AgreementController.owner``) may hold
    # pinned or reserved on one stage at once (``StageKVManager``); a reservation past it is
    # refused like a full pool (the request waits for its owner's own releases), and a prompt
    # that needs more is refused at once by the admission (``owner_blocks_of``). Above a
    # stage's pool it is that pool. None (the default): the whole pool, because the replica's
    # one admission is the only legitimate owner on its stages and may legitimately hold every
    # block (a long prompt, or the requests in flight plus the lookahead under load); any
    # fraction would refuse prompts that fit, or throttle a lone admission. Lowering it bounds
    # a misbehaving owner: when an admission restarts, the old instance's pins live until
    # their lease (``lease_s``) runs out, and with C here it holds at most C, so the new
    # instance finds pool - C blocks at once (C = half the pool: each of two overlapping
    # instances gets half), at the price of refusing prompts of more than C blocks and
    # capping a lone admission at C. It does not bound a holder of the bus key, who can sign
    # ops under any number of owner names (the key is that defence).
    max_blocks_per_owner: int | None = Field(None, ge=1, le=2**31 - 1)
    # NOTE: the admission's request-reply to a stage (KV rounds; health probes take at most
    # 2 s). A KV op takes milliseconds; a round sent to a stage that died before answering is
    # lost and waits this long, holding the requests queued behind it (under `wavepp up`, a
    # request admitted right after the killed stage re-formed waited 7.5 s for a 10 s time-out).
    # A time-out only retries the agreement (release, probe again: both idempotent).
    request_timeout_s: float = Field(3.0, gt=0)
    # NOTE: an agreement a stage did not answer (NATS reconnecting, a stage restarting) is
    # retried (release, then probe again; both idempotent) for this many seconds of wall time
    # before its request fails; 0 fails at once.
    agreement_retry_s: float = Field(30.0, ge=0)
    # NOTE: a micro-batch the last stage has not finished this long after its plan went out
    # (a stage died, or lost the plan) fails its requests with a clear error and releases their
    # pins on every stage that answers; seconds of wall time, far above any normal micro-batch.
    microbatch_deadline_s: float = Field(300.0, gt=0)
    # NOTE: a directory: each stage times the parts of its loop per micro-batch and writes
    # ``stage-<rank>.json`` there as it stops (``wavepp.runtime.stage.loop_profile``);
    # "": no profile, nothing recorded.
    profile_dir: str = ""
    device: str = "cpu"
    # NOTE: how activations move between stages (torch.distributed backend): "nccl" GPU to GPU,
    # each stage on a GPU of its own (NCCL refuses two ranks on one GPU); "gloo" through host
    # memory, for CPU stages and for stages sharing one GPU; None: nccl on cuda, gloo on the CPU.
    activation_backend: Literal["nccl", "gloo"] | None = None
    # NOTE: the torch engine's Llama weights: a ``.safetensors`` file or a directory of them with
    # HF Llama tensor names, shaped by ``model`` (``spec.model.path``, or the PVC's mount path);
    # None: seeded random weights. The emulated engine loads none (the spec check refuses a path
    # there). ``model_dir`` owns checkpoints described by their own config.json (any family,
    # ``model`` derived from it); the two are exclusive (both set is refused), so neither is
    # silently ignored.
    weights: str | None = None
    torch_threads: int = Field(1, ge=1)
    # NOTE: ``torch.compile`` of the torch engine's dense per-token layer parts (dynamic token
    # count; built on first use); needs engine torch and tensor_parallel_size 1.
    torch_compile: bool = False
    # NOTE: the torch engine holds its projection weights pre-packed for its device's kernel
    # (``engine/layers/linear.py``: oneDNN's layout on a CPU); False: plain ``F.linear``.
    # Ignored by (and so refused as False with) the emulated engine.
    pack_weights: bool = True
    # NOTE: local launchers (``LocalPipeline``, ``wavepp up``) give each stage process a disjoint
    # share of their cores (``wavepp stage --cores``, ``runtime.stage.placement``); a pod's
    # stage is placed by the kubelet. False: every process floats over every core.
    pin_cores: bool = False
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        split_layers(self.model.num_layers, self.num_stages, self.partition)
        if len(self.num_kv_blocks) not in (1, self.num_stages):
            raise ValueError(
                f"num_kv_blocks has {len(self.num_kv_blocks)} entries; give 1 (all stages) "
                f"or num_stages={self.num_stages}"
            )
        if any(n < 1 for n in self.num_kv_blocks):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: every entry must be >= 1")
        for name, values in (
            ("num_host_kv_blocks", self.num_host_kv_blocks),
            ("host_load_s_per_block", self.host_load_s_per_block),
        ):
            if len(values) not in (1, self.num_stages):
                raise ValueError(
                    f"{name} has {len(values)} entries; give 1 (all stages) or "
                    f"num_stages={self.num_stages}"
                )
            if any(not v >= 0 for v in values):
                raise ValueError(f"{name}={values}: every entry must be >= 0")
        if self.activation_backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(
                f"activation_backend='nccl' needs device cuda (got device={self.device!r}); "
                "use 'gloo' or leave it unset"
            )
        if self.engine == "emulated" and self.cost_model is None:
            raise ValueError("engine=emulated needs cost_model (a CostModel.to_dict())")
        if self.torch_compile and (self.engine != "torch" or self.tensor_parallel_size != 1):
            raise ValueError(
                f"torch_compile=True needs engine='torch' and tensor_parallel_size=1 (got "
                f"engine={self.engine!r}, tensor_parallel_size={self.tensor_parallel_size})"
            )
        if not self.pack_weights and self.engine != "torch":
            raise ValueError(
                f"pack_weights=False needs engine='torch' (got engine={self.engine!r}, which "
                "has no weights)"
            )
        tp = self.tensor_parallel_size
        if tp != 1 and (self.engine != "torch" or self.model.architecture not in TENSOR_PARALLEL):
            # NOTE: the emulated engine sleeps a cost model; its ``model`` keeps the default
            # architecture (llama), so name the model, not a family it does not compute.
            what = (
                f"the emulated engine (model {self.model.name!r}: a cost model, no weights to "
                "shard)"
                if self.engine == "emulated"
                else f"the torch engine with family {self.model.architecture!r}"
            )
            raise ValueError(
                f"tensor_parallel_size={tp} (--tensor-parallel-size / spec.tensorParallelSize): "
                f"tensor parallelism inside a stage is not implemented for {what} (implemented: "
                f"the torch engine with {', '.join(sorted(TENSOR_PARALLEL))}); use 1 and more "
                "pipeline stages"
            )
        if tp != 1 and any(self.num_host_kv_blocks):
            # NOTE: the leader alone applies the host tier's copies; its followers' shards
            # would keep no host copy
            raise ValueError(
                f"num_host_kv_blocks={self.num_host_kv_blocks} (cache.hostMemoryGiB / "
                f"--host-memory-gib) with tensor_parallel_size={tp}: a host tier runs on stages "
                "of one process; give 0 or tensor parallel size 1"
            )
        if tp != 1 and self.model.num_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp}: model.num_heads={self.model.num_heads} is not "
                "divisible by it (each TP rank computes num_heads / T heads)"
            )
        if self.model_dir is not None and self.engine != "torch":
            raise ValueError(
                f"model_dir={self.model_dir!r} is read by the torch engine only; "
                f"engine={self.engine!r} would ignore it"
            )
        if self.engine == "torch" and self.model_dir is None and self.model.architecture != "llama":
            raise ValueError(
                f"model.architecture={self.model.architecture!r} needs model_dir (a checkpoint "
                "directory); random weights exist for llama only"
            )
        if self.weights is not None and self.engine != "torch":
            raise ValueError(f"weights={self.weights!r}: only the torch engine loads weights")
        if self.weights is not None and self.model_dir is not None:
            raise ValueError(
                f"weights={self.weights!r} and model_dir={self.model_dir!r}: set one; model_dir "
                "(a checkpoint directory with config.json, any family) or weights (Llama "
                "safetensors shaped by this config's model)"
            )
        if self.max_microbatch_tokens < self.block_size:
            raise ValueError(
                f"max_microbatch_tokens={self.max_microbatch_tokens}: must be >= "
                f"block_size={self.block_size} (a micro-batch holds at least one block)"
            )
        return self

    # ---- resolved views -----------------------------------------------------------------

    @property
    def subject_prefix(self) -> str:
        return replica_prefix(self.pipeline, namespace=self.namespace)

    @property
    def subjects(self) -> ReplicaSubjects:
        """This replica's NATS subjects (``wavepp.api.subjects``)."""
        return ReplicaSubjects(self.subject_prefix)

    @property
    def largest_microbatch_tokens(self) -> int:
        """New tokens of the engine's largest micro-batch: the larger of max_microbatch_tokens
        and chunk_tokens (the static policy's budget). The KV capacity leaves room for its
        activations (``planning.memory``)."""
        return max(self.max_microbatch_tokens, self.chunk_tokens)

    @property
    def model_id(self) -> str:
        """Seed of the block-hash chain: the model's name and weight seed."""
        return f"{self.model.name}:seed={self.model.seed}"

    def kv_blocks_of(self, rank: int) -> int:
        return self.num_kv_blocks[0] if len(self.num_kv_blocks) == 1 else self.num_kv_blocks[rank]

    def host_kv_blocks_of(self, rank: int) -> int:
        """Host tier capacity of stage ``rank`` in blocks (0: no host tier)."""
        values = self.num_host_kv_blocks
        return values[0] if len(values) == 1 else values[rank]

    def host_load_s_of(self, rank: int) -> float:
        """Seconds (unscaled) to load one block from host to device on stage ``rank``."""
        values = self.host_load_s_per_block
        return values[0] if len(values) == 1 else values[rank]

    def owner_blocks_of(self, rank: int) -> int:
        """Blocks one owner may hold on stage ``rank``: its pool, or ``max_blocks_per_owner``
        when lower (the stage's ``StageKVManager`` cap; the admission's never-fits bound)."""
        pool = self.kv_blocks_of(rank)
        cap = self.max_blocks_per_owner
        return pool if cap is None else min(pool, cap)

    def layers_of(self, rank: int) -> tuple[int, int]:
        return split_layers(self.model.num_layers, self.num_stages, self.partition)[rank]

    @property
    def resolved_chunk_policy(self) -> Literal["dynamic", "static"]:
        if self.chunk_policy is not None:
            return self.chunk_policy
        return "dynamic" if self.mode == "wave" else "static"

    @property
    def resolved_closed_loop_fill(self) -> bool:
        """Closed-loop micro-batch target: default on in wave mode with the dynamic policy."""
        if self.resolved_chunk_policy != "dynamic":
            return False
        return self.closed_loop_fill if self.closed_loop_fill is not None else self.mode == "wave"

    @property
    def resolved_return_microbatches(self) -> int:
        """Micro-batch times the closed-loop target counts for a round's way back (see the
        field): ``return_microbatches`` with the closed-loop target, else 0."""
        return self.return_microbatches if self.resolved_closed_loop_fill else 0

    @property
    def resolved_baseline(self) -> BaselineConfig:
        """The baseline switches as they apply: ``baseline`` in sync mode (its budget
        accounting "exact" unless the chunk policy is static), ``BASELINE_OFF`` otherwise."""
        if self.mode != "sync":
            return BASELINE_OFF
        if self.resolved_chunk_policy != "static":
            return self.baseline.model_copy(update={"budget_accounting": "exact"})
        return self.baseline

    @property
    def resolved_agreement(self) -> AgreementMode:
        if self.agreement is not None:
            return self.agreement
        return AgreementMode.ASYNC if self.mode == "wave" else AgreementMode.SYNC

    @property
    def resolved_activation_backend(self) -> str:
        """``activation_backend``, or nccl on cuda and gloo on the CPU when unset."""
        if self.activation_backend is not None:
            return self.activation_backend
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @property
    def resolved_local_prepare(self) -> bool:
        return self.local_prepare if self.local_prepare is not None else self.mode == "wave"

    @property
    def resolved_admission_lookahead_tokens(self) -> int:
        """Async admission stops agreeing ahead once this many new tokens are admitted but not
        yet planned (default: (max_inflight + 1) x chunk_tokens, enough to keep every stage
        busy): reserving far ahead only takes blocks from the prefix cache."""
        if self.admission_lookahead_tokens is not None:
            return self.admission_lookahead_tokens
        return (self.resolved_max_inflight + 1) * self.chunk_tokens

    @property
    def resolved_prefix_wait(self) -> bool:
        """Wave mode: a request whose prefix a live request is computing waits for it (only
        with async agreement; the sync loop agrees late enough on its own)."""
        wait = self.prefix_wait if self.prefix_wait is not None else self.mode == "wave"
        return wait and self.resolved_agreement is AgreementMode.ASYNC

    @property
    def resolved_speculative_planning(self) -> bool:
        """Speculative planning: wave mode with async agreement only (sync agrees on the
        critical path, one request at a time)."""
        return (
            self.speculative_planning
            and self.mode == "wave"
            and self.resolved_agreement is AgreementMode.ASYNC
        )

    @property
    def resolved_max_inflight(self) -> int:
        """Micro-batches in flight at most: ``max_inflight``, else S plus the micro-batch times
        of a round's way back (``resolved_return_microbatches``), so that stage 0 has work while
        the first micro-batch's requests come back."""
        return self.max_inflight or self.num_stages + self.resolved_return_microbatches
