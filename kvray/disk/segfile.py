"""One segment as one Arrow IPC file: the on-disk format of the disk tier (:mod:`.tier`).

Layout: an Arrow IPC *file* (random-access format: header magic, schema, one record batch,
footer, footer length, trailing magic ``ARROW1``) with one row per block::

    key: large_binary   id: uint64   shard: uint16   nshards: uint16
    size: int64         checksum: uint64 (xxh3-64 of the block)   data: large_binary

Schema metadata (all values UTF-8 strings): ``kvray.format`` = ``kvray-segment``,
``kvray.version`` (:data:`VERSION`), ``kvray.namespace``, ``kvray.fingerprint``,
``kvray.blocks`` (rows), ``kvray.block_nbytes`` (the row size when the payload was written as a
2D array, else 0) and ``kvray.meta_xxh3`` (:func:`~kvray.disk.payload.meta_digest` of the
metadata columns).

The data column comes last, so its bytes are the tail of the record batch body: reading the
metadata columns through a memory map faults in a few KiB, never the blocks, and validating a
file (footer present, metadata, digest) costs the same for a 1 MiB and a 1 GiB file. Block bytes
are checked against their checksums only when read (:func:`map_payload` then the tier's
``verify``). The data buffer is written straight from the caller's memory (no copy when the
payload is one 2D array, or 1D arrays laid out in order in one buffer as Ray lays out the arrays
of one object); element ``i`` of ``data`` is block ``i`` (its first ``size[i]`` bytes) followed by
at most :data:`MAX_GAP` bytes of the source's alignment padding.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from kvray.disk.payload import Payload, meta_digest
from kvray.meta.segment import SegmentMeta

__all__ = [
    "FORMAT",
    "VERSION",
    "SegmentFileError",
    "build_batch",
    "commit",
    "file_nbytes",
    "fsync_dir",
    "map_payload",
    "prefetch",
    "read_meta",
    "write_temporary",
]

FORMAT = "kvray-segment"
VERSION = 1

_FIELDS = [
    ("key", pa.large_binary()),
    ("id", pa.uint64()),
    ("shard", pa.uint16()),
    ("nshards", pa.uint16()),
    ("size", pa.int64()),
    ("checksum", pa.uint64()),
    ("data", pa.large_binary()),
]
_SCHEMA = pa.schema(_FIELDS)
_DATA = len(_FIELDS) - 1


class SegmentFileError(Exception):
    """A file is not a valid segment file of this tier (truncated, corrupt or foreign)."""


#: Largest gap between consecutive blocks of a list payload still written as one span: the
#: alignment padding Ray puts between the arrays of one object (measured: < 64 bytes).
MAX_GAP = 63


def _data(payload: Payload, sizes: np.ndarray) -> tuple[np.ndarray, pa.Buffer]:
    """The data column's offsets and buffer, zero-copy unless the blocks are scattered.

    A 2D payload is one buffer. A list whose blocks sit in ascending order with at most
    :data:`MAX_GAP` bytes between them (the arrays of one Ray object) is written as the span
    covering them, gaps included; anything else is concatenated (one copy).
    """
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if isinstance(payload, np.ndarray):
        return offsets, pa.py_buffer(payload)
    if not payload:
        return offsets, pa.py_buffer(b"")
    starts = np.fromiter((a.ctypes.data for a in payload), dtype=np.int64, count=len(payload))
    gaps = starts[1:] - (starts[:-1] + sizes[:-1])
    if np.any(gaps < 0) or np.any(gaps > MAX_GAP):
        return offsets, pa.py_buffer(np.concatenate(payload))
    offsets[:-1] = starts - starts[0]
    offsets[-1] = offsets[-2] + sizes[-1]
    # One span of the caller's memory, kept alive by the list of arrays.
    return offsets, pa.foreign_buffer(int(starts[0]), int(offsets[-1]), base=payload)


def build_batch(
    meta: SegmentMeta, payload: Payload, namespace: str, fingerprint: str
) -> tuple[pa.Schema, pa.RecordBatch]:
    """The schema (with kvray's metadata) and the one record batch of a segment file."""
    n = len(meta)
    data_offsets, data = _data(payload, meta.sizes)
    block_nbytes = payload.shape[1] if isinstance(payload, np.ndarray) else 0
    schema = _SCHEMA.with_metadata(
        {
            "kvray.format": FORMAT,
            "kvray.version": str(VERSION),
            "kvray.namespace": namespace,
            "kvray.fingerprint": fingerprint,
            "kvray.blocks": str(n),
            "kvray.block_nbytes": str(block_nbytes),
            "kvray.meta_xxh3": str(meta_digest(meta)),
        }
    )
    columns = [
        pa.Array.from_buffers(
            pa.large_binary(),
            n,
            [None, pa.py_buffer(meta.key_offsets), pa.py_buffer(meta.key_blob)],
        ),
        pa.array(meta.ids, pa.uint64()),
        pa.array(meta.shards, pa.uint16()),
        pa.array(meta.nshards, pa.uint16()),
        pa.array(meta.sizes, pa.int64()),
        pa.array(meta.checksums, pa.uint64()),
        pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(data_offsets), data]),
    ]
    return schema, pa.record_batch(columns, schema=schema)


