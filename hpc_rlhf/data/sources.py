"""Reading local data files into rows, turning rows into examples (bad rows raised, or skipped and counted),
and concatenating or mixing several sources by probability.

Supported inputs (local only: this toolkit never reaches the Hugging Face hub):

* ``*.jsonl``: JSON lines (one object per line, blank lines ignored),
* ``*.json``: a top-level list of objects, ``{"data": [...]}``, or JSON lines in a ``.json`` file,
* ``*.parquet``,
* a folder written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` folder uses its
  ``train`` split, or its only split).

Heavy readers (pyarrow, datasets) are imported inside the function that needs them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_FORMATS = ".jsonl, .json, .parquet, or a datasets.save_to_disk folder"


class DataError(ValueError):
    """A data file or row is unusable. The message names the file, the row (1-based; the 1-based line for JSON
    lines files) and the key. ``row`` is the 0-based position among the file's rows."""

    def __init__(self, message: str, *, path: str | None = None, row: int | None = None, key: str | None = None,
                 line: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.path = path
        self.row = row
        self.key = key
        self.line = line
        self.reason = reason


def row_error(path: str, row: int, key: str | None, reason: str, line: int | None = None) -> DataError:
    """The error for row ``row`` (0-based) of ``path``; shown 1-based, as its line when ``line`` is known."""
    where = f"{path}: line {line}" if line is not None else f"{path}: row {row + 1}"
    where += f": key {key!r}" if key is not None else ""
    return DataError(f"{where}: {reason}", path=path, row=row, key=key, line=line, reason=reason)


class Rows(list):
    """A file's rows in order; ``lines[i]`` is row i's 1-based line number for JSON lines files, else None."""

    def __init__(self, rows=(), lines: list[int] | None = None):
        super().__init__(rows)
        self.lines = lines


class InvalidRow:
    """Stands in for a line that is not valid JSON, so the readers of rows raise (or skip and count) it in order,
    like any other bad row, instead of the whole file failing to read."""

    def __init__(self, error: DataError):
        self.error = error


def make_row(make: Callable[[Any, str, int], Any], rows: list[Any], path: str, index: int) -> Any:
    """``make(rows[index], path, index)``; an invalid JSON line raises its DataError, and a DataError from ``make``
    is re-raised naming the row's line when the file has lines (``rows`` is then :class:`Rows`)."""
    row = rows[index]
    if isinstance(row, InvalidRow):
        raise row.error
    try:
        return make(row, path, index)
    except DataError as err:
        lines = getattr(rows, "lines", None)
        if lines is None or err.line is not None or err.row is None or err.path != path or err.reason is None:
            raise
        located = row_error(path, err.row, err.key, err.reason, line=lines[err.row])
        raise located from err.__cause__


def _invalid_line(path: str, row: int, line_number: int, reason: str) -> InvalidRow:
    return InvalidRow(row_error(path, row, None, reason, line=line_number))


def _parse_line(raw: bytes, path: str, row: int, line_number: int) -> Any:
    """One JSON lines row, or an ``InvalidRow`` naming the line: not UTF-8, not JSON, or nested too deeply."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _invalid_line(path, row, line_number, f"not UTF-8 text: byte 0x{raw[err.start]:02x} at column "
                                                     f"{err.start + 1}")
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return _invalid_line(path, row, line_number, f"invalid JSON: {err.msg} at column {err.colno}")
    except RecursionError:
        return _invalid_line(path, row, line_number, "JSON nested too deeply to read")


def _read_jsonl(path: str, data: bytes | None = None) -> Rows:
    """Rows of a JSON lines file. Lines end at ``\n`` only (``\r\n`` too): a JSON string may hold U+2028 or
    other characters that ``str.splitlines`` would split a row at."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    rows, lines = Rows(), []
    for line_number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        if line_number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
        rows.append(_parse_line(raw, path, len(rows), line_number))
        lines.append(line_number)
    rows.lines = lines
    return rows


def _read_json(path: str) -> list[Any]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text: byte 0x{data[err.start]:02x} at column {column}",
                        path=path, line=line, reason="not UTF-8 text") from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, data)  # JSON lines saved with a .json suffix
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read", path=path) from None
    if isinstance(parsed, dict) and isinstance(parsed.get("data"), list):
        parsed = parsed["data"]
    if isinstance(parsed, dict):  # a single object is treated as one row (a one-line jsonl)
        parsed = [parsed]
    if not isinstance(parsed, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(parsed).__name__}", path=path)
    return parsed


