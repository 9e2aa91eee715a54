"""The spanwarm exception tree.

Bad arguments raise ``ValueError``/``TypeError``. Everything that goes wrong at run time
with a file or a checkpoint raises one of these, each naming the file, the byte offset
where it applies, and the cause, so that callers never parse messages::

    SpanwarmError
    ├── CheckpointError                 .path, .offset
    │   ├── NotARegularFileError        a FIFO, device or directory where a file belongs
    │   ├── HeaderError                 a safetensors file is malformed
    │   │   ├── FileTooShortError       shorter than the 8-byte length prefix
    │   │   ├── HeaderTooLargeError     declared header length over 100,000,000 bytes
    │   │   ├── HeaderPastEndError      declared header runs past the end of the file
    │   │   ├── HeaderNotJsonError      header is not a UTF-8 JSON object (or repeats a key)
    │   │   ├── UnknownDtypeError       dtype not in the format
    │   │   ├── InvalidTensorInfoError  shape / data_offsets / metadata of the wrong type
    │   │   ├── InvalidOffsetsError     data_offsets not starting at 0 or not contiguous
    │   │   ├── TensorSizeMismatchError byte size != numel x bits / 8
    │   │   └── DataSizeMismatchError   data section does not end at the end of the file
    │   ├── CheckpointLayoutError       a checkpoint as a whole is malformed
    │   │   ├── IndexFormatError        model.safetensors.index.json is not a valid index
    │   │   ├── ShardMissingError       a shard (named by the index, or given) does not exist
    │   │   ├── ShardOutsideCheckpointError  a shard path escapes the checkpoint directory
    │   │   ├── NoShardsError           nothing to load: no index and no *.safetensors
    │   │   ├── DuplicateTensorError    one tensor stored twice with no chunk offsets
    │   │   └── MetadataFormatError     a DCP .metadata file that is not DCP metadata
    │   ├── FileChangedError            a file shrank or was replaced while being warmed
    │   ├── StorageError                the storage failed a read or a lookup (EIO, ESTALE ...)
    │   ├── PathNotAllowedError         a file the daemon may not read or warm
    │   │   ├── OutsideAllowedRootsError  named outside every --allow root
    │   │   └── ElsewhereForDaemonError   not at its name in the daemon's own view
    │   └── SpanOutOfRangeError         a span reaches past the end of its file
    └── RequestError                    a Warm request the daemon refuses as a whole
        ├── InvalidRequestError         malformed: ragged columns, bad indices, bad paths
        ├── RequestTooLargeError        over a per-request limit (spans, files, cells, rows)
        ├── UnauthenticatedError        no valid token, on a socket others may reach
        └── AccessDeniedError           a descriptor that proves nothing; over a per-uid cap

Each class carries ``grpc_code``, the name of the gRPC status code the daemon answers
with, so clients and the daemon agree on one mapping without importing grpc here.
"""

from __future__ import annotations

import os
from typing import ClassVar

__all__ = [
    "AccessDeniedError",
    "CheckpointError",
    "CheckpointLayoutError",
    "DataSizeMismatchError",
    "DuplicateTensorError",
    "ElsewhereForDaemonError",
    "FileChangedError",
    "FileTooShortError",
    "HeaderError",
    "HeaderNotJsonError",
    "HeaderPastEndError",
    "HeaderTooLargeError",
    "IndexFormatError",
    "InvalidOffsetsError",
    "InvalidRequestError",
    "InvalidTensorInfoError",
    "MetadataFormatError",
    "NoShardsError",
    "NotARegularFileError",
    "OutsideAllowedRootsError",
    "PathNotAllowedError",
    "RequestError",
    "RequestTooLargeError",
    "ShardMissingError",
    "ShardOutsideCheckpointError",
    "SpanOutOfRangeError",
    "SpanwarmError",
    "StorageError",
    "TensorSizeMismatchError",
    "TooManyConnectionsError",
    "UnauthenticatedError",
    "UnknownDtypeError",
]


class SpanwarmError(Exception):
    """Base of every runtime error spanwarm raises."""

    grpc_code: ClassVar[str] = "INTERNAL"


class CheckpointError(SpanwarmError):
    """A checkpoint file or directory cannot be used as it is.

    ``path`` is the offending file (or directory); ``offset`` the file offset the
    problem was found at, when one applies.
    """

    grpc_code: ClassVar[str] = "FAILED_PRECONDITION"

    def __init__(self, path: str | os.PathLike[str], cause: str, *, offset: int | None = None):
        self.path = os.fspath(path)
        self.offset = offset
        self.cause = cause
        where = f" (at offset {offset})" if offset is not None else ""
        super().__init__(f"{self.path}: {cause}{where}")


