"""The Warmer service's wire encoding, built alone: the node's plans, events and status
in, protobuf messages out, and a Consumed report decoded."""

from __future__ import annotations

import numpy as np

from spanwarm.checkpoint.spans import Intervals
from spanwarm.daemon import wire
from spanwarm.daemon.request import FAILED, PENDING, READY, Event, EventKind
from spanwarm.errors import InvalidRequestError, ShardMissingError
from spanwarm.planning.costmodel import FilePlan
from spanwarm.rpc.v1 import warmer_pb2


def _plan(path: str, warm: int, seek_cost: int) -> FilePlan:
    return FilePlan(
        path=path,
        size_bytes=2 * warm,
        needed_bytes=warm,
        num_runs=1,
        cost_bytes=warm + seek_cost,
        decision="spans",
        runs=Intervals(np.array([0], dtype=np.int64), np.array([warm], dtype=np.int64)),
        seek_cost=seek_cost,
    )


def test_integers_saturate_to_their_fields_range_and_unknown_keys_are_dropped() -> None:
    reply = wire.message(
        warmer_pb2.Heartbeat, {"bytes_done": 2**70, "in_flight": -5, "not_a_field": 1}
    )
    assert reply.bytes_done == 2**64 - 1
    assert reply.in_flight == 0


def test_a_status_message_is_ascii_and_bounded() -> None:
    assert wire.details("caf\u00e9") == "caf\\xe9"
    long = wire.details("\U0001f600" * 1000)
    assert long.isascii()
    assert len(long) == wire.MAX_DETAILS
    assert long.endswith("...")


def test_a_refusal_keeps_its_cause_and_offset_whatever_the_path() -> None:
    path = "/ckpt/" + "d" * 5000 + "/model.safetensors"
    text = wire.describe(ShardMissingError(path, "no such file", offset=42))
    assert text.endswith(": no such file (at offset 42)")
    assert text.startswith("/ckpt/ddd")
    assert "/model.safetensors:" in text
    assert len(text) < wire.PATH_SHOWN + 100
    assert wire.describe(InvalidRequestError("bad")) == "bad"


def test_ready_groups_coalesce_failures_stay_apart_and_done_counts_the_states() -> None:
    events = [
        Event(EventKind.READY, (0, 1)),
        Event(EventKind.FAILED, (2,), "UNAVAILABLE", "f: EIO \u00e9"),
        Event(EventKind.READY, (3,)),
        Event(EventKind.DONE),
    ]
    state = np.array([READY, READY, FAILED, READY, PENDING], dtype=np.int8)
    messages = wire.event_messages(events, state)
    assert [m.WhichOneof("event") for m in messages] == ["ready", "failed", "done"]
    assert list(messages[0].ready.groups) == [0, 1, 3]
    assert list(messages[1].failed.groups) == [2]
    assert messages[1].failed.code == "UNAVAILABLE"
    assert messages[1].failed.reason == "f: EIO \\xe9"
    assert (messages[2].done.ready, messages[2].done.failed) == (3, 1)
    assert wire.event_messages([Event(EventKind.READY, ())], state) == []


def test_event_kinds_travel_as_their_strings() -> None:
    assert [str(k) for k in EventKind] == ["ready", "failed", "done"]
    assert Event(EventKind.DONE).kind == "done"


def test_a_plan_names_its_files_with_their_rates_and_the_largest_seek_cost() -> None:
    event = wire.plan_event(
        7, 300, [(_plan("/a", 100, 2**20), 5e8), (_plan("/b", 200, 2**23), 0.0)]
    )
    plan = event.plan
    assert (plan.request_id, plan.request_bytes, plan.seek_cost_bytes) == (7, 300, 2**23)
    assert [(f.path, f.warm_bytes, f.stream_bytes_per_s) for f in plan.files] == [
        ("/a", 100, 5e8),
        ("/b", 200, 0.0),
    ]
    assert wire.plan_event(1, 0, []).plan.seek_cost_bytes == 0


def test_a_heartbeat_carries_the_nodes_progress() -> None:
    beat = wire.heartbeat(123, 4).heartbeat
    assert (beat.bytes_done, beat.in_flight) == (123, 4)


def test_a_consumed_report_decodes_to_its_id_groups_and_token() -> None:
    data = warmer_pb2.ConsumedRequest(request_id=9, groups=[3, 1], token="t").SerializeToString()
    request_id, groups, token = wire.decode_consumed(data)
    assert (request_id, groups.tolist(), token) == (9, [3, 1], "t")
    assert groups.dtype == np.int64


def test_a_status_reply_holds_what_the_caller_is_shown() -> None:
    status = {
        "uptime_s": 1.5,
        "workers": 8,
        "bytes_warm": 2**65,
        "ranks": [{"job": "j", "rank": 3, "groups": 2, "groups_ready": 1, "age_s": 0.5}],
        "files": [{**_plan("/a", 100, 2**20).to_json(), "warm_now_bytes": 50}],
    }
    reply = wire.status_reply(
        status,
        version="1.2.3",
        mounts=[("ext4 /dev/sda", 1e9, 4096, 2**20, True)],
        refusals=[("outside_allowed_roots", 2)],
    )
    assert (reply.version, reply.workers, reply.bytes_warm) == ("1.2.3", 8, 2**64 - 1)
    assert [(r.job, r.rank, r.groups_ready) for r in reply.ranks] == [("j", 3, 1)]
    assert [(f.path, f.warm_now_bytes) for f in reply.files] == [("/a", 50)]
    mount = reply.mounts[0]
    assert (mount.mount, mount.sampled_bytes, mount.seek_probe_due) == ("ext4 /dev/sda", 4096, True)
    assert [(r.cause, r.count) for r in reply.refusals] == [("outside_allowed_roots", 2)]
    empty = wire.status_reply({"ranks": [], "files": []}, version="v", mounts=[], refusals=[])
    assert not empty.mounts
    assert not empty.refusals