def _write(sink: pa.NativeFile, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def file_nbytes(schema: pa.Schema, batch: pa.RecordBatch) -> int:
    """Exact size of the file :func:`write_temporary` writes (counts bytes, copies none)."""
    mock = pa.MockOutputStream()
    _write(mock, schema, batch)
    return int(mock.size())


def _sync_file_range() -> Callable[[int], object] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd: fn(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, no wait


_START_WRITEBACK = _sync_file_range()


def write_temporary(path: str, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    """Write ``path + ".tmp"`` and start its writeback without waiting for it.

    Writing a group of files this way, then :func:`commit` each, keeps the disk busy the way
    one large write does (measured in ``scripts/bench_tier.py``: fsyncing file by file leaves
    it idle between files)."""
    tmp = path + ".tmp"
    try:
        with pa.OSFile(tmp, "wb") as sink:
            _write(sink, schema, batch)
        if _START_WRITEBACK is not None:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                _START_WRITEBACK(fd)
            finally:
                os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def commit(path: str, nbytes: int) -> None:
    """fsync ``path + ".tmp"``, check it has ``nbytes`` (:func:`file_nbytes`) and rename it to
    ``path``; on error it is deleted. The caller fsyncs the directory (:func:`fsync_dir`)."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
            written = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if written != nbytes:
            raise OSError(f"wrote {written} bytes, expected {nbytes}")
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_dir(path: str) -> None:
    """Make the renames in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: What :func:`read_meta` reads of a file: header, schema, batch metadata and the metadata
#: columns at the start (~90 bytes a block), the footer at the end.
_HEAD, _TAIL = 256 << 10, 64 << 10


def prefetch(paths: Sequence[str]) -> None:
    """Start reading the parts :func:`read_meta` needs of every file at once (readahead, no
    wait): a cold scan then waits for one round of concurrent reads, not one seek per read."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, min(size, _HEAD), os.POSIX_FADV_WILLNEED)
            if size > _HEAD:
                tail = max(_HEAD, size - _TAIL)
                os.posix_fadvise(fd, tail, size - tail, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _open(path: str) -> tuple[pa.RecordBatch, dict[bytes, bytes]]:
    try:
        mapped = pa.memory_map(path, "r")
    except (pa.ArrowException, ValueError) as e:
        raise SegmentFileError(f"cannot map: {e}") from None
    try:
        reader = pa.ipc.open_file(mapped)
        if reader.num_record_batches != 1:
            raise SegmentFileError(f"{reader.num_record_batches} record batches, expected 1")
        md = dict(reader.schema.metadata or {})
        if md.get(b"kvray.format") != FORMAT.encode():
            raise SegmentFileError("not a kvray segment file (kvray.format)")
        if md.get(b"kvray.version") != str(VERSION).encode():
            raise SegmentFileError(f"format version {md.get(b'kvray.version')!r}, not {VERSION}")
        if not reader.schema.remove_metadata().equals(_SCHEMA):
            raise SegmentFileError("unexpected columns")
        return reader.get_batch(0), md
    except (pa.ArrowException, ValueError) as e:
        raise SegmentFileError(f"unreadable Arrow IPC file: {e}") from None
    finally:
        mapped.close()  # the batch's buffers keep the mapped region alive, not the descriptor


def _offsets(col: pa.Array, n: int) -> tuple[np.ndarray, pa.Buffer]:
    """Offsets and data buffer of an unsliced large_binary column without nulls."""
    if col.null_count or col.offset:
        raise SegmentFileError("null or sliced column")
    _, off_buf, data = col.buffers()
    if off_buf is None or off_buf.size < 8 * (n + 1):
        raise SegmentFileError("offsets buffer too short")
    offsets = np.frombuffer(off_buf, dtype=np.int64, count=n + 1)
    if n and (offsets[0] != 0 or np.any(np.diff(offsets) < 0)):
        raise SegmentFileError("offsets not increasing from 0")
    if data is None:
        data = pa.py_buffer(b"")
    if data.size < offsets[-1]:
        raise SegmentFileError("data buffer too short")
    return offsets, data


def read_meta(path: str, namespace: str, fingerprint: str) -> tuple[SegmentMeta, int]:
    """Validate a segment file cheaply and return its metadata and ``block_nbytes``.

    Reads the footer, schema and metadata columns, never the block bytes. Raises
    :class:`SegmentFileError` naming what is wrong: truncated (no footer), another format
    version, namespace or fingerprint, inconsistent columns, or a metadata digest mismatch.
    """
    batch, md = _open(path)
    if md.get(b"kvray.namespace") != namespace.encode():
        raise SegmentFileError(f"namespace {md.get(b'kvray.namespace')!r}, not {namespace!r}")
    if md.get(b"kvray.fingerprint") != fingerprint.encode():
        raise SegmentFileError(f"fingerprint {md.get(b'kvray.fingerprint')!r} differs")
    try:
        n = int(md[b"kvray.blocks"])
        block_nbytes = int(md[b"kvray.block_nbytes"])
        digest = int(md[b"kvray.meta_xxh3"])
    except (KeyError, ValueError):
        raise SegmentFileError("missing or malformed kvray metadata") from None
    if batch.num_rows != n:
        raise SegmentFileError(f"{batch.num_rows} rows, metadata says {n}")
    try:
        key_offsets, key_data = _offsets(batch.column(0), n)
        data_offsets, _ = _offsets(batch.column(_DATA), n)
        cols = [batch.column(i).to_numpy(zero_copy_only=True).copy() for i in range(1, _DATA)]
        meta = SegmentMeta(key_data.to_pybytes()[: int(key_offsets[-1])], key_offsets.copy(), *cols)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise SegmentFileError(f"inconsistent columns: {e}") from None
    if meta_digest(meta) != digest:
        raise SegmentFileError("metadata digest mismatch")
    _check_sizes(data_offsets, meta.sizes, block_nbytes)
    return meta, block_nbytes


def map_payload(path: str, sizes: np.ndarray, block_nbytes: int) -> Payload:
    """Memory-map a segment file's blocks (zero-copy, read-only).

    ``sizes`` are the block sizes the caller knows the file by; a file whose layout differs
    raises :class:`SegmentFileError`. The arrays keep the mapping alive after the file is
    closed or deleted.
    """
    batch, _ = _open(path)
    n = len(sizes)
    if batch.num_rows != n:
        raise SegmentFileError(f"{batch.num_rows} rows, expected {n}")
    offsets, data = _offsets(batch.column(_DATA), n)
    _check_sizes(offsets, sizes, block_nbytes)
    flat = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))
    if block_nbytes:
        return flat.reshape(n, block_nbytes)
    o, s = offsets.tolist(), sizes.tolist()
    return [flat[o[i] : o[i] + s[i]] for i in range(n)]


def _check_sizes(offsets: np.ndarray, sizes: np.ndarray, block_nbytes: int) -> None:
    """Element ``i`` of the data column holds block ``i`` (its first ``sizes[i]`` bytes)
    then at most :data:`MAX_GAP` bytes of padding; 2D payloads have none."""
    room = np.diff(offsets) - sizes
    if np.any(room < 0) or np.any(room > MAX_GAP):
        raise SegmentFileError("data offsets disagree with block sizes")
    if block_nbytes and (np.any(room) or np.any(sizes != block_nbytes)):
        raise SegmentFileError("block sizes disagree with kvray.block_nbytes")
