from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WarmRequest(_message.Message):
    __slots__ = ("job", "rank", "files", "groups", "file_index", "offset", "length", "stride", "count", "group_index", "token")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    files: _containers.RepeatedScalarFieldContainer[str]
    groups: _containers.RepeatedScalarFieldContainer[str]
    file_index: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    group_index: _containers.RepeatedScalarFieldContainer[int]
    token: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., groups: _Optional[_Iterable[str]] = ..., file_index: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., group_index: _Optional[_Iterable[int]] = ..., token: _Optional[str] = ...) -> None: ...

class FilePlan(_message.Message):
    __slots__ = ("path", "size_bytes", "needed_bytes", "num_runs", "cost_bytes", "decision", "warm_bytes", "warm_now_bytes", "stream_bytes_per_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    COST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    WARM_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_NOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    needed_bytes: int
    num_runs: int
    cost_bytes: int
    decision: str
    warm_bytes: int
    warm_now_bytes: int
    stream_bytes_per_s: float
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., needed_bytes: _Optional[int] = ..., num_runs: _Optional[int] = ..., cost_bytes: _Optional[int] = ..., decision: _Optional[str] = ..., warm_bytes: _Optional[int] = ..., warm_now_bytes: _Optional[int] = ..., stream_bytes_per_s: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("request_bytes", "seek_cost_bytes", "files", "request_id")
    REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEEK_COST_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_bytes: int
    seek_cost_bytes: int
    files: _containers.RepeatedCompositeFieldContainer[FilePlan]
    request_id: int
    def __init__(self, request_bytes: _Optional[int] = ..., seek_cost_bytes: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FilePlan, _Mapping]]] = ..., request_id: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, groups: _Optional[_Iterable[int]] = ...) -> None: ...

class Failed(_message.Message):
    __slots__ = ("groups", "code", "reason")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[int]
    code: str
    reason: str
    def __init__(self, groups: _Optional[_Iterable[int]] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("ready", "failed")
    READY_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ready: int
    failed: int
    def __init__(self, ready: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("bytes_done", "in_flight")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    in_flight: int
    def __init__(self, bytes_done: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class WarmEvent(_message.Message):
    __slots__ = ("plan", "ready", "failed", "done", "heartbeat")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    ready: Ready
    failed: Failed
    done: Done
    heartbeat: Heartbeat
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., failed: _Optional[_Union[Failed, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class ConsumedRequest(_message.Message):
    __slots__ = ("request_id", "groups", "token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    groups: _containers.RepeatedScalarFieldContainer[int]
    token: str
    def __init__(self, request_id: _Optional[int] = ..., groups: _Optional[_Iterable[int]] = ..., token: _Optional[str] = ...) -> None: ...

class ConsumedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("job", "rank", "groups", "groups_ready", "groups_failed", "bytes_requested", "bytes_ready", "age_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READY_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    groups: int
    groups_ready: int
    groups_failed: int
    bytes_requested: int
    bytes_ready: int
    age_s: float
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., groups: _Optional[int] = ..., groups_ready: _Optional[int] = ..., groups_failed: _Optional[int] = ..., bytes_requested: _Optional[int] = ..., bytes_ready: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "uptime_s", "method", "workers", "seek_cost_bytes", "ranks", "files", "bytes_requested", "bytes_planned", "bytes_warm", "bytes_read_total", "bytes_verified_total", "throughput_bytes_per_s", "eta_s", "queue_depth", "in_flight", "budget_bytes", "held_bytes", "waiting_for_budget", "waiting_reason", "mounts", "refusals")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SEEK_COST_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PLANNED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WARM_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_VERIFIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_BUDGET_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    method: str
    workers: int
    seek_cost_bytes: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    files: _containers.RepeatedCompositeFieldContainer[FilePlan]
    bytes_requested: int
    bytes_planned: int
    bytes_warm: int
    bytes_read_total: int
    bytes_verified_total: int
    throughput_bytes_per_s: float
    eta_s: float
    queue_depth: int
    in_flight: int
    budget_bytes: int
    held_bytes: int
    waiting_for_budget: int
    waiting_reason: str
    mounts: _containers.RepeatedCompositeFieldContainer[MountStatus]
    refusals: _containers.RepeatedCompositeFieldContainer[RefusalCount]
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., method: _Optional[str] = ..., workers: _Optional[int] = ..., seek_cost_bytes: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., files: _Optional[_Iterable[_Union[FilePlan, _Mapping]]] = ..., bytes_requested: _Optional[int] = ..., bytes_planned: _Optional[int] = ..., bytes_warm: _Optional[int] = ..., bytes_read_total: _Optional[int] = ..., bytes_verified_total: _Optional[int] = ..., throughput_bytes_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., waiting_for_budget: _Optional[int] = ..., waiting_reason: _Optional[str] = ..., mounts: _Optional[_Iterable[_Union[MountStatus, _Mapping]]] = ..., refusals: _Optional[_Iterable[_Union[RefusalCount, _Mapping]]] = ...) -> None: ...

class RefusalCount(_message.Message):
    __slots__ = ("cause", "count")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    cause: str
    count: int
    def __init__(self, cause: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class MountStatus(_message.Message):
    __slots__ = ("mount", "stream_bytes_per_s", "sampled_bytes", "seek_cost_bytes", "seek_probe_due")
    MOUNT_FIELD_NUMBER: _ClassVar[int]
    STREAM_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEEK_COST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEEK_PROBE_DUE_FIELD_NUMBER: _ClassVar[int]
    mount: str
    stream_bytes_per_s: float
    sampled_bytes: int
    seek_cost_bytes: int
    seek_probe_due: bool
    def __init__(self, mount: _Optional[str] = ..., stream_bytes_per_s: _Optional[float] = ..., sampled_bytes: _Optional[int] = ..., seek_cost_bytes: _Optional[int] = ..., seek_probe_due: _Optional[bool] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("descriptors", "last")
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    descriptors: int
    last: bool
    def __init__(self, descriptors: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class GrantReply(_message.Message):
    __slots__ = ("token", "expires_s", "code", "reason", "stream_bytes_per_s")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STREAM_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_s: float
    code: str
    reason: str
    stream_bytes_per_s: float
    def __init__(self, token: _Optional[str] = ..., expires_s: _Optional[float] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ..., stream_bytes_per_s: _Optional[float] = ...) -> None: ...
