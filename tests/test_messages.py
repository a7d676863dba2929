"""The wire codec: every registered message round-trips, and no input makes decode raise anything
but MessageError.

Instances are built from each message's field type hints, so a newly registered message is
covered without touching this file (an unsupported field type fails `test_factory_covers_...`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import types
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from taipan import messages
from taipan.messages import MessageError, decode, encode
from taipan.messages.allocator import AllocatorInit, PrefixCachingEvictionPolicy
from taipan.messages.codec import (
    ALLOWED_DTYPES,
    EXT_ARRAY_FRAME,
    EXT_ARRAY_INLINE,
    INLINE_ARRAY_BYTES,
    MAX_FRAMES,
    TAG_RANGES,
    ArraySpec,
    encode_frame,
    message,
    replace_first_field,
)
from taipan.messages.common import ErrorReply, Heartbeat
from taipan.messages.errors import ErrorCode
from taipan.messages.gpu import StepPlan, StepResult
from taipan.messages.lifecycle import KVCacheManagementMode, Suspend, UpdateWeights
from taipan.messages.requests import (
    AbortRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    SubmitRequest,
)
from taipan.messages.schema import _checker

FAST = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
DEEP = settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGE_TYPES = sorted(messages.registry().items())
DTYPES = sorted(ALLOWED_DTYPES)

# Module that defines a message -> the family whose tag range it must use (DESIGN.md §3).
MODULE_FAMILY = {
    "taipan.messages.common": "connection",
    "taipan.messages.requests": "requests",
    "taipan.messages.lifecycle": "lifecycle",
    "taipan.messages.consensus": "consensus",
    "taipan.messages.allocator": "allocator",
    "taipan.messages.mamba_cache": "mamba_cache",
    "taipan.messages.gpu": "gpu",
    "taipan.messages.stats": "stats",
}


# --- building values from type hints -------------------------------------------------------


def _union_args(tp) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _array_spec(tp) -> ArraySpec | None:
    if typing.get_origin(tp) is typing.Annotated:
        return typing.get_args(tp)[1]
    return None


def sample_value(tp, i: int = 0):
    """A deterministic, non-trivial value of type tp (i varies it between fields)."""
    if (spec := _array_spec(tp)) is not None:
        dtype = spec.dtypes[i % len(spec.dtypes)]
        shape = (12,) if spec.ndim == 1 else (3, 4) + (1,) * max(0, (spec.ndim or 2) - 2)
        return (np.arange(12) % 7).astype(dtype).reshape(shape)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = list(tp)
        return members[i % len(members)]
    if (args := _union_args(tp)) is not None:
        return sample_value(next(a for a in args if a is not type(None)), i)
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        return tuple(sample_value(typing.get_args(tp)[0], i + k) for k in range(3))
    if origin is dict:
        return {f"k{k}": sample_value(typing.get_args(tp)[1], i + k) for k in range(2)}
    if getattr(tp, "IS_STRUCT", False):
        return build_sample(tp, i)
    if tp is bool:
        return i % 2 == 1
    if tp is int:
        return 1000 + i
    if tp is float:
        return 0.25 + i
    if tp is str:
        return f"field {i} ünïcødé"
    if tp is bytes:
        return bytes(range(i, i + 5))
    raise TypeError(f"no sample value for {tp!r}: extend sample_value")


def build_sample(cls, salt: int = 0):
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    return cls(**{f.name: sample_value(hints[f.name], salt + k) for k, f in enumerate(fields)})


def strategy_for(tp) -> st.SearchStrategy:
    """A hypothesis strategy for any value the codec must carry for type tp."""
    if (spec := _array_spec(tp)) is not None:
        dims = dict(min_dims=1, max_dims=3) if spec.ndim is None else dict(min_dims=spec.ndim)
        dims.setdefault("max_dims", spec.ndim)
        shapes = hnp.array_shapes(**dims, min_side=0, max_side=5)
        return st.sampled_from(spec.dtypes).flatmap(lambda d: hnp.arrays(np.dtype(d), shapes))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if typing.get_origin(tp) is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if (args := _union_args(tp)) is not None:
        return st.one_of([strategy_for(a) for a in args])
    if tp is type(None):
        return st.none()
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=5).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy_for(typing.get_args(tp)[1]))
    if getattr(tp, "IS_STRUCT", False):
        return message_strategy(tp)
    simple = {
        bool: st.booleans(),
        int: st.integers(-(2**63), 2**64 - 1),
        float: st.floats(allow_nan=True, allow_infinity=True),
        str: st.text(max_size=20),
        bytes: st.binary(max_size=20),
    }
    return simple[tp]


def message_strategy(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


any_message = st.sampled_from([cls for _, cls in MESSAGE_TYPES]).flatmap(message_strategy)


def assert_same(a, b, where="msg"):
    """Field-by-field equality; arrays by dtype, shape and bytes; NaN equals NaN."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, tuple | list):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def roundtrip(msg):
    frames = encode(msg)
    # What a socket delivers: plain bytes per frame.
    return decode([bytes(f) for f in frames])


