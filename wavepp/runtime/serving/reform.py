"""When an admission service pauses and resumes its plans around a re-form (pure logic).

The stages of a replica re-form their process group in place (``stage.rendezvous``): a stage
that died comes back, the survivors and it form the group of a new epoch. Plans are core NATS
and must reach all S stages of one group or none, so the scheduler publishes none from the
first probe that finds a stage not formed (dead: no responder; re-forming: ``ok`` False) until
every stage is formed again. If the group's epoch changed meanwhile, the stages released
everything they held: every admitted, unanswered request is admitted again
(``resume_plans(readmit=True)``); if not (a slow probe), plans simply go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

ReformAction = Literal["none", "pause", "resume", "readmit"]


class ReformTracker:
    """Feeds on each health probe of a replica's stages; see the module docstring.

    Attributes:
        is_paused: plans are held (a stage is not formed).
        epochs: the stages' group epochs when they were last all formed (None: never yet).
        num_reforms: re-forms seen (an epoch change once every stage was formed again).
    """

    def __init__(self) -> None:
        self.is_paused = False
        self.epochs: tuple[int, ...] | None = None
        self.num_reforms = 0

    def observe(self, is_formed: bool, epochs: Sequence[int] = ()) -> ReformAction:
        """One probe: ``is_formed`` when every stage answered ok, with their ``group_epoch``.

        Returns:
            ``pause`` (hold plans), ``resume`` (publish again, nothing changed), ``readmit``
            (publish again after re-admitting every admitted request: a new epoch), or
            ``none``.
        """
        if not is_formed:
            if self.is_paused:
                return "none"
            self.is_paused = True
            return "pause"
        now = tuple(epochs)
        changed = self.epochs is not None and now != self.epochs
        self.epochs = now
        if changed:
            self.num_reforms += 1
        if self.is_paused or changed:
            self.is_paused = False
            return "readmit" if changed else "resume"
        return "none"
