"""The request type the runtime passes around (``PromptRequest``), its lifecycle on a scheduler
(``RequestStatus``) and what its caller gets back (``RequestOutcome``)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


@dataclass
class PromptRequest:
    """A prefill request as the runtime sees it.

    ``token_ids``: the prompt, ``num_tokens >= 1``. ``cache_salt``: per tenant; requests with
    different salts never share cached blocks. ``arrival_s``: ``time.time()`` at arrival.
    """

    request_id: str
    token_ids: list[int]
    cache_salt: str = ""
    arrival_s: float = field(default_factory=time.time)
    return_logits: bool = False
    # Hand the prompt's KV to a decode engine (wavepp.api.kv_handoff): the stages keep it
    # pinned for handoff_lease_s seconds after the prefill; the outcome's handoff_expires says
    # until when.
    handoff: bool = False
    # W3C traceparent of the caller's span (the gateway's): the request's root span becomes its
    # child; "" starts a trace of its own.
    traceparent: str = ""
    # NOTE: memo of the prompt's block hashes (a pure function of the fields above), so the
    # scheduler and the controller hash each prompt once.
    block_hashes: list[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestStatus(enum.IntEnum):
    """Where a request is in its life on one scheduler; one value at a time, moving forward.

    ``WAITING`` (in the intake) -> ``AGREEING`` (prefix wait, probe/pin/commit) -> ``ADMITTED``
    (L* pinned, the rest reserved; nothing planned) -> ``RUNNING`` (some chunks published) ->
    ``PLANNED`` (every chunk published; waiting for the last stage) -> ``FINISHED_*``.
    A re-form sends an admitted request back to ``WAITING`` (its stages are gone).
    """

    WAITING = enum.auto()
    AGREEING = enum.auto()
    ADMITTED = enum.auto()
    RUNNING = enum.auto()
    PLANNED = enum.auto()
    FINISHED_OK = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        """Answered (a first token or an error); nothing more is planned for it."""
        return self >= RequestStatus.FINISHED_OK

    @property
    def is_fully_planned(self) -> bool:
        """No chunk of it will be planned any more (every chunk published, or answered)."""
        return self >= RequestStatus.PLANNED


@dataclass
class RequestOutcome:
    """What a caller gets back for one request. Times are ``time.time()`` seconds."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    first_token_id: int | None = None
    logits: list[float] | None = None
    error: str = ""
    arrival_s: float = 0.0
    admitted_s: float = 0.0
    first_scheduled_s: float = 0.0
    finished_s: float = 0.0
    agreement_s: float = 0.0
    num_refusals: int = 0
    stage_hits: tuple[int, ...] = ()  # h_s per stage at agreement, blocks (device + host)
    stage_host_hits: tuple[int, ...] = ()  # m_s per stage: the host-tier part of h_s
    handoff_expires: float = 0.0  # > 0: the stages hold its KV for a decode engine until then
    # failed for a transient cause (a stage did not answer its agreement: down or re-forming);
    # the same prompt may be served when sent again
    is_retryable: bool = False
    # (rank, L*) as each stage reported it for each of the request's chunks
    stage_agreed_blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float:
        return self.finished_s - self.arrival_s
