"""Per-token weight versions in the engine's pure core and on the wire (issue 26 item 3): the
spans a request's outputs carry (actors/engine/outputs.py) across a weight update between
steps, cut to each streamed output's tokens and trimmed with a dropped stop word, agreeing
with the policy staleness; the client's joining of delta spans (runtime/outputs.py); and
RequestOutput frames from senders older than the field (decoded and relayed unchanged).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from taipan.actors.engine.outputs import version_spans
from taipan.messages.codec import MessageError, decode, encode_frame
from taipan.messages.requests import RequestOutput, StepOutputs
from taipan.outputs import join_versions
from tests.test_scheduler import Harness, fake_token, make_plan, make_request


def test_version_spans_are_cut_to_the_tokens_asked_for():
    spans = [(0, 0), (3, 4), (4, 9)]
    assert version_spans(spans, 0, 12).tolist() == [[0, 0], [3, 4], [4, 9]]
    assert version_spans(spans, 2, 6).tolist() == [[0, 2], [3, 4]]
    assert version_spans(spans, 4, 9).tolist() == [[3, 4]]
    assert version_spans(spans, 10, 12).tolist() == [[4, 10]]
    assert version_spans([], 0, 0).shape == (0, 2)


def test_joined_spans_start_again_only_where_the_version_changes():
    assert join_versions([(0, 0)], [(0, 3), (1, 5)]) == [(0, 0), (1, 5)]
    assert join_versions([], [(2, 0)]) == [(2, 0)]
    assert join_versions([(0, 0), (1, 5)], []) == [(0, 0), (1, 5)]


class Recorder(Harness):
    """The scheduler harness, keeping every RequestOutput sent."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.outputs: dict[int, list[RequestOutput]] = {}

    def sent(self, outputs) -> None:
        for o in outputs:
            self.outputs.setdefault(o.request_id, []).append(o)

    def run_until(self, req, n: int) -> None:
        while len(req.generated) < n:
            assert self.step()


def _spans(outputs: list[RequestOutput]) -> list[tuple[int, int]]:
    spans = []
    for o in outputs:
        spans = join_versions(spans, [tuple(s) for s in o.weight_versions.tolist()])
    return spans


def test_an_update_between_steps_starts_a_span_in_streamed_and_whole_outputs():
    h = Recorder(make_plan(), chunked=False)
    streamed = make_request(1, 5, max_tokens=12, stream=True)
    whole = make_request(2, 7, max_tokens=12)
    h.add(streamed)
    h.add(whole)
    h.run_until(streamed, 4)
    k = [len(streamed.generated), len(whole.generated)]
    h.sched.new_weights(7)  # (no step in flight: the harness applied each result)
    h.run()
    deltas = h.outputs[1]
    assert len(deltas) == 12  # one token each
    for i, d in enumerate(deltas):
        assert d.weight_versions.tolist() == [[0 if i < k[0] else 7, i]]
    assert _spans(deltas) == [(0, 0), (7, k[0])]
    [out] = h.outputs[2]
    assert out.weight_versions.tolist() == [[0, 0], [7, k[1]]]
    for outs, req, n in [(deltas, streamed, k[0]), (h.outputs[2], whole, k[1])]:
        policy = outs[-1].policy_staleness.tolist()
        p = len(req.prompt)
        assert policy == [1] * (p + n) + [0] * (12 - n)  # one update: one span change after


def test_a_dropped_stop_word_takes_its_versions_with_it():
    h = Recorder(make_plan(), chunked=False)
    p = 5
    word = (fake_token(p + 3), fake_token(p + 4))  # generated tokens 3 and 4
    req = make_request(1, p, max_tokens=20, stop_word_ids=(word,))
    h.add(req)
    h.run_until(req, 4)
    h.sched.new_weights(1)  # token 4, which completes the word, comes from version 1
    h.run()
    [out] = h.outputs[1]
    assert out.new_token_ids.tolist() == [fake_token(p + j) for j in range(3)]
    assert out.weight_versions.tolist() == [[0, 0]]


def _older_frame(out: RequestOutput) -> bytes:
    """`out` as a sender from before weight_versions encodes it: its first 19 fields."""
    items = msgpack.unpackb(encode_frame(out), raw=False)
    return msgpack.packb(items[: 2 + 19])


def test_an_output_from_before_weight_versions_decodes_and_relays():
    out = RequestOutput(4, np.array([7, 8], np.int32), True, "length", None, 3, 2)
    frame = _older_frame(out)
    old = decode([frame])
    assert old.new_token_ids.tolist() == [7, 8] and old.weight_versions.shape[0] == 0
    step = StepOutputs(np.array([4], np.int64), np.array([True]), (frame,))
    assert decode([step.relayed(0, 9)]).request_id == 9
    cut = msgpack.packb(msgpack.unpackb(frame, raw=False)[:-1])  # a required field missing
    with pytest.raises(MessageError):
        decode([cut])
    with pytest.raises(MessageError):
        StepOutputs(np.array([4], np.int64), np.array([True]), (cut,)).relayed(0, 9)
