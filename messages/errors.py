"""Error codes: the `code` of every `ErrorReply` (messages/common.py) and `MessageError`
(messages/codec.py). Defined here, below both, so the codec raises members without importing
the messages; decoding an `ErrorReply` whose code is none of them is a `MessageError`.

Codes travel as their value: a new code is a wire change (an older peer refuses it).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a message could not be handled. Short and machine-readable: callers branch on it,
    the reply's `text` is for people."""

    # Decoding (a `MessageError`; the receiver answers an undecodable message with its code).
    EMPTY = "empty"  # a message of no frames
    TOO_LARGE = "too_large"  # too many frames, or one over the frame limit
    BAD_MSGPACK = "bad_msgpack"  # frame 0 (or a relayed frame) is not msgpack
    BAD_ENVELOPE = "bad_envelope"  # not [tag, version, *fields], or a relayed frame of another type
    UNKNOWN_TAG = "unknown_tag"  # no message is registered under the tag
    BAD_VERSION = "bad_version"  # the message's version is not the one the receiver speaks
    BAD_ARITY = "bad_arity"  # the wrong number of fields
    BAD_FIELD = "bad_field"  # a field of the wrong type, or an enum value that is no member
    BAD_ARRAY = "bad_array"  # an array of the wrong dtype or rank, or a malformed array header
    BAD_EXT = "bad_ext"  # a msgpack ExtType the codec does not know
    # A malformed message no code above names (MessageError's default); also the coordinator's
    # answer to an engine whose StepOutputs it cannot relay.
    BAD_MESSAGE = "bad_message"

    # Any actor (actors/base.py).
    UNEXPECTED_MESSAGE = "unexpected_message"  # a message type the receiver does not take there
    INTERNAL = "internal"  # the receiver's handler raised (a bug on its side); it keeps running

    # Services (allocator, mamba_cache) and the coordinator's control checks.
    BAD_REQUEST = "bad_request"  # a well-formed message whose values are invalid; nothing changed
    ILLEGAL_STATE = "illegal_state"  # a service message out of order (ops before init, ...)

    # Lifecycle control (messages/lifecycle.py): the coordinator's answer to a client, or an
    # engine's to the coordinator.
    NOT_AUTHORIZED = "not_authorized"  # a control without the runtime's control token
    ILLEGAL_TRANSITION = "illegal_transition"  # a control the current state does not allow
    BUSY = "busy"  # a control while another one still waits for the engines
    CONTROL_FAILED = "control_failed"  # an engine (or its gpu worker) failed it; the state stays

    # Start-up.
    LOAD_FAILED = "load_failed"  # an engine could not load its model (to clients waiting on it)
    # The coordinator refuses an engine: its rank is out of range or taken, or its block size
    # differs from the runtime's.
    RANK_REFUSED = "rank_refused"
