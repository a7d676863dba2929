"""All or none over a set of members: the one shape of every control that must hold on all of
them or on none (DESIGN.md §7), whatever carries it:

- an engine over its expert-parallel group (actors/engine/controls.py `_group_control`, the
  outcomes in an EpOutcome round);
- a gpu leader over its tensor-parallel followers (actors/gpu/actor.py `_stage_everywhere`,
  the answers over PUB/SUB).

`two_phase` runs it: every member stages (a change that can still be taken back; a weight update
is received into a second buffer), the outcomes are gathered as `Failures`, then every member
keeps it if none failed, else each member that staged it undoes it. The error names every member
that failed. The callers differ only in transport and in what "keep" and "undo" send. The
coordinator's weight update over its data-parallel ranks (a `hold` round: actors/coordinator/
actor.py `_decide_weights`) has the same three phases, but as rounds of its lifecycle table
(answers, timeouts, deaths) whose failure is the client's ErrorReply, so it keeps its own.

Pure: no sockets; the callers own the members and the messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Hashable, Mapping


@dataclasses.dataclass(frozen=True)
class Failures:
    """The members where the staging failed, with why (empty: every member staged it)."""

    why: Mapping[Hashable, str]

    @classmethod
    def of(cls, outcomes: Mapping[Hashable, str | None]) -> Failures:
        """From every member's outcome (None: it staged)."""
        return cls({m: e for m, e in outcomes.items() if e is not None})

    @property
    def ok(self) -> bool:
        return not self.why

    def describe(self, name: Callable[[Hashable], str] = str) -> str:
        """'<member>: why; ...' in member order (`name` names a member)."""
        return "; ".join(f"{name(m)}: {self.why[m]}" for m in sorted(self.why))


async def two_phase(
    stage: Callable[[], Awaitable[Failures | None]],
    keep: Callable[[], Awaitable[object]],
    undo: Callable[[Failures], Awaitable[object]],
) -> Failures | None:
    """Stage on every member and gather the outcomes (`stage`), then `keep` everywhere if none
    failed, else `undo` where it was staged (given the failures). Returns the failures; None
    when `stage` found the members broken up (one gone: the caller has ended its part, and
    nothing is kept or undone)."""
    failures = await stage()
    if failures is None:
        return None
    if failures.ok:
        await keep()
    else:
        await undo(failures)
    return failures