def frame0(*items) -> list[bytes]:
    return [msgpack.packb(list(items), use_bin_type=True)]


def array_ext(dtype, shape, data, code=EXT_ARRAY_INLINE):
    return msgpack.ExtType(code, msgpack.packb([dtype, shape, data], use_bin_type=True))


def output_with(array) -> list:
    """RequestOutput fields (tag first) with `array` as new_token_ids."""
    return [22, 1, 7, array, False, None, None, 3, 0, 0, *_OUTPUT_TAIL]  # (0 cached tokens)


# --- the registry ----------------------------------------------------------------------------


def test_registry_is_not_empty_and_tags_match_classes():
    assert len(MESSAGE_TYPES) >= 10
    names = [cls.__name__ for _, cls in MESSAGE_TYPES]
    assert len(names) == len(set(names))
    for tag, cls in MESSAGE_TYPES:
        assert cls.TAG == tag and isinstance(cls.VERSION, int)
        assert dataclasses.is_dataclass(cls)


@pytest.mark.parametrize("tag, cls", MESSAGE_TYPES, ids=[c.__name__ for _, c in MESSAGE_TYPES])
def test_tag_is_in_its_family_range(tag, cls):
    family = MODULE_FAMILY[cls.__module__]
    assert tag in TAG_RANGES[family], f"{cls.__name__} ({tag}) outside {family}"


def test_family_ranges_are_disjoint():
    seen: set[int] = set()
    for r in TAG_RANGES.values():
        assert seen.isdisjoint(r)
        seen |= set(r)


def test_taken_or_out_of_range_tag_is_refused_at_import():
    before = messages.registry()
    with pytest.raises(TypeError, match="taken"):

        @message(0)
        class Clash:
            x: int

    with pytest.raises(TypeError, match="outside"):

        @message(10_000)
        class Stray:
            x: int

    assert messages.registry() == before


