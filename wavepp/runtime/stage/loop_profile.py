"""Where a stage's time goes per micro-batch: monotonic timers around the parts of the stage
loop, summed over a run, and their table.

Two threads of a stage work on a micro-batch (``wavepp.runtime.stage.worker`` and
``.compute``); each has its own parts, seconds of ``time.perf_counter``:

- compute thread (:data:`COMPUTE_PARTS`): a micro-batch's *wall* runs from taking it off the work
  queue to the return of its send (idle waiting for the next plan is outside it). Its parts do
  not overlap and are recorded with its wall (:meth:`LoopProfile.microbatch_done`; a
  micro-batch a re-form dropped or whose send failed records neither), so ``other`` = wall -
  their sum >= 0 is the rest of the stage loop (Python, the done message's hand-over,
  allocation of the activation buffers).
- loop thread (:data:`LOOP_PARTS`): plan handling as each plan arrives over NATS, concurrent
  with the compute thread (so not part of its wall): the JSON decode and validation, and the
  plan's acceptance (block tables, host-tier copies, ``engine.prepare`` when the stage prepares
  on arrival).

The engine pass itself (``execute``) is one part here; its own parts are the ``torch.profiler``
regions of ``wavepp.runtime.stage.engine.profile``. Every part is host time: on a GPU the
engine pass's kernels run on after ``execute`` returns, and their time shows in the first part
that waits for them (the last stage's ``results``, the copy of ``send`` to host memory).

A stage given ``RuntimeConfig.profile_dir`` records into one :class:`LoopProfile` and writes
``stage-<rank>.json`` (:meth:`LoopProfile.to_json`) there as it stops; without it the stage has
no profile and records nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMPUTE_PARTS: dict[str, str] = {
    "recv": "wait for and receive the activations from the previous stage (torch.distributed)",
    "prepare": "engine.prepare on the compute thread (block tables to slots; not on arrival)",
    "execute": "the engine pass: the stage's layers (engine.execute)",
    "results": "the last stage's results (argmax, logits) and the done message",
    "send": "activation send to the next stage: the copy to the group's device, the issue, "
    "and waits on sends in flight",
}
"""Compute-thread part -> what it covers; with ``other`` they add up to the wall."""

LOOP_PARTS: dict[str, str] = {
    "plan_decode": "plan JSON decode and validation (loop thread, as it arrives over NATS)",
    "plan_accept": "plan acceptance: block tables, host-tier copies, prepare on arrival (loop)",
}
"""Loop-thread part -> what it covers (per plan, concurrent with the compute thread)."""

FILE_PREFIX = "stage-"


class LoopProfile:
    """Seconds per part, summed over a stage's micro-batches (thread-safe: both threads add).

    ``microbatches``: micro-batches the compute thread finished; ``plans``: plans the loop
    thread handled; ``wall_s``: the compute thread's wall over its micro-batches.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.microbatches = 0
        self.plans = 0
        self.wall_s = 0.0
        self.parts_s: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part``.

        Raises:
            KeyError: ``part`` is not one of :data:`COMPUTE_PARTS` or :data:`LOOP_PARTS`.
        """
        if part not in COMPUTE_PARTS and part not in LOOP_PARTS:
            raise KeyError(
                f"part={part!r} is not a stage-loop part; one of "
                f"{sorted(COMPUTE_PARTS | LOOP_PARTS)}"
            )
        with self._lock:
            self.parts_s[part] = self.parts_s.get(part, 0.0) + seconds

    def microbatch_done(self, wall_s: float, parts_s: Mapping[str, float] = {}) -> None:
        """The compute thread finished a micro-batch of ``wall_s`` seconds, ``parts_s`` its
        compute parts (added with the wall at once, so ``other`` never loses a wall).

        Raises:
            KeyError: a part of ``parts_s`` is not one of :data:`COMPUTE_PARTS`.
        """
        unknown = sorted(set(parts_s) - set(COMPUTE_PARTS))
        if unknown:
            raise KeyError(f"parts_s={unknown}: not compute parts; {sorted(COMPUTE_PARTS)}")
        with self._lock:
            self.microbatches += 1
            self.wall_s += wall_s
            for part, seconds in parts_s.items():
                self.parts_s[part] = self.parts_s.get(part, 0.0) + seconds

    def plan_done(self) -> None:
        """The loop thread handled one plan."""
        with self._lock:
            self.plans += 1

    def to_json(self) -> dict[str, Any]:
        """``{"rank", "microbatches", "plans", "wall_s", "parts_s", "other_s"}``; ``other_s`` =
        ``wall_s`` minus the compute parts."""
        with self._lock:
            parts = dict(self.parts_s)
            covered = sum(v for k, v in parts.items() if k in COMPUTE_PARTS)
            return {
                "rank": self.rank,
                "microbatches": self.microbatches,
                "plans": self.plans,
                "wall_s": self.wall_s,
                "parts_s": parts,
                "other_s": self.wall_s - covered,
            }

    def write(self, directory: str | Path) -> Path:
        """Write :meth:`to_json` to ``directory/stage-<rank>.json`` (the directory made if
        missing); returns the path."""
        path = Path(directory) / f"{FILE_PREFIX}{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path


def read_profiles(directory: str | Path) -> list[dict[str, Any]]:
    """The stages' :meth:`LoopProfile.to_json` written in ``directory``, by rank (those
    present)."""
    found = [json.loads(p.read_text()) for p in Path(directory).glob(f"{FILE_PREFIX}*.json")]
    return sorted(found, key=lambda p: int(p["rank"]))


def loop_table(profile: Mapping[str, Any]) -> list[str]:
    """Lines of one stage's table: ms per micro-batch and share of the compute wall for each
    compute part present, ``other``, ``wall``; then the loop-thread parts in ms per plan.

    Raises:
        ValueError: the profile has no micro-batch.
    """
    n = int(profile["microbatches"])
    if n < 1:
        raise ValueError(f"stage {profile['rank']}: microbatches={n}; nothing to tabulate")
    wall, parts = float(profile["wall_s"]), profile["parts_s"]
    lines = [f"{'part':<12} {'ms/micro-batch':>15} {'share':>7}"]

    def row(name: str, seconds: float) -> str:
        share = seconds / wall if wall > 0 else 0.0
        return f"{name:<12} {seconds * 1e3 / n:>15.3f} {share:>7.1%}"

    lines += [row(part, parts[part]) for part in COMPUTE_PARTS if part in parts]
    lines.append(row("other", float(profile["other_s"])))
    lines.append(row("wall", wall))
    plans = int(profile["plans"])
    for part in LOOP_PARTS:
        if part in parts and plans:
            lines.append(f"{part:<12} {parts[part] * 1e3 / plans:>15.3f} ms/plan (loop thread)")
    return lines
