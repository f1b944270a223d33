"""The request type the runtime passes around: ``PromptRequest``."""

from __future__ import annotations

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
    # NOTE: memo of the prompt's block hashes (a pure function of the fields above), so the
    # scheduler and the controller hash each prompt once.
    block_hashes: list[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