class NotARegularFileError(CheckpointError):
    """The path names a FIFO, device, socket or directory, not a regular file, or a
    regular file of a kernel file system (procfs, sysfs, ...): nothing to warm."""


class HeaderError(CheckpointError):
    """A safetensors file's header or layout breaks the format."""


class FileTooShortError(HeaderError):
    """The file is shorter than the 8-byte header-length prefix."""


class HeaderTooLargeError(HeaderError):
    """The declared header length exceeds the format's 100,000,000-byte limit."""


class HeaderPastEndError(HeaderError):
    """The declared header extends past the end of the file."""


class HeaderNotJsonError(HeaderError):
    """The header is not UTF-8, not JSON, not a JSON object, or repeats a key."""


class UnknownDtypeError(HeaderError):
    """A tensor's dtype is not one the safetensors format defines."""


class InvalidTensorInfoError(HeaderError):
    """A tensor entry (or ``__metadata__``) has fields of the wrong type or shape."""


class InvalidOffsetsError(HeaderError):
    """Tensor data does not start at 0 or leaves a hole or an overlap between tensors."""


class TensorSizeMismatchError(HeaderError):
    """A tensor's byte size differs from numel x bits / 8 (or is not whole bytes)."""


class DataSizeMismatchError(HeaderError):
    """The data section does not end exactly at the end of the file."""


class CheckpointLayoutError(CheckpointError):
    """A checkpoint directory or index is malformed as a whole."""


class IndexFormatError(CheckpointLayoutError):
    """``model.safetensors.index.json`` is not a valid index."""


class ShardMissingError(CheckpointLayoutError):
    """A shard file named by the index, or given directly, does not exist."""

    grpc_code: ClassVar[str] = "NOT_FOUND"


class ShardOutsideCheckpointError(CheckpointLayoutError):
    """A shard path is absolute, climbs out with ``..``, or is a symlink leading outside."""


class NoShardsError(CheckpointLayoutError):
    """A checkpoint directory holds neither an index nor any ``*.safetensors`` file."""


class DuplicateTensorError(CheckpointLayoutError):
    """Two files store the same tensor name and neither records chunk offsets."""


class MetadataFormatError(CheckpointLayoutError):
    """A DCP ``.metadata`` file is not DCP's metadata (it is never unpickled as code)."""


class FileChangedError(CheckpointError):
    """A file shrank, grew or was replaced between the request and the read."""

    grpc_code: ClassVar[str] = "ABORTED"


class StorageError(CheckpointError):
    """The storage failed a read or a lookup: an I/O error, a stale handle, a lost mount."""

    grpc_code: ClassVar[str] = "UNAVAILABLE"


class PathNotAllowedError(CheckpointError):
    """A file the daemon may not read (``EACCES``, ``EPERM``) or may not warm (below)."""

    grpc_code: ClassVar[str] = "PERMISSION_DENIED"


class OutsideAllowedRootsError(PathNotAllowedError):
    """A file lies outside the daemon's allowed roots (symlinks resolved; for a
    descriptor, as the kernel names it: the path its opener sees)."""


class ElsewhereForDaemonError(PathNotAllowedError):
    """A descriptor named inside an allowed root, but the daemon's own view of the file
    system has another file (or none) at that name: it was opened in another mount
    namespace, or through a path that changed."""


class SpanOutOfRangeError(CheckpointError):
    """A span reaches past the end of its file."""

    grpc_code: ClassVar[str] = "OUT_OF_RANGE"


class RequestError(SpanwarmError):
    """A Warm request the daemon refuses as a whole."""

    grpc_code: ClassVar[str] = "INVALID_ARGUMENT"


class InvalidRequestError(RequestError):
    """Ragged span columns, an index outside its table, a relative path, a zero stride."""


class RequestTooLargeError(RequestError):
    """Over one of the daemon's per-request limits (spans, files, cells touched, rows)."""

    grpc_code: ClassVar[str] = "RESOURCE_EXHAUSTED"


class TooManyConnectionsError(RequestTooLargeError):
    """A uid, or users together, already hold as many connections to the socket as they
    may (closed before any byte: the caller's channel sees UNAVAILABLE)."""


class UnauthenticatedError(RequestError):
    """A call without a valid token on a socket others may reach (docs/daemon.md,
    "Security model")."""

    grpc_code: ClassVar[str] = "UNAUTHENTICATED"


class AccessDeniedError(RequestError):
    """A descriptor that proves nothing (not opened for reading, ``O_PATH``), or a caller
    over one of its uid's caps."""

    grpc_code: ClassVar[str] = "PERMISSION_DENIED"
