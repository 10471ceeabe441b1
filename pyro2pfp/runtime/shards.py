"""Input shards for ``pyro2pfp score``: ``.npy`` / ``.npz`` arrays and Parquet files with a fixed-shape
tensor column, planned from their headers and read in chunks of rows; and the Parquet file of a scored
shard.

A shard's rows keep their order and get the column ``row`` (the row's index in the shard); a
Parquet shard's scalar columns (ids, keys) and a ``.npz`` file's 1-D arrays of one value per row are
passed through.  Every problem with a file is a :class:`ShardError` naming it, so one bad shard is
reported and the others are scored.  NumPy only, and pyarrow for Parquet (imported when needed).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PFPError

__all__ = ["EXTENSIONS", "ROW", "Shard", "ShardError", "expand_inputs", "output_path", "plan_chunks", "plan_shard",
           "read_rows", "write_scored"]

EXTENSIONS = (".npy", ".npz", ".parquet")
"""The input files ``pyro2pfp score`` reads."""
ROW = "row"
"""The column holding each row's index in its shard."""


class ShardError(PFPError):
    """An input shard cannot be read (``exc.shard`` is its path)."""

    def __init__(self, shard: str, message: str) -> None:
        super().__init__(f"{shard}: {message}")
        self.shard = shard

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.shard, str(self)[len(self.shard) + 2:])


@dataclass(frozen=True)
class Shard:
    """One input file: where its rows are and how many (from its header, without reading the data)."""

    path: str
    column: str
    """The input column (a Parquet column, a ``.npz`` array; ``.npy``: ``"x"``)."""
    rows: int
    row_shape: tuple[int, ...]
    passthrough: tuple[str, ...] = field(default=())
    """Columns copied to the output (Parquet scalar columns, ``.npz`` 1-D arrays with one value per row)."""
    dtype: str = ""
    """The inputs' NumPy dtype (``.npy``/``.npz``; ``""`` for Parquet, checked when read)."""

    def mismatch(self, input_shape: tuple[int, ...]) -> str | None:
        """Why the rows cannot be the inputs of a network taking ``input_shape``, or ``None``: another
        shape (size-1 axes aside, which the scorer adds or drops), or a dtype that is not numbers."""
        if self.dtype and np.dtype(self.dtype).kind not in "biuf":
            return f"its inputs are of dtype {self.dtype}; the network takes real numbers"
        if self.rows and [d for d in self.row_shape if d != 1] != [d for d in input_shape if d != 1]:
            return (f"its rows have shape {self.row_shape}; the network takes {tuple(input_shape)}"
                    + (f" (column {self.column!r})" if self.column != "x" else ""))
        return None


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files and directories (their ``.npy``/``.npz``/``.parquet`` files, sorted) as a list of files."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name) for name in os.listdir(item)
                           if name.lower().endswith(EXTENSIONS) and os.path.isfile(os.path.join(item, name)))
            if not found:
                raise PFPError(f"input directory {item} holds no {'/'.join(EXTENSIONS)} files")
            files.extend(found)
        elif os.path.isfile(item):
            if not item.lower().endswith(EXTENSIONS):
                raise PFPError(f"input {item}: expected a {', '.join(EXTENSIONS)} file or a directory of them")
            files.append(item)
        else:
            raise PFPError(f"input {item} not found")
    return files


def output_path(directory: str, shard_path: str) -> str:
    """Where the scored rows of ``shard_path`` go: ``directory/<file name without extension>.parquet``."""
    return os.path.join(directory, os.path.splitext(os.path.basename(shard_path))[0] + ".parquet")


