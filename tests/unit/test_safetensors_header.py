from __future__ import annotations

import json
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spanwarm import errors
from spanwarm.checkpoint.resolve import checkpoint_files, open_checkpoint, read_index
from spanwarm.checkpoint.safetensors_header import DTYPE_BITS, HeaderCache, read_header
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from tests.conftest import raw_safetensors

WriteRaw = Callable[[str, bytes], Path]
MiB = 2**20


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_valid_file_gives_file_offsets_and_metadata(write_raw: WriteRaw) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "b": entry("F32", [2, 2], 0, 16),
        "a": entry("F16", [3], 16, 22),
        "s": entry("I64", [], 22, 30),
        "e": entry("BF16", [0, 5], 30, 30),
    }
    path = write_raw("ok.safetensors", raw_safetensors(header, bytes(30)))
    h = read_header(path)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert h.data_start == 8 + n
    assert h.file_size == 8 + n + 30
    assert [t.name for t in h.tensors] == ["b", "a", "s", "e"]  # offset order
    a = next(t for t in h.tensors if t.name == "a")
    assert (h.file_offset(a), a.nbytes, a.shape, a.global_offset) == (8 + n + 16, 6, (3,), (0,))
    assert h.metadata == {"format": "pt"}


def test_matches_the_reference_writer(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "ref.safetensors"
    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "v": torch.ones(5, dtype=torch.bfloat16),
    }
    save_file(tensors, str(path))
    h = read_header(path)
    raw = path.read_bytes()
    for t in h.tensors:
        data = raw[h.file_offset(t) : h.file_offset(t) + t.nbytes]
        assert data == tensors[t.name].contiguous().view(torch.uint8).numpy().tobytes()


def test_leading_and_trailing_whitespace_is_accepted(write_raw: WriteRaw) -> None:
    body = b"   " + json.dumps({"x": entry("U8", [4], 0, 4)}).encode() + b"      "
    path = write_raw("ws.safetensors", struct.pack("<Q", len(body)) + body + b"abcd")
    assert read_header(path).tensors[0].nbytes == 4


@pytest.mark.parametrize(("dtype", "bits"), sorted(DTYPE_BITS.items()))
def test_every_dtype_of_the_format(write_raw: WriteRaw, dtype: str, bits: int) -> None:
    numel = 8  # whole bytes for every bit width, sub-byte ones included
    nbytes = numel * bits // 8
    path = write_raw(
        f"{dtype}.safetensors",
        raw_safetensors({"t": entry(dtype, [2, 4], 0, nbytes)}, bytes(nbytes)),
    )
    assert read_header(path).tensors[0].bits == bits


def test_f8_f6_f4_are_known() -> None:
    assert {
        "F8_E4M3",
        "F8_E5M2",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "F6_E2M3",
        "F6_E3M2",
        "F4",
    } <= set(DTYPE_BITS)
    assert (DTYPE_BITS["F4"], DTYPE_BITS["F6_E3M2"]) == (4, 6)


def _too_large() -> bytes:
    return struct.pack("<Q", 100_000_001) + b"{}"


