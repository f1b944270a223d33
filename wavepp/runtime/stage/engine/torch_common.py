"""What the torch engines (``torch_engine``, ``checkpoint_engine``) share around their layers.

A micro-batch's causal masks over each chunk's paged context, the stage's input (the first
stage's token embeddings or the activations received from the previous stage) and the last
stage's output (float32 logits of each finished chunk's last token, on the TP leader).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from wavepp.runtime.stage.engine.base import ChunkSpec, PreparedBatch, StageOutput
from wavepp.runtime.stage.engine.layers.common import rms_norm
from wavepp.runtime.stage.engine.tensor_parallel import TPGroup

__all__ = ["causal_masks", "last_stage_output", "stage_input"]


def causal_masks(chunks: Sequence[ChunkSpec], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per chunk, a [x_i, L_i + x_i] bool mask, True where query j may attend key k
    (k <= L_i + j): the chunk's whole context ``[0, L_i + x_i)`` is read from the paged cache."""
    masks = []
    for chunk in chunks:
        key_pos = torch.arange(chunk.context_end, device=device)
        query_pos = torch.arange(chunk.context_offset, chunk.context_end, device=device)
        masks.append(key_pos[None, :] <= query_pos[:, None])
    return tuple(masks)


def stage_input(
    prepared: PreparedBatch,
    hidden_in: torch.Tensor | None,
    embed: torch.Tensor | None,
    *,
    is_first: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The stage's input [num_tokens, hidden_size]: on the first stage the embeddings of
    ``prepared.token_ids`` (``embed`` [vocab, hidden]), else ``hidden_in`` on ``device`` as
    ``dtype``. The caller checked the arguments (``_check_execute_args``)."""
    if is_first:
        assert embed is not None and prepared.token_ids is not None
        return F.embedding(prepared.token_ids, embed)
    assert hidden_in is not None
    return hidden_in.to(device=device, dtype=dtype)


def last_stage_output(
    h: torch.Tensor,
    prepared: PreparedBatch,
    tp: TPGroup,
    final_norm: torch.Tensor | None,
    lm_head: torch.Tensor | None,
    *,
    eps: float,
    device: torch.device,
) -> StageOutput:
    """The last stage's output for its hidden states ``h`` [num_tokens, hidden_size]: on the TP
    leader, float32 [vocab_size] logits (RMSNorm with ``final_norm``, then ``lm_head``) of each
    row in ``prepared.logits_rows``; a follower returns nothing (the leader computes them)."""
    if not tp.is_leader:  # a follower: the leader computes the logits
        return StageOutput(hidden=None)
    assert final_norm is not None and lm_head is not None
    if not prepared.logits_rows:
        return StageOutput(hidden=None)
    rows = torch.tensor([r for _, r in prepared.logits_rows], device=device)
    x = rms_norm(h[rows], final_norm, eps)
    logits = F.linear(x, lm_head).to(torch.float32)
    return StageOutput(
        hidden=None,
        last_token_logits={rid: logits[i] for i, (rid, _) in enumerate(prepared.logits_rows)},
    )