def plan_shard(path: str, column: str | None = None) -> Shard:
    """The :class:`Shard` of ``path`` from its header (``.npy``), its array list (``.npz``) or its
    schema and metadata (Parquet); a :class:`ShardError` naming it if it cannot be read."""
    try:
        if path.lower().endswith(".npy"):
            x = np.load(path, mmap_mode="r", allow_pickle=False)
            return Shard(path, "x", _rows(path, x.shape), tuple(x.shape[1:]), dtype=x.dtype.str)
        if path.lower().endswith(".npz"):
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            name = _npz_column(path, arrays, column)
            rows = _rows(path, arrays[name].shape)
            passthrough = tuple(k for k, v in arrays.items() if k != name and v.shape == (rows,))
            return Shard(path, name, rows, tuple(arrays[name].shape[1:]), passthrough, arrays[name].dtype.str)
        return _plan_parquet(path, column)
    except ShardError:
        raise
    except Exception as exc:  # noqa: BLE001 -- NumPy's, zipfile's and pyarrow's errors: the file is corrupt
        raise ShardError(path, f"cannot be read ({type(exc).__name__}: {_first_line(exc)})") from None


def _rows(path: str, shape: tuple[int, ...]) -> int:
    if len(shape) < 2:
        raise ShardError(path, f"holds an array of shape {shape}; the inputs must be (rows, *input_shape)")
    return int(shape[0])


def _npz_column(path: str, arrays: dict[str, np.ndarray], column: str | None) -> str:
    if column is not None:
        if column not in arrays:
            raise ShardError(path, f"has no array {column!r}; it holds {sorted(arrays)}")
        return column
    if "x" in arrays:
        return "x"
    candidates = [k for k, v in arrays.items() if v.ndim >= 2]
    if len(candidates) != 1:
        raise ShardError(path, f"holds arrays {sorted(arrays)}: name the inputs 'x' (np.savez(path, x=...)) "
                               "or pass --column")
    return candidates[0]


def _plan_parquet(path: str, column: str | None) -> Shard:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path)
    schema = meta.schema_arrow
    rows = meta.metadata.num_rows
    tensors = [f.name for f in schema if _is_tensor_type(f.type)]
    if column is not None:
        if column not in schema.names:
            raise ShardError(path, f"has no column {column!r}; its columns: {schema.names}")
        name = column
    elif "x" in schema.names:
        name = "x"
    elif len(tensors) == 1:
        name = tensors[0]
    else:
        raise ShardError(path, f"has columns {schema.names}: name the input column 'x' or pass --column")
    first = _tensor_numpy(next(meta.iter_batches(batch_size=1, columns=[name])).column(0), path, name) if rows else None
    row_shape = tuple(first.shape[1:]) if first is not None else ()
    passthrough = tuple(f.name for f in schema if f.name != name and not _is_tensor_type(f.type))
    return Shard(path, name, rows, row_shape, passthrough)


def _is_tensor_type(t: Any) -> bool:
    import pyarrow as pa

    return (isinstance(t, pa.ExtensionType) or pa.types.is_list(t) or pa.types.is_large_list(t)
            or pa.types.is_fixed_size_list(t))