# (name, file bytes, expected error type, expected fragment of the message)
INVALID: list[tuple[str, bytes, type[errors.HeaderError], str]] = [
    ("empty", b"", errors.FileTooShortError, "shorter than the 8-byte prefix"),
    ("seven_bytes", b"\x08\x00\x00\x00\x00\x00\x00", errors.FileTooShortError, "shorter"),
    ("too_large", _too_large(), errors.HeaderTooLargeError, "exceeds the limit"),
    ("past_end", struct.pack("<Q", 64) + b"{}", errors.HeaderPastEndError, "past the end"),
    ("not_utf8", raw_safetensors(b'{"\xff\xfe": 1}'), errors.HeaderNotJsonError, "not UTF-8"),
    ("not_json", raw_safetensors(b"{nope"), errors.HeaderNotJsonError, "not JSON"),
    ("not_object", raw_safetensors(b"[1, 2]"), errors.HeaderNotJsonError, "not a JSON object"),
    (
        "duplicate_key",
        raw_safetensors(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{}}', b"x"),
        errors.HeaderNotJsonError,
        "repeats the key 'a'",
    ),
    (
        "unknown_dtype",
        raw_safetensors({"t": entry("F12", [1], 0, 2)}, b"xx"),
        errors.UnknownDtypeError,
        "'F12'",
    ),
    (
        "dtype_not_string",
        raw_safetensors({"t": {"dtype": 3, "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        errors.InvalidTensorInfoError,
        "dtype is not a string",
    ),
    (
        "shape_not_list",
        raw_safetensors({"t": {"dtype": "U8", "shape": "4", "data_offsets": [0, 4]}}, b"xxxx"),
        errors.InvalidTensorInfoError,
        "shape",
    ),
    (
        "negative_dim",
        raw_safetensors({"t": entry("U8", [-1], 0, 0)}),
        errors.InvalidTensorInfoError,
        "shape",
    ),
    (
        "bool_dim",
        raw_safetensors({"t": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"x"),
        errors.InvalidTensorInfoError,
        "shape",
    ),
    (
        "offsets_wrong_length",
        raw_safetensors({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, b"x"),
        errors.InvalidTensorInfoError,
        "data_offsets",
    ),
    (
        "offsets_reversed",
        raw_safetensors({"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"x"),
        errors.InvalidTensorInfoError,
        "data_offsets",
    ),
    (
        "entry_not_object",
        raw_safetensors({"t": [1, 2]}),
        errors.InvalidTensorInfoError,
        "not a JSON object",
    ),
    (
        "metadata_not_strings",
        raw_safetensors({"__metadata__": {"a": 1}}),
        errors.InvalidTensorInfoError,
        "__metadata__",
    ),
    (
        "not_starting_at_zero",
        raw_safetensors({"t": entry("U8", [2], 2, 4)}, b"xxxx"),
        errors.InvalidOffsetsError,
        "does not start at 0",
    ),
    (
        "hole",
        raw_safetensors({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, b"xxxxx"),
        errors.InvalidOffsetsError,
        "gap or overlap at 2",
    ),
    (
        "overlap",
        raw_safetensors({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 1, 3)}, b"xxx"),
        errors.InvalidOffsetsError,
        "gap or overlap",
    ),
    (
        "size_mismatch",
        raw_safetensors({"t": entry("F32", [2], 0, 6)}, b"xxxxxx"),
        errors.TensorSizeMismatchError,
        "6 bytes for shape [2] of F32",
    ),
    (
        "sub_byte_not_whole_bytes",
        raw_safetensors({"t": entry("F4", [3], 0, 2)}, b"xx"),
        errors.TensorSizeMismatchError,
        "(12 bits)",
    ),
    (
        "trailing_bytes",
        raw_safetensors({"t": entry("U8", [2], 0, 2)}, b"xxEXTRA"),
        errors.DataSizeMismatchError,
        "data section ends at",
    ),
    (
        "truncated_data",
        raw_safetensors({"t": entry("U8", [8], 0, 8)}, b"xx"),
        errors.DataSizeMismatchError,
        "data section ends at",
    ),
    (
        "bad_sharding_info",
        raw_safetensors(
            {"__metadata__": {"DCP_SHARDING_INFO": "{not json"}, "t": entry("U8", [1], 0, 1)}, b"x"
        ),
        errors.InvalidTensorInfoError,
        "DCP_SHARDING_INFO",
    ),
]


@pytest.mark.parametrize(
    ("name", "content", "error", "fragment"), INVALID, ids=[c[0] for c in INVALID]
)
def test_invalid_files_raise_their_own_error(
    write_raw: WriteRaw, name: str, content: bytes, error: type[errors.HeaderError], fragment: str
) -> None:
    path = write_raw(f"{name}.safetensors", content)
    with pytest.raises(error) as info:
        read_header(path)
    assert type(info.value) is error
    assert str(path) in str(info.value)
    assert fragment in str(info.value)
    assert info.value.path == str(path)


def test_every_header_error_type_is_exercised() -> None:
    covered = {case[2] for case in INVALID}
    assert covered == set(errors.HeaderError.__subclasses__())


def test_errors_name_the_offset(write_raw: WriteRaw) -> None:
    path = write_raw(
        "hole.safetensors",
        raw_safetensors({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, b"xxxxx"),
    )
    with pytest.raises(errors.InvalidOffsetsError) as info:
        read_header(path)
    data_start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert info.value.offset == data_start + 3
    assert f"(at offset {data_start + 3})" in str(info.value)


def test_fifo_and_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(errors.NotARegularFileError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(errors.NotARegularFileError, match="directory"):
        read_header(tmp_path)


def test_missing_file_in_a_list_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(errors.ShardMissingError, match="no such file") as info:
        open_checkpoint([tmp_path / "gone.safetensors"])
    assert info.value.path == str(tmp_path / "gone.safetensors")


def test_dcp_chunks_record_their_global_offsets(write_raw: WriteRaw) -> None:
    info = json.dumps({"w": {"saved_offsets": [4, 0]}})
    header = {"__metadata__": {"DCP_SHARDING_INFO": info}, "w": entry("F16", [4, 8], 0, 64)}
    h = read_header(write_raw("chunk.safetensors", raw_safetensors(header, bytes(64))))
    assert h.tensors[0].global_offset == (4, 0)


def test_cache_hits_until_the_file_changes(write_raw: WriteRaw) -> None:
    cache = HeaderCache()
    path = write_raw("c.safetensors", raw_safetensors({"t": entry("U8", [2], 0, 2)}, b"xx"))
    first = read_header(path, cache=cache)
    assert read_header(path, cache=cache) is first
    assert (cache.hits, cache.misses) == (1, 1)
    path.write_bytes(raw_safetensors({"t": entry("U8", [3], 0, 3)}, b"xxx"))
    assert read_header(path, cache=cache).tensors[0].shape == (3,)
    assert cache.misses == 2


def _index(directory: Path, weight_map: dict[str, object]) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return path


def _shard(path: Path) -> Path:
    path.write_bytes(raw_safetensors({"t": entry("U8", [1], 0, 1)}, b"x"))
    return path


def test_index_lists_each_shard_once_sorted(tmp_path: Path) -> None:
    _shard(tmp_path / "b.safetensors")
    _shard(tmp_path / "a.safetensors")
    _index(tmp_path, {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert checkpoint_files(tmp_path) == [
        str(tmp_path / "a.safetensors"),
        str(tmp_path / "b.safetensors"),
    ]


@pytest.mark.parametrize(
    ("weight_map", "error", "fragment"),
    [
        ({"x": "missing.safetensors"}, errors.ShardMissingError, "does not exist"),
        ({"x": "/etc/passwd"}, errors.ShardOutsideCheckpointError, "outside"),
        ({"x": "../other/a.safetensors"}, errors.ShardOutsideCheckpointError, "outside"),
        ({"x": "sub/../../a.safetensors"}, errors.ShardOutsideCheckpointError, "outside"),
        ({"x": "escape.safetensors"}, errors.ShardOutsideCheckpointError, "resolves to"),
        ({"x": 3}, errors.IndexFormatError, "not a file name"),
        ({}, errors.IndexFormatError, "weight_map"),
    ],
)
def test_index_rejects_bad_shard_names(
    tmp_path: Path,
    weight_map: dict[str, object],
    error: type[errors.CheckpointError],
    fragment: str,
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    outside = _shard(tmp_path / "outside.safetensors")
    (ckpt / "escape.safetensors").symlink_to(outside)
    index = _index(ckpt, weight_map)
    with pytest.raises(error, match=fragment) as info:
        read_index(index)
    assert info.value.path == str(index)


def test_symlink_inside_the_checkpoint_is_fine(tmp_path: Path) -> None:
    real = _shard(tmp_path / "real.safetensors")
    (tmp_path / "alias.safetensors").symlink_to(real)
    _index(tmp_path, {"x": "alias.safetensors"})
    assert checkpoint_files(tmp_path) == [str(tmp_path / "alias.safetensors")]


def test_a_hugging_face_hub_snapshot_reads_its_shards_from_the_blobs(tmp_path: Path) -> None:
    """The hub cache's layout: ``<repo>/snapshots/<rev>/<name>`` links to
    ``../../blobs/<hash>``. Its shards resolve outside the snapshot, into the repo's
    blobs, and are read so; a link from a snapshot to anywhere else is still refused, and
    so is one into ``blobs`` from a directory that is not a snapshot."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, blob in (("a.safetensors", "1111"), ("b.safetensors", "2222")):
        _shard(repo / "blobs" / blob)
        (snapshot / name).symlink_to(Path("../../blobs") / blob)
    index = _index(snapshot, {"x": "a.safetensors", "y": "b.safetensors"})
    assert checkpoint_files(snapshot) == [
        str(snapshot / "a.safetensors"),
        str(snapshot / "b.safetensors"),
    ]
    (snapshot / "b.safetensors").unlink()
    (snapshot / "b.safetensors").symlink_to(_shard(tmp_path / "elsewhere.safetensors"))
    with pytest.raises(errors.ShardOutsideCheckpointError, match="resolves to"):
        read_index(index)
    other = repo / "not-a-snapshot"
    other.mkdir()
    (other / "a.safetensors").symlink_to(Path("../blobs") / "1111")
    _index(other, {"x": "a.safetensors"})
    with pytest.raises(errors.ShardOutsideCheckpointError, match="resolves to"):
        checkpoint_files(other)


def test_index_not_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(errors.IndexFormatError, match="not a JSON document"):
        checkpoint_files(tmp_path)


def test_directory_without_index_uses_every_file(tmp_path: Path) -> None:
    with pytest.raises(errors.NoShardsError):
        checkpoint_files(tmp_path)
    _shard(tmp_path / "2.safetensors")
    _shard(tmp_path / "1.safetensors")
    assert [Path(p).name for p in checkpoint_files(tmp_path)] == ["1.safetensors", "2.safetensors"]


def test_same_tensor_in_two_files_without_offsets_is_an_error(tmp_path: Path) -> None:
    _shard(tmp_path / "a.safetensors")
    _shard(tmp_path / "b.safetensors")
    with pytest.raises(errors.DuplicateTensorError, match="stored in"):
        open_checkpoint(tmp_path)


def test_open_checkpoint_locates_dcp_chunks_across_files(tmp_path: Path) -> None:
    for i in range(2):
        info = json.dumps({"w": {"saved_offsets": [2 * i, 0]}})
        header = {"__metadata__": {"DCP_SHARDING_INFO": info}, "w": entry("U8", [2, 3], 0, 6)}
        (tmp_path / f"{i}.safetensors").write_bytes(raw_safetensors(header, bytes(6)))
    ckpt = open_checkpoint(tmp_path)
    assert [t.global_offset for _, t in ckpt.pieces["w"]] == [(0, 0), (2, 0)]


def test_dcp_shards_consolidated_in_place_are_planned_from_the_consolidated_file(
    tmp_path: Path,
) -> None:
    """torch's own consolidation, written into the shards' directory: every file of it
    opens as one checkpoint, and each tensor comes from the file the index names."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    for i in range(2):
        info = json.dumps({"w": {"saved_offsets": [3 * i, 0]}})
        metadata = {"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0", "format": "pt"}
        name = f"shard-0000{i + 1}-model-00001-of-00001.safetensors"
        save_file({"w": full[3 * i : 3 * i + 3].clone()}, str(tmp_path / name), metadata)
    consolidate_safetensors_files(str(tmp_path), str(tmp_path), fqn_to_index_mapping={"w": 1})
    everything = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    assert len(everything) == 3
    for checkpoint in (everything, tmp_path):
        ckpt = open_checkpoint(checkpoint)
        (header, tensor), *rest = ckpt.pieces["w"]
        assert rest == []
        assert Path(header.path).name == "model-00001-of-00001.safetensors"
        data = Path(header.path).read_bytes()[header.file_offset(tensor) :][: tensor.nbytes]
        assert data == full.numpy().tobytes()


def test_a_rewritten_index_is_read_again(tmp_path: Path) -> None:
    _shard(tmp_path / "a.safetensors")
    _shard(tmp_path / "b.safetensors")
    index = _index(tmp_path, {"x": "a.safetensors"})
    assert read_index(index) == [str(tmp_path / "a.safetensors")]
    _index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})  # a new size and mtime
    assert read_index(index) == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]


def test_a_shard_swapped_for_an_escaping_link_is_refused_after_a_good_read(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _shard(ckpt / "a.safetensors")
    index = _index(ckpt, {"x": "a.safetensors"})
    assert read_index(index) == [str(ckpt / "a.safetensors")]  # the names are memoised now
    (ckpt / "a.safetensors").unlink()
    (ckpt / "a.safetensors").symlink_to(_shard(tmp_path / "outside.safetensors"))
    with pytest.raises(errors.ShardOutsideCheckpointError, match="resolves to"):
        read_index(index)


def test_an_index_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(errors.IndexFormatError, match="not a regular file"):
        checkpoint_files(tmp_path)


def test_open_checkpoint_again_sees_a_rewritten_shard(tmp_path: Path) -> None:
    cache = HeaderCache()
    path = tmp_path / "a.safetensors"
    path.write_bytes(raw_safetensors({"t": entry("U8", [2], 0, 2)}, b"xx"))
    first = open_checkpoint(tmp_path, cache=cache)
    assert open_checkpoint(tmp_path, cache=cache) is first  # unchanged: the same answer
    path.write_bytes(raw_safetensors({"u": entry("U8", [3], 0, 3)}, b"xxx"))
    again = open_checkpoint(tmp_path, cache=cache)
    assert list(again.pieces) == ["u"]
    with pytest.raises(TypeError):  # shared between callers: nobody may change it
        again.pieces["t"] = ()  # type: ignore[index]


def _header_then_first_tensors(path: Path, read_the_header: Callable[[], object]) -> int:
    """Evict ``path``, read its header with ``read_the_header``, then do what a loader
    does next: its first 4 MiB of tensors hinted exactly (as the daemon or a rank's own
    read asks for them) and read through a mapping. Returns the bytes resident past them."""
    evict(path)
    read_the_header()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 4 * MiB, os.POSIX_FADV_WILLNEED)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapping:
            _ = mapping[: 4 * MiB]  # a copy: every page touched
        time.sleep(0.2)  # any read-ahead the touches started lands meanwhile
        return resident_bytes(fd, 4 * MiB + PAGE, 36 * MiB)
    finally:
        os.close(fd)


def test_reading_a_header_leaves_no_read_ahead_marks(tmp_path: Path) -> None:
    """A header read with read-ahead leaves PG_readahead marks on its pages; a loader's
    first touch of one then reads the 8-16 MiB after the bytes it asked for (seen as
    128 MiB of unasked reads in transformers' loads on this VM). read_header reads the
    header without read-ahead: nothing past the loader's own bytes is read."""
    tensors = {f"t{i}": entry("U8", [MiB], i * MiB, (i + 1) * MiB) for i in range(40)}
    path = tmp_path / "model.safetensors"
    with path.open("wb") as f:
        f.write(raw_safetensors(tensors, os.urandom(40 * MiB)))
        os.fsync(f.fileno())

    def plain_read() -> None:  # the header read as any reader does it, read-ahead on
        fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            os.pread(fd, length, 8)
        finally:
            os.close(fd)

    marked = _header_then_first_tensors(path, plain_read)
    if marked < MiB:
        pytest.skip(f"no read-ahead past marked pages on this device ({marked} bytes)")
    assert _header_then_first_tensors(path, lambda: HeaderCache().read(path)) == 0
