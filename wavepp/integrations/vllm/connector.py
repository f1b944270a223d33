"""``WavePPConnector``: a vLLM KV connector (``KVConnectorBase_V1``) through which an unmodified
vLLM decodes from KV that a WavePP pipeline prefilled.

Load it on the decode instance::

    --kv-transfer-config '{"kv_connector": "WavePPConnector", "kv_role": "kv_consumer",
        "kv_connector_module_path": "wavepp.integrations.vllm.connector"}'

(``wavepp`` importable in vLLM's environment: this package needs only the standard library,
torch and vLLM). A request whose ``kv_transfer_params`` carry ``wavepp_handoff`` (the prefill
answer's, ``wavepp.runtime.serving.handoff``) has its prompt's KV pulled from every stage
(``pull.pull_request``: checkpoint layer i from the stage owning it) and written into vLLM's
paged cache (through the attention backend's own cache writer, ``do_kv_cache_update``, at the
slots of ``layout.slots_of``) before the forward that follows; vLLM then computes
only the prompt's last token (its logits) and decodes. Requests without it are untouched.

Scheduler side: ``get_num_new_matched_tokens`` offers prompt tokens ``[num_computed,
num_tokens - 1)`` (vLLM computes at least the last one), loaded synchronously;
``build_connector_meta`` passes each load (params, block ids, token range) to the workers.
Worker side: ``start_load_kv`` pulls and writes each load's layers this worker holds (every
pipeline stage of the decode instance pulls the whole request and keeps its own layers). A pull
that fails (stage gone, lease ended, wrong token) marks the request's blocks as load errors
(``get_block_ids_with_load_errors``): vLLM then recomputes them, or fails the request, as its
``kv_load_failure_policy`` says; the error is logged with its cause.

``kv_connector_extra_config``: ``stats_path`` (optional): one JSON line per pull appended there
({"request_id", "bytes", "seconds", "ok", "error"}); ``timeout_s`` (default 30): per stage.

The backend writes its own layout, so any attention backend with ``do_kv_cache_update`` works:
a K/V backend takes K and V (``layout.kv_for_backend``), an MLA backend (a layer with
``kv_lora_rank``) the normed latent and the roped key (``layout.latent_for_backend``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from wavepp.api.kv_handoff import PARAMS_KEY, HandoffError, HandoffParams
from wavepp.integrations.vllm.layout import kv_for_backend, latent_for_backend, slots_of
from wavepp.integrations.vllm.pull import KVTransport, TcpTransport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Load:
    request_id: str
    params: dict[str, Any]
    block_ids: list[int]
    start: int  # first prompt token to write
    count: int  # tokens to write


@dataclass
class WavePPConnectorMetadata(KVConnectorMetadata):
    """The loads of one scheduler step."""

    loads: list[_Load] = field(default_factory=list)


def _handoff_of(request: Request) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    value = params.get(PARAMS_KEY)
    return value if isinstance(value, dict) else None


def _write_layer(layer: Any, kv: torch.Tensor, load: _Load, slots: torch.Tensor) -> None:
    """Write tokens ``[load.start, load.start + load.count)`` of one pulled layer into vLLM's
    cache at ``slots`` through the backend's own cache writer (its in-block layout).

    Raises:
        ValueError: the pulled layer's shape does not fit the layer's cache.
    """
    cache = layer.kv_cache
    slots = slots.to(cache.device)
    if hasattr(layer, "kv_lora_rank"):  # vLLM's MLAAttention: one latent "head" per token
        latent, k_pe = latent_for_backend(
            kv,
            load.start,
            load.count,
            kv_lora_rank=int(layer.kv_lora_rank),
            rope_dim=int(layer.qk_rope_head_dim),
            dtype=cache.dtype,
        )
        layer.impl.do_kv_cache_update(
            latent, k_pe, cache, slots, layer.kv_cache_dtype, layer._k_scale
        )
        return
    key, value = kv_for_backend(
        kv,
        load.start,
        load.count,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_size,
        dtype=cache.dtype,
    )
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)


class WavePPConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._stats_path = str(extra.get("stats_path", ""))
        self._transport: KVTransport = TcpTransport(float(extra.get("timeout_s", 30.0)))
        self._pending: dict[str, _Load] = {}  # scheduler: allocated, not yet sent to workers
        self._offered: dict[str, tuple[int, int]] = {}  # scheduler: request -> (start, count)
        self._load_errors: set[int] = set()  # worker: blocks whose load failed
        self._block_size = int(vllm_config.cache_config.block_size)

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        handoff = _handoff_of(request)
        if handoff is None:
            return 0, False
        num_tokens = min(int(handoff.get("num_tokens", 0)), len(request.prompt_token_ids or []))
        count = max(0, num_tokens - 1 - num_computed_tokens)
        self._offered[request.request_id] = (num_computed_tokens, count)
        return count, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        offered = self._offered.pop(request.request_id, None)
        handoff = _handoff_of(request)
        if num_external_tokens <= 0 or handoff is None or offered is None:
            return
        start, _ = offered
        self._pending[request.request_id] = _Load(
            request_id=request.request_id,
            params=handoff,
            block_ids=list(blocks.get_block_ids()[0]),
            start=start,
            count=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = WavePPConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new_req.req_id, None)
            if load is not None:
                load.block_ids = list(new_req.block_ids[0])
                meta.loads.append(load)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        return False, None

    # ---- worker side ---------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, WavePPConnectorMetadata)
        if not meta.loads:
            return
        layers: dict[int, Any] = {}
        for name, layer in forward_context.no_compile_layers.items():
            match = _LAYER_INDEX.search(name)
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and match is not None:
                layers[int(match.group(1))] = layer
        for load in meta.loads:
            self._load(load, layers)

    def _load(self, load: _Load, layers: dict[int, Any]) -> None:
        began = time.perf_counter()
        record: dict[str, Any] = {"request_id": load.request_id, "bytes": 0, "ok": True}
        try:
            params = HandoffParams.from_json(load.params)
            pulled = self._transport.pull(params)
            slots = slots_of(load.block_ids, self._block_size, load.start, load.count)
            for index, layer in layers.items():
                if index >= len(pulled.layers):
                    raise HandoffError(
                        f"layer {index}: the stages handed over {len(pulled.layers)} layers"
                    )
                _write_layer(layer, pulled.layers[index], load, slots)
            record["bytes"] = pulled.num_bytes
        except (HandoffError, ValueError) as exc:
            log.error("WavePP handoff of %s failed: %s", load.request_id, exc)
            self._load_errors.update(load.block_ids)
            record |= {"ok": False, "error": str(exc)}
        record["seconds"] = time.perf_counter() - began
        record["end_s"] = time.time()
        if self._stats_path:
            with open(self._stats_path, "a") as out:
                out.write(json.dumps(record) + "\n")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # a decode engine stores nothing back

    def wait_for_save(self) -> None:
        return
