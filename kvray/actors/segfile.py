"""One segment as one Arrow IPC file: the on-disk format of the disk tier (:mod:`.disk`).

Layout: an Arrow IPC *file* (random-access format: header magic, schema, one record batch,
footer, footer length, trailing magic ``ARROW1``) with one row per block::

    key: large_binary   id: uint64   shard: uint16   nshards: uint16
    size: int64         checksum: uint64 (xxh3-64 of the block)   data: large_binary

Schema metadata (all values UTF-8 strings): ``kvray.format`` = ``kvray-segment``,
``kvray.version`` (:data:`VERSION`), ``kvray.namespace``, ``kvray.fingerprint``,
``kvray.blocks`` (rows), ``kvray.block_nbytes`` (the row size when the payload was written as a
2D array, else 0) and ``kvray.meta_xxh3`` (:meth:`SegmentMeta.digest` of the metadata columns).

The data column comes last, so its bytes are the tail of the record batch body: reading the
metadata columns through a memory map faults in a few KiB, never the blocks, and validating a
file (footer present, metadata, digest) costs the same for a 1 MiB and a 1 GiB file. Block bytes
are checked against their checksums only when read (:func:`map_payload` then the tier's
``verify``). The data buffer is written straight from the caller's arrays (no copy when the
payload is one 2D array or back-to-back 1D arrays).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pyarrow as pa

from kvray.actors.segment import Payload, SegmentMeta

__all__ = [
    "FORMAT",
    "VERSION",
    "SegmentFileError",
    "build_batch",
    "file_nbytes",
    "map_payload",
    "read_meta",
    "write_file",
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


def _data_buffer(payload: Payload) -> pa.Buffer:
    """The payload's bytes as one Arrow buffer; zero-copy unless the blocks are scattered."""
    if isinstance(payload, np.ndarray):
        return pa.py_buffer(payload)
    if not payload:
        return pa.py_buffer(b"")
    addr = payload[0].ctypes.data
    end = addr
    for a in payload:
        if a.ctypes.data != end:
            return pa.py_buffer(np.concatenate(payload))
        end += a.nbytes
    # Back-to-back arrays (e.g. the buffers of one Ray object): one span kept alive by the list.
    return pa.foreign_buffer(addr, end - addr, base=payload)


def build_batch(
    meta: SegmentMeta, payload: Payload, namespace: str, fingerprint: str
) -> tuple[pa.Schema, pa.RecordBatch]:
    """The schema (with kvray's metadata) and the one record batch of a segment file."""
    n = len(meta)
    data_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(meta.sizes, out=data_offsets[1:])
    block_nbytes = payload.shape[1] if isinstance(payload, np.ndarray) else 0
    schema = _SCHEMA.with_metadata(
        {
            "kvray.format": FORMAT,
            "kvray.version": str(VERSION),
            "kvray.namespace": namespace,
            "kvray.fingerprint": fingerprint,
            "kvray.blocks": str(n),
            "kvray.block_nbytes": str(block_nbytes),
            "kvray.meta_xxh3": str(meta.digest()),
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
        pa.Array.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(data_offsets), _data_buffer(payload)]
        ),
    ]
    return schema, pa.record_batch(columns, schema=schema)


def _write(sink: pa.NativeFile, schema: pa.Schema, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def file_nbytes(schema: pa.Schema, batch: pa.RecordBatch) -> int:
    """Exact size of the file :func:`write_file` would write (counts bytes, copies none)."""
    mock = pa.MockOutputStream()
    _write(mock, schema, batch)
    return int(mock.size())


def write_file(path: str, schema: pa.Schema, batch: pa.RecordBatch, nbytes: int) -> None:
    """Write ``path`` atomically: to ``path + ".tmp"``, fsync, check its size is ``nbytes``
    (:func:`file_nbytes`), rename, fsync the directory. On error nothing is left behind."""
    tmp = path + ".tmp"
    try:
        with pa.OSFile(tmp, "wb") as sink:
            _write(sink, schema, batch)
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
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself
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
    if meta.digest() != digest:
        raise SegmentFileError("metadata digest mismatch")
    if not np.array_equal(np.diff(data_offsets), meta.sizes):
        raise SegmentFileError("data offsets disagree with block sizes")
    if block_nbytes and np.any(meta.sizes != block_nbytes):
        raise SegmentFileError("block sizes disagree with kvray.block_nbytes")
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
    if not np.array_equal(np.diff(offsets), sizes):
        raise SegmentFileError("block sizes differ from the scanned metadata")
    flat = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))
    if block_nbytes:
        return flat.reshape(n, block_nbytes)
    o = offsets.tolist()
    return [flat[o[i] : o[i + 1]] for i in range(n)]