def _tensor_numpy(array: Any, path: str, column: str) -> np.ndarray:
    """A Parquet tensor column (pyarrow's ``fixed_shape_tensor``, Ray Data's tensor type, nested
    fixed-size lists, or lists of equal length) as a (rows, *row_shape) array."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array.type, pa.FixedShapeTensorType):
        return array.to_numpy_ndarray()
    if isinstance(array.type, pa.ExtensionType):  # Ray Data's tensor type: its to_numpy gives the tensors
        values = array.to_numpy(zero_copy_only=False)
        if isinstance(values, np.ndarray) and values.dtype != object:
            return values
        array = array.storage
    dims = []
    flat = array
    while pa.types.is_fixed_size_list(flat.type):
        if flat.null_count:
            raise ShardError(path, f"column {column!r} has missing (null) rows")
        dims.append(flat.type.list_size)
        flat = flat.flatten()
    if dims and not (pa.types.is_list(flat.type) or pa.types.is_large_list(flat.type)):
        return flat.to_numpy(zero_copy_only=False).reshape(len(array), *dims)
    try:
        values = np.array(array.to_pylist())
    except ValueError:
        values = np.empty(0, dtype=object)
    if values.dtype == object or values.ndim < 2:
        raise ShardError(path, f"column {column!r} is not a fixed-shape tensor column (type {array.type}); "
                               "write the inputs as fixed-size lists or pyarrow's fixed_shape_tensor")
    return values


def plan_chunks(shard: Shard, rows_per_block: int) -> list[tuple[int, int]]:
    """``[(start, stop)]``: the row ranges of ``shard`` that :func:`read_rows` reads one at a time --
    ``rows_per_block`` rows of a ``.npy`` file (memory-mapped), a whole ``.npz`` file (its arrays are
    read whole), runs of whole row groups of a Parquet file (at least ``rows_per_block`` rows, unless
    the file ends)."""
    if shard.rows == 0:
        return []
    if shard.path.lower().endswith(".npy"):
        return [(s, min(s + rows_per_block, shard.rows)) for s in range(0, shard.rows, rows_per_block)]
    if shard.path.lower().endswith(".npz"):
        return [(0, shard.rows)]
    chunks, start, stop = [], 0, 0
    for rows in _row_groups(shard.path):
        stop += rows
        if stop - start >= rows_per_block:
            chunks.append((start, stop))
            start = stop
    if stop > start:
        chunks.append((start, stop))
    return chunks


def _row_groups(path: str) -> list[int]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def read_rows(shard: Shard, start: int, stop: int, shard_id: int | None = None) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` of ``shard`` (a range of :func:`plan_chunks`): ``{"row": ..., <input
    column>: ..., <passthrough columns>}`` (and ``"shard"``: ``shard_id`` per row, if given).  A
    :class:`ShardError` naming the file for anything unreadable."""
    try:
        columns = _read(shard, start, stop)
    except ShardError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the file changed or is corrupt past its header
        raise ShardError(shard.path, f"rows {start}…{stop - 1} cannot be read ({type(exc).__name__}: "
                                     f"{_first_line(exc)})") from None
    n = len(columns[shard.column])
    if n != stop - start:
        raise ShardError(shard.path, f"rows {start}…{stop - 1}: read {n} rows; the file changed since it was planned")
    out = {ROW: np.arange(start, stop, dtype=np.int64)}
    if shard_id is not None:
        out["shard"] = np.full(n, shard_id, dtype=np.int64)
    out.update(columns)
    return out


def _read(shard: Shard, start: int, stop: int) -> dict[str, np.ndarray]:
    path = shard.path
    if path.lower().endswith(".npy"):
        return {shard.column: np.array(np.load(path, mmap_mode="r", allow_pickle=False)[start:stop])}
    if path.lower().endswith(".npz"):
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name][start:stop] for name in (shard.column, *shard.passthrough)}
    import pyarrow.parquet as pq

    offsets = np.concatenate([[0], np.cumsum(_row_groups(path))])
    groups = [g for g in range(len(offsets) - 1) if offsets[g] >= start and offsets[g + 1] <= stop]
    if not groups or offsets[groups[0]] != start or offsets[groups[-1] + 1] != stop:
        raise ShardError(path, f"rows {start}…{stop - 1} are not whole row groups; the file changed since it "
                               "was planned")
    table = pq.ParquetFile(path).read_row_groups(groups, columns=[shard.column, *shard.passthrough])
    columns = {shard.column: _tensor_numpy(table.column(shard.column), path, shard.column)}
    for name in shard.passthrough:
        columns[name] = table.column(name).to_numpy()
    return columns


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def write_scored(path: str, columns: dict[str, np.ndarray]) -> None:
    """Write a scored shard's columns to the Parquet file ``path``, atomically (a temporary file in the
    same directory, renamed): a file at ``path`` is always complete.  (rows, K) columns become
    fixed-size lists of K float32, one per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays, names = [], []
    for name, values in columns.items():
        values = np.asarray(values)
        if values.ndim == 1:
            arrays.append(pa.array(values))
        else:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1))
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, int(np.prod(values.shape[1:]))))
        names.append(name)
    table = pa.Table.from_arrays(arrays, names=names)
    temporary = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