def _read_parquet(path: str) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_saved_dataset(path: str) -> list[Any]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # datasets raises FileNotFoundError / ValueError variants
        raise DataError(
            f"{path}: a folder must be written by datasets' save_to_disk ({err})", path=path
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise DataError(
                f"{path}: DatasetDict with splits {sorted(loaded)} and no 'train' split; "
                "save the split you want to train on", path=path,
            )
    return loaded.to_list()


def read_rows(path: str) -> list[Any]:
    """All rows of one local data source, in file order (rows are not validated here; a JSON lines file's
    unparseable line is an ``InvalidRow``: read rows with ``make_row``)."""
    if os.path.isdir(path):
        return _read_saved_dataset(path)
    if not os.path.exists(path):
        raise DataError(
            f"{path}: no such file or folder (prompt data must be local: {SUPPORTED_FORMATS})", path=path
        )
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return _read_jsonl(path)
    if lower.endswith(".json"):
        return _read_json(path)
    if lower.endswith(".parquet"):
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported format; use {SUPPORTED_FORMATS}", path=path)


@dataclass
class SkippedRows:
    """The bad rows a loader skipped with ``skip_bad_rows``: how many per source, and the first few reasons."""

    max_reasons: int
    by_source: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def add(self, path: str, err: DataError) -> None:
        self.by_source[path] = self.by_source.get(path, 0) + 1
        if len(self.reasons) < self.max_reasons:
            self.reasons.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.by_source.values())


def load_source(path: str, make: Callable[[Any, str, int], Any], *, limit: int | None = None,
                skip_bad_rows: bool = False, skipped: SkippedRows) -> tuple[list[Any], int]:
    """``make(row, path, row_index)`` over one source's rows in file order, until ``limit`` examples.

    A row ``make`` raises ``DataError`` for fails the load, or with ``skip_bad_rows`` is left out and recorded
    in ``skipped``; a row it returns None for is dropped. Returns ``(examples, num_dropped)``.
    """
    examples: list[Any] = []
    num_dropped = 0
    rows = read_rows(path)
    for row_index in range(len(rows)):
        if limit is not None and len(examples) >= limit:
            break
        try:
            example = make_row(make, rows, path, row_index)
        except DataError as err:
            if not skip_bad_rows:
                raise
            skipped.add(path, err)
            continue
        if example is None:
            num_dropped += 1
        else:
            examples.append(example)
    return examples, num_dropped


def concatenate_or_mix(paths: Sequence[str], load: Callable[[str, int | None], list[Any]], *,
                       probs: Sequence[float] | None, max_samples: int | None, seed: int) -> list[Any]:
    """Examples of several sources, ``load(path, limit)`` reading one. Without ``probs`` the sources are
    concatenated, the first ``max_samples`` kept (a source past it is not read); with ``probs`` every source is
    read whole and mixed exactly in proportion (``mixture_plan``), ``max_samples`` being the mixture's size."""
    if probs is None:
        examples: list[Any] = []
        for path in paths:
            remaining = None if max_samples is None else max_samples - len(examples)
            if remaining == 0:
                break
            examples.extend(load(path, remaining))
        return examples
    per_source = [load(path, None) for path in paths]
    total = max_samples if max_samples is not None else sum(len(p) for p in per_source)
    plan = mixture_plan([len(p) for p in per_source], list(probs), total, seed)
    return [per_source[source][row] for source, row in plan]


def proportional_counts(total: int, probs: list[float]) -> list[int]:
    """Split ``total`` samples over sources proportionally to ``probs`` (largest remainder).

    The counts sum to exactly ``total``; ties go to the earlier source, so the split is deterministic.
    """
    if any((not math.isfinite(p)) or p < 0 for p in probs) or sum(probs) <= 0:
        raise DataError(f"data.prompt_data_probs must be non-negative with a positive sum, got {probs}")
    weights = np.asarray(probs, dtype=np.float64) / float(sum(probs))
    exact = weights * total
    counts = np.floor(exact).astype(np.int64)
    remainder = total - int(counts.sum())
    order = sorted(range(len(probs)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:remainder]:
        counts[i] += 1
    return [int(c) for c in counts]


def draw_indices(size: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` indices into a source of ``size`` rows: whole shuffled passes, then a shuffled part.

    Over-sampling repeats every row before any row repeats twice; under-sampling takes a random subset.
    """
    if count == 0:
        return []
    if size == 0:
        raise DataError("cannot draw samples from a source with no usable rows")
    full_passes, rest = divmod(count, size)
    picked = [int(i) for _ in range(full_passes) for i in rng.permutation(size)]
    picked.extend(int(i) for i in rng.permutation(size)[:rest])
    return picked


def mixture_plan(sizes: list[int], probs: list[float], total: int, seed: int) -> list[tuple[int, int]]:
    """Deterministic mixture: ``(source, row)`` pairs, counts proportional to ``probs``, interleaved.

    Like OpenRLHF's ``interleave_datasets`` the sources are interleaved with the given
    probabilities, but the number of samples per source is fixed exactly
    (``proportional_counts``) rather than left to chance, so a mixture of 70/30 over 1000
    samples has exactly 700 and 300.
    """
    rng = np.random.default_rng(seed)
    counts = proportional_counts(total, probs)
    plan: list[tuple[int, int]] = []
    for source, (size, count) in enumerate(zip(sizes, counts, strict=True)):  # one count per prob
        if count and size == 0:
            raise DataError(f"source {source} has no usable rows but data.prompt_data_probs gives it {probs[source]}")
        plan.extend((source, row) for row in draw_indices(size, count, rng))
    order = rng.permutation(len(plan))
    return [plan[i] for i in order]
