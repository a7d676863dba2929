"""The all-or-none shape (actors/all_or_none.py) that the expert-parallel group's controls and the
tensor-parallel peers' weight updates share: keep only when every member staged, undo otherwise,
nothing when the members broke up."""

from __future__ import annotations

import pytest

from taipan.actors.all_or_none import Failures, two_phase


def test_failures_keep_only_the_members_that_failed_and_name_them_in_member_order():
    failed = Failures.of({2: "no path", 0: None, 10: "out of memory", 1: None})
    assert not failed.ok and set(failed.why) == {2, 10}
    assert failed.describe(lambda r: f"engine {r}") == "engine 2: no path; engine 10: out of memory"
    assert Failures.of({0: None, 1: None}).ok


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [({0: None, 1: None}, ["stage", "keep"]), ({0: None, 1: "bad"}, ["stage", "undo {1: 'bad'}"])],
)
async def test_two_phase_keeps_when_all_staged_else_undoes(outcomes, expected):
    calls = []

    async def stage():
        calls.append("stage")
        return Failures.of(outcomes)

    async def keep():
        calls.append("keep")

    async def undo(failed):
        calls.append(f"undo {dict(failed.why)}")

    result = await two_phase(stage, keep, undo)
    assert calls == expected and result.ok == (expected[-1] == "keep")


@pytest.mark.asyncio
async def test_a_broken_group_neither_keeps_nor_undoes():
    calls = []

    async def stage():
        return None

    async def keep():
        calls.append("keep")

    async def undo(failed):
        calls.append("undo")

    assert await two_phase(stage, keep, undo) is None and calls == []