def test_messages_are_frozen():
    msg = AbortRequest(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.request_id = 4  # type: ignore[misc]


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("tag, cls", MESSAGE_TYPES, ids=[c.__name__ for _, c in MESSAGE_TYPES])
def test_factory_covers_every_message_and_it_roundtrips(tag, cls):
    for salt in (0, 1):
        msg = build_sample(cls, salt)
        assert_same(msg, roundtrip(msg))


@FAST
@given(any_message)
def test_random_messages_roundtrip(msg):
    assert_same(msg, roundtrip(msg))


def test_submit_request_roundtrip_keeps_sampling_struct():
    sp = SamplingParams(max_tokens=5, temperature=0.0, seed=2**63 - 1, stop_token_ids=(1, 2))
    msg = SubmitRequest(9, np.arange(4, dtype=np.int32), sp, True)
    out = roundtrip(msg)
    assert out.sampling == sp and isinstance(out.sampling.stop_token_ids, tuple)


def test_int_where_float_is_accepted_as_float():
    out = decode(frame0(Heartbeat.TAG, 1, 3))
    assert out.time == 3.0 and type(out.time) is float


def test_numpy_scalars_encode_as_plain_numbers():
    out = roundtrip(Heartbeat(np.float32(1.5)))  # type: ignore[arg-type]
    assert out.time == 1.5
    out = roundtrip(AbortRequest(np.int64(12)))  # type: ignore[arg-type]
    assert out.request_id == 12 and type(out.request_id) is int


def test_large_arrays_travel_as_extra_frames():
    big = np.arange(INLINE_ARRAY_BYTES // 4 + 1, dtype=np.int32)  # one element over
    edge = np.arange(INLINE_ARRAY_BYTES // 4, dtype=np.int32)  # exactly the inline limit
    msg = RequestOutput(1, big, True, "length", None, 3, len(big))
    frames = encode(msg)
    assert len(frames) == 2 and frames[1].nbytes == big.nbytes
    assert len(frames[0]) < 1024  # the array is not copied into the header
    assert_same(msg, roundtrip(msg))
    assert len(encode(RequestOutput(1, edge, True, "length", None, 3, 0))) == 1


def test_encode_frame_keeps_every_array_inline():
    big = np.arange(INLINE_ARRAY_BYTES // 4 + 1, dtype=np.int32)
    msg = RequestOutput(
        1, big, True, "length", None, 3, len(big), log_probs=(big * 0.5).astype(np.float32)
    )
    frame = encode_frame(msg)
    assert isinstance(frame, bytes) and len(frame) > 2 * big.nbytes
    assert_same(msg, decode([frame]))
    assert encode_frame(Heartbeat(2.0)) == encode(Heartbeat(2.0))[0]


def test_replace_first_field_renumbers_without_touching_the_rest():
    msg = RequestOutput(7, np.array([5, 6], np.int32), True, "stop", None, 3, 2, ttft=0.5)
    for new_id in (0, 1, 127, 128, 2**16, 2**40, 2**64 - 1):
        frame, (old, _, finished) = replace_first_field(encode_frame(msg), RequestOutput, new_id, 3)
        assert (old, finished) == (7, True)
        assert_same(dataclasses.replace(msg, request_id=new_id), decode([frame]))
    with pytest.raises(MessageError, match="not a one-frame RequestOutput") as info:
        replace_first_field(encode_frame(Heartbeat(1.0)), RequestOutput, 1)
    assert info.value.code == "bad_envelope"
    for bad in (b"", b"\xc1", encode_frame(msg)[:3], msgpack.packb([22, 2, 7])):
        with pytest.raises(MessageError):
            replace_first_field(bad, RequestOutput, 1)


@FAST
@given(st.binary(max_size=64))
def test_replace_first_field_of_random_bytes_raises_only_message_error(data):
    try:
        replace_first_field(data, RequestOutput, 1, peek=3)
    except MessageError:
        pass


def test_step_outputs_relay_each_entry_under_a_new_id_and_check_it():
    outs = [
        RequestOutput(11, np.array([1], np.int32), False, None, None, 4, 1),
        RequestOutput(12, np.array([2, 3], np.int32), True, "length", None, 4, 2),
    ]
    msg = roundtrip(StepOutputs.of(outs))
    assert msg.request_ids.tolist() == [11, 12] and msg.finished.tolist() == [False, True]
    assert msg.problem() is None and [o.request_id for o in msg.decoded()] == [11, 12]
    relayed = [decode([msg.relayed(i, 1)]) for i in range(2)]
    assert [o.request_id for o in relayed] == [1, 1]
    assert [o.new_token_ids.tolist() for o in relayed] == [[1], [2, 3]]
    lying = dataclasses.replace(msg, finished=np.array([True, True]))
    with pytest.raises(MessageError, match="entry 0: a RequestOutput of request 11 \\(finished"):
        lying.relayed(0, 1)
    with pytest.raises(MessageError, match="filed under request 12"):
        dataclasses.replace(msg, outputs=msg.outputs[::-1]).relayed(1, 1)
    assert "differ" in dataclasses.replace(msg, outputs=msg.outputs[:1]).problem()
    with pytest.raises(MessageError, match="entry 0 is a Heartbeat"):
        dataclasses.replace(msg, outputs=(encode_frame(Heartbeat(1.0)),)).decoded()


def test_several_large_arrays_keep_their_order():
    n = INLINE_ARRAY_BYTES  # elements: every int32/int64 array of n is over the inline limit
    arrays = {
        "input_ids": np.arange(n, dtype=np.int32),
        "positions": np.arange(n, dtype=np.int32)[::-1],
        "slot_mapping": np.arange(n, dtype=np.int64) * 3,
        "query_start_loc": np.array([0, n], dtype=np.int32),  # small: inline
        "seq_lens": np.array([n], dtype=np.int32),
        "block_tables": np.arange(4 * n, dtype=np.int32).reshape(4, n).T,  # not contiguous
        "sample": np.ones(1, dtype=np.int8),
        "temperature": np.ones(1, dtype=np.float32),
        "top_k": np.zeros(1, dtype=np.int32),
        "top_p": np.ones(1, dtype=np.float32),
        "min_p": np.zeros(1, dtype=np.float32),
        "seeds": np.array([2**62], dtype=np.int64),
        "gen_index": np.zeros(1, dtype=np.int32),
        "logprobs": np.zeros(1, dtype=np.int8),
        "top_n": np.zeros(1, dtype=np.int32),
        "prompt_targets": np.full(n, -1, dtype=np.int32),
    }
    msg = StepPlan(step=5, **arrays)
    frames = encode(msg)
    assert len(frames) == 1 + 5  # ids, positions, slots, tables, targets
    out = roundtrip(msg)
    assert_same(msg, out)
    assert out.block_tables.shape == (n, 4)


def carry(arr: np.ndarray) -> np.ndarray:
    """`arr` after a trip through the wire, in a field that takes any float array."""
    return roundtrip(UpdateWeights("", None, {"a": arr})).state["a"]


def test_frame_arrays_are_wrapped_without_a_copy():
    big = np.arange(INLINE_ARRAY_BYTES, dtype=np.int32)
    frames = encode(RequestOutput(1, big, False, None, None, 0, 0))
    out = decode(frames)
    assert np.shares_memory(out.new_token_ids, big)


def test_decoded_arrays_are_usable_with_numpy():
    small = np.array([[1, 2], [3, 4]], dtype=np.float16)
    big = np.linspace(0, 1, INLINE_ARRAY_BYTES, dtype=np.float32)
    for arr in (small, big):
        out = carry(arr)
        assert out.flags.c_contiguous and out.dtype.isnative
        assert np.array_equal(out + 1, arr + 1)
        assert float(out.sum()) == pytest.approx(float(arr.sum()))
        assert np.array_equal(out.astype(np.float64), arr.astype(np.float64))
        assert np.array_equal(np.sort(out, axis=None), np.sort(arr, axis=None))
        writable = out.copy()
        writable.flat[0] = 0


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (1, 1, 1, 1), (1,)])
def test_odd_shapes_roundtrip(shape):
    arr = np.ones(shape, dtype=np.float16)
    assert_same(arr, carry(arr))


def test_zero_dim_array_keeps_its_shape():
    assert carry(np.array(7, dtype=np.float64)).shape == ()


def test_non_native_byte_order_keeps_values():
    arr = np.array([1, 2, 300], dtype=">i4")
    out = roundtrip(RequestOutput(1, arr, False, None, None, 3, 0)).new_token_ids
    assert out.tolist() == [1, 2, 300]


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(TypeError, match="not a registered message"):
        encode(SamplingParams())
    with pytest.raises(TypeError, match="UpdateWeights.state: .*dtype complex128"):
        encode(UpdateWeights("", None, {"w": np.array([1 + 2j])}))
    with pytest.raises(TypeError, match="RequestOutput.new_token_ids: dtype object"):
        encode(RequestOutput(1, np.array(["a", None], dtype=object), False, None, None, 0, 0))


def test_array_fields_check_dtype_and_rank_at_both_ends():
    # The sender's bug is a TypeError at encode, naming the field ...
    with pytest.raises(TypeError, match="RequestOutput.new_token_ids: dtype int64, expected int32"):
        encode(RequestOutput(1, np.arange(3), False, None, None, 0, 0))
    with pytest.raises(TypeError, match="StepPlan.block_tables: 1-D array .* expected 2-D"):
        plan = build_sample(StepPlan)
        encode(dataclasses.replace(plan, block_tables=np.zeros(4, np.int32)))
    # ... and what arrives from elsewhere is a MessageError at decode.
    expect_error(frame0(*output_with(array_ext("int64", [2], b"\0" * 16))), "bad_array", "int64")
    expect_error(frame0(*output_with(array_ext("int32", [1, 1], b"\0" * 4))), "bad_array", "2-D")


def test_shared_empty_defaults_encode_as_any_empty_array_and_others_are_still_checked():
    """An optional array field left at its shared empty default is encoded from a cached wire
    form, unchecked (it is of its field's dtype and rank); anything else there is checked, the
    other dtype's shared empty and None included."""
    from taipan.messages.codec import share_empty

    wv = np.array([[0, 3]], np.int64)
    plain = RequestOutput(1, np.array([5], np.int32), False, None, None, 2, 1, weight_versions=wv)
    fresh = dataclasses.replace(plain, log_probs=np.zeros(0, np.float32))  # (not the shared one)
    assert encode(plain) == encode(fresh)
    assert roundtrip(plain).log_probs.dtype == np.float32
    shared_int32 = plain.policy_staleness  # (the shared empty of another field)
    with pytest.raises(TypeError, match="RequestOutput.log_probs: dtype int32"):
        encode(dataclasses.replace(plain, log_probs=shared_int32))
    with pytest.raises(TypeError, match="RequestOutput.top_n_ids"):
        encode(dataclasses.replace(plain, top_n_ids=None))
    with pytest.raises(ValueError, match="empty, read-only"):
        share_empty(np.zeros(0, np.float32))  # (writable)


def test_enum_fields_decode_to_members_and_refuse_other_values():
    out = roundtrip(RequestOutput(1, np.zeros(0, np.int32), True, "length", None, 1, 0))
    assert out.finish_reason is FinishReason.LENGTH
    assert Suspend("", "offload").mode is KVCacheManagementMode.OFFLOAD  # made, not decoded
    with pytest.raises(ValueError):
        Suspend("", "sideways")
    err = expect_error(frame0(44, 1, "", "sideways"), "bad_field")
    assert "Suspend.mode" in str(err) and "persist, offload, recompute" in str(err)


def test_error_codes_travel_as_their_strings_and_unknown_ones_do_not_decode():
    # The wire form is the code's string, as before ErrorCode existed: recorded logs replay.
    frame = msgpack.packb([2, 1, "load_failed", "no model", None], use_bin_type=True)
    reply = ErrorReply(ErrorCode.LOAD_FAILED, "no model", None)
    assert encode(reply) == [frame] and decode([frame]).code is ErrorCode.LOAD_FAILED
    assert ErrorReply("busy", "later", None).code is ErrorCode.BUSY  # made, not decoded
    with pytest.raises(ValueError):
        ErrorReply("no_such_code", "text", None)
    err = expect_error(frame0(2, 1, "no_such_code", "text", None), "bad_field")
    assert "ErrorReply.code" in str(err) and "'no_such_code' is not a ErrorCode" in str(err)
    assert MessageError("x").code is ErrorCode.BAD_MESSAGE


def test_allocator_init_policy_is_the_enum_or_the_empty_string_as_before():
    for policy in ("", "ref_zero", "lru"):
        frame = msgpack.packb([80, 1, 8, 16, policy], use_bin_type=True)
        assert encode(AllocatorInit(8, 16, policy)) == [frame]
        assert decode([frame]) == AllocatorInit(8, 16, policy)
    assert decode(frame0(80, 1, 8, 16, "")).prefix_policy == ""
    assert decode(frame0(80, 1, 8, 16, "lru")).prefix_policy is PrefixCachingEvictionPolicy.LRU
    with pytest.raises(ValueError):
        AllocatorInit(8, 16, "fifo")
    for bad in ("fifo", None, 0):
        err = expect_error(frame0(80, 1, 8, 16, bad), "bad_field")
        assert "AllocatorInit.prefix_policy" in str(err)


# --- bad inputs: always MessageError ---------------------------------------------------------


def expect_error(frames, code: str | None = None, match: str | None = None) -> MessageError:
    with pytest.raises(MessageError, match=match) as info:
        decode(frames)
    if code is not None:
        assert info.value.code == code, info.value
    return info.value


_ARR = array_ext("int32", [1], b"\0\0\0\0")
_SAMPLING = [16, 1.0, 0, 1.0, 0.0, None, False, [], [], [], False, False, False, 0, False, 1]
_STOP_TOKEN_IDS = 7  # its index in _SAMPLING
_F1, _I2, _F2 = (
    array_ext("float32", [0], b""),
    array_ext("int32", [0, 0], b""),
    array_ext("float32", [0, 0], b""),
)
_SUBMIT_TAIL = [array_ext("int64", [0], b""), 0]  # no block hashes, salt 0
_OUTPUT_TAIL = [_F1, _I2, _F2] * 2 + [[], None, None, _ARR, _ARR]  # RequestOutput optional fields


def _sampling_with(index: int, value) -> list:
    return [*_SAMPLING[:index], value, *_SAMPLING[index + 1 :]]


BAD_ENVELOPES = {
    "empty_list": ([], "empty"),
    "not_msgpack": ([b"\xc1"], "bad_msgpack"),
    "trailing_bytes": ([msgpack.packb([23, 1, 5]) + b"\x00"], "bad_msgpack"),
    "not_an_array": ([msgpack.packb({"tag": 23})], "bad_envelope"),
    "one_element": (frame0(23), "bad_envelope"),
    "tag_is_str": (frame0("23", 1, 5), "bad_envelope"),
    "tag_is_bool": (frame0(True, 1, 5), "bad_envelope"),
    "unknown_tag": (frame0(19, 1), "unknown_tag"),
    "negative_tag": (frame0(-1, 1), "unknown_tag"),
    "wrong_version": (frame0(23, 2, 5), "bad_version"),
    "version_is_str": (frame0(23, "1", 5), "bad_version"),
    "too_few_fields": (frame0(23, 1), "bad_arity"),
    "too_many_fields": (frame0(23, 1, 5, 6), "bad_arity"),
    "str_where_int": (frame0(23, 1, "5"), "bad_field"),
    "bool_where_int": (frame0(23, 1, True), "bad_field"),
    "float_where_int": (frame0(23, 1, 5.0), "bad_field"),
    "none_where_int": (frame0(23, 1, None), "bad_field"),
    "int_where_bool": (frame0(22, 1, 7, _ARR, 1, None, None, 3, 0, 0, *_OUTPUT_TAIL), "bad_field"),
    "int_where_str": (frame0(2, 1, 5, "text", None), "bad_field"),
    "bytes_where_str": (frame0(2, 1, b"code", "text", None), "bad_field"),
    "str_where_array": (frame0(*output_with("abc")), "bad_field"),
    "list_where_array": (frame0(*output_with([1, 2])), "bad_field"),
    "map_where_struct": (
        frame0(20, 1, 1, _ARR, {"max_tokens": 3}, False, *_SUBMIT_TAIL),
        "bad_field",
    ),
    "struct_wrong_arity": (frame0(20, 1, 1, _ARR, [1, 1.0], False, *_SUBMIT_TAIL), "bad_arity"),
    "struct_bad_item": (
        frame0(20, 1, 1, _ARR, _sampling_with(_STOP_TOKEN_IDS, ["x"]), False, *_SUBMIT_TAIL),
        "bad_field",
    ),
    "struct_str_tuple": (
        frame0(20, 1, 1, _ARR, _sampling_with(_STOP_TOKEN_IDS, "ab"), False, *_SUBMIT_TAIL),
        "bad_field",
    ),
    "int_map_key": ([msgpack.packb([2, 1, {1: "x"}, "t", None])], "bad_msgpack"),
    "str_map_key_where_str": (frame0(2, 1, {"k": "x"}, "t", None), "bad_field"),
    "unknown_ext": (frame0(*output_with(msgpack.ExtType(9, b"x"))), "bad_ext"),
}


def test_the_bad_envelope_fixtures_are_one_change_from_valid():
    assert (
        decode(frame0(20, 1, 1, _ARR, _SAMPLING, False, *_SUBMIT_TAIL)).sampling == SamplingParams()
    )
    assert (
        decode(frame0(22, 1, 7, _ARR, False, None, None, 3, 0, 0, *_OUTPUT_TAIL)).finished is False
    )
    reply = ErrorReply(ErrorCode.BAD_REQUEST, "text", None)
    assert decode(frame0(2, 1, "bad_request", "text", None)) == reply


@pytest.mark.parametrize("name", sorted(BAD_ENVELOPES))
def test_bad_envelopes_and_fields(name):
    frames, code = BAD_ENVELOPES[name]
    expect_error(frames, code)


def test_field_errors_name_the_message_and_field():
    err = expect_error(frame0(23, 1, "5"))
    assert "AbortRequest.request_id" in str(err) and "expected int" in str(err)
    err = expect_error(BAD_ENVELOPES["struct_bad_item"][0])
    assert "SamplingParams.stop_token_ids" in str(err)


def test_version_that_is_not_an_int_is_refused():
    expect_error(frame0(23, 1.5, 5), "bad_version")
    expect_error(frame0(23, None, 5), "bad_version")


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_an_int(version):
    expect_error(frame0(23, version, 5), "bad_version")


BAD_ARRAYS = {
    "object_dtype": array_ext("object", [1], b"\0" * 8),
    "complex64_dtype": array_ext("complex64", [1], b"\0" * 8),
    "dtype_typo": array_ext("int33", [1], b"\0" * 4),
    "dtype_not_str": array_ext(5, [1], b"\0" * 4),
    "short_data": array_ext("int32", [3], b"\0" * 11),
    "long_data": array_ext("int32", [3], b"\0" * 13),
    "shape_product_mismatch": array_ext("int16", [2, 3], b"\0" * 10),
    "negative_dim": array_ext("int8", [-1], b""),
    "bool_dim": array_ext("int8", [True], b"\0"),
    "float_dim": array_ext("int8", [1.0], b"\0"),
    "shape_not_list": array_ext("int8", 1, b"\0"),
    "huge_dim": array_ext("int8", [2**41], b""),
    "overflowing_product": array_ext("int8", [2**32, 2**32], b""),
    "too_many_dims": array_ext("int8", [1] * 70, b"\0"),
    "data_is_str": array_ext("int8", [1], "a"),
    "data_is_bool": array_ext("int8", [1], True),
    "frame_index_missing": array_ext("int8", [4], 1, EXT_ARRAY_FRAME),
    "frame_index_zero": array_ext("int8", [4], 0, EXT_ARRAY_FRAME),
    "frame_index_negative": array_ext("int8", [4], -1, EXT_ARRAY_FRAME),
    "header_not_msgpack": msgpack.ExtType(EXT_ARRAY_INLINE, b"\xc1"),
    "header_wrong_arity": msgpack.ExtType(EXT_ARRAY_INLINE, msgpack.packb(["int8", [1]])),
    "header_not_array": msgpack.ExtType(EXT_ARRAY_INLINE, msgpack.packb(7)),
}


@pytest.mark.parametrize("name", sorted(BAD_ARRAYS))
def test_bad_arrays(name):
    expect_error(frame0(*output_with(BAD_ARRAYS[name])))


def test_frame_index_out_of_range_with_extra_frames():
    ext = array_ext("int8", [4], 2, EXT_ARRAY_FRAME)
    expect_error(frame0(*output_with(ext)) + [b"\0" * 4], "bad_array", "missing frame 2")
    ext = array_ext("int32", [1], 1, EXT_ARRAY_FRAME)
    expect_error(frame0(*output_with(ext)) + [b"\0" * 5], "bad_array", "needs 4 bytes")
    assert decode(frame0(*output_with(ext)) + [b"\1" * 4]).new_token_ids.tolist() == [0x01010101]


def test_too_many_frames_and_oversized_frame():
    head = frame0(23, 1, 5)
    expect_error(head + [b""] * MAX_FRAMES, "too_large")
    assert decode(head + [b""] * (MAX_FRAMES - 1)) == AbortRequest(5)
    huge = np.zeros((1 << 30) + 1, dtype=np.uint8)  # calloc'd: no page is touched
    expect_error(head + [memoryview(huge)], "too_large")


def test_dict_fields_need_string_keys():
    check = _checker(dict[str, int])
    assert check({"a": 1}) == {"a": 1}
    for bad in ({b"a": 1}, {"a": "x"}, [("a", 1)]):
        with pytest.raises(MessageError):
            check(bad)


# --- fuzzing: nothing but MessageError -------------------------------------------------------


def decode_or_message_error(frames):
    try:
        msg = decode(frames)
    except MessageError:
        return None
    assert messages.registry()[type(msg).TAG] is type(msg)
    return msg


@FAST
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_message_error(data):
    decode_or_message_error([data])


@FAST
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
def test_random_frames_raise_only_message_error(frames):
    decode_or_message_error(frames)


# Random msgpack documents shaped like messages: a real tag and version, random field values
# (including array ExtTypes with random headers), so validation paths get exercised.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_ext = st.one_of(
    st.builds(
        array_ext,
        st.sampled_from([*DTYPES, "object", "complex64", "S3", "<i4", ""]),
        st.lists(st.integers(-2, 5), max_size=3) | st.integers(-(2**63), 2**63 - 1) | st.none(),
        st.binary(max_size=24) | st.integers(-1, 3),
        st.sampled_from([EXT_ARRAY_INLINE, EXT_ARRAY_FRAME]),
    ),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
)
_values = st.recursive(
    st.one_of(_scalars, _ext),
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@FAST
@given(
    st.sampled_from([tag for tag, _ in MESSAGE_TYPES]),
    st.sampled_from([1, 1, 1, 0, 2]),
    st.lists(_values, max_size=15),
    st.lists(st.binary(max_size=32), max_size=3),
)
def test_random_documents_raise_only_message_error(tag, version, values, extra):
    head = msgpack.packb([tag, version, *values], use_bin_type=True)
    decode_or_message_error([head, *extra])


@FAST
@given(any_message, st.data())
def test_truncated_encodings_raise_only_message_error(msg, data):
    frames = [bytes(f) for f in encode(msg)]
    k = data.draw(st.integers(0, len(frames) - 1), label="frame")
    cut = data.draw(st.integers(0, max(0, len(frames[k]) - 1)), label="cut")
    frames[k] = frames[k][:cut]
    decode_or_message_error(frames)


@pytest.mark.slow
@DEEP
@given(any_message)
def test_random_messages_roundtrip_deep(msg):
    assert_same(msg, roundtrip(msg))


@pytest.mark.slow
@DEEP
@given(any_message, st.data())
def test_flipped_byte_raises_only_message_error_deep(msg, data):
    test_flipped_byte_raises_only_message_error.hypothesis.inner_test(msg, data)


@FAST
@given(any_message, st.data())
def test_flipped_byte_raises_only_message_error(msg, data):
    frames = [bytearray(f) for f in encode(msg)]
    k = data.draw(st.integers(0, len(frames) - 1), label="frame")
    if not frames[k]:
        return
    pos = data.draw(st.integers(0, len(frames[k]) - 1), label="pos")
    frames[k][pos] ^= data.draw(st.integers(1, 255), label="xor")
    decode_or_message_error([bytes(f) for f in frames])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_big_message_damage_raises_only_message_error(data):
    arr = np.arange(INLINE_ARRAY_BYTES // 2, dtype=np.int32)
    frames = [bytes(f) for f in encode(StepResult(3, arr, None, 0.5))]
    assert len(frames) == 2
    action = data.draw(st.sampled_from(["drop", "cut", "extra"]))
    if action == "drop":
        frames = frames[:1]
    elif action == "cut":
        frames[1] = frames[1][: data.draw(st.integers(0, len(frames[1]) - 1))]
    else:
        frames.append(b"junk")
        assert decode(frames).token_ids.tolist() == arr.tolist()  # unused frames are harmless
        return
    expect_error(frames, "bad_array")


def test_error_reply_roundtrip_with_none():
    msg = ErrorReply("bad_message", "no", None)
    assert roundtrip(msg) == msg


def test_a_message_without_its_trailing_defaulted_fields_decodes():
    """Fields added later (with defaults) may be absent: an older sender's Pause is a keep
    pause; fewer fields than the required ones is still an arity error."""
    import msgpack

    from taipan.messages.codec import decode
    from taipan.messages.lifecycle import Pause, PauseMode

    old = msgpack.packb([42, 1, "tok"])
    assert decode([old]) == Pause("tok", PauseMode.KEEP, False)
    assert decode(encode(Pause("t", PauseMode.ABORT))) == Pause("t", PauseMode.ABORT, False)
    with pytest.raises(MessageError) as info:
        decode([msgpack.packb([42, 1])])
    assert info.value.code == "bad_arity" and "takes 1 to 4 fields" in str(info.value)


@pytest.mark.parametrize("n", [1, 3, 40])
@pytest.mark.parametrize("num_spans", [1, 2])
@pytest.mark.parametrize("rid", [0, 5, 2**62])
def test_a_streamed_outputs_frame_packed_directly_is_encode_frames(n, num_spans, rid):
    """messages/requests.py `stream_frame` (the engine's streamed outputs, composed from
    bytes: codec `list_head`, `pack_value`, `pack_ints`) gives encode_frame's bytes for the
    same RequestOutput; a token outside int32 is refused rather than sent as another."""
    from taipan.messages.codec import encode_frame
    from taipan.messages.requests import RequestOutput, stream_frame

    tokens = (np.arange(n, dtype=np.int32) * 7919) % 151_000
    spans = np.array([[2**40 + 3, 17], [2**40 + 4, 17 + n // 2]][:num_spans], dtype=np.int64)
    want = RequestOutput(rid, tokens, False, None, None, 300, 17 + n, 64, weight_versions=spans)
    got = stream_frame(rid, tokens.tolist(), 300, 17 + n, 64, [tuple(s) for s in spans.tolist()])
    assert got == encode_frame(want)
    with pytest.raises(Exception, match="format requires"):
        stream_frame(1, [2**31], 1, 1, 0, [(0, 0)])
