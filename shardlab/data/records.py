"""Columnar text sources for `data prepare`: Parquet files, Arrow IPC files (the file and
the streaming format) and a Hugging Face `datasets` directory written by `save_to_disk`
(its state.json lists Arrow streaming files). Read with pyarrow alone, in record batches
of the one text column named by data.text_field / --text-field, so a large file is never
held whole and `datasets` itself is not needed.
"""

import json
from pathlib import Path
from typing import Iterator

from shardlab.errors import ConfigError

PARQUET = (".parquet",)
ARROW = (".arrow", ".feather", ".ipc")
SUFFIXES = PARQUET + ARROW
DATASET_STATE, DATASET_INFO, DATASET_DICT = "state.json", "dataset_info.json", "dataset_dict.json"
BATCH_ROWS = 1024


def is_record_file(path: Path) -> bool:
  return path.suffix in SUFFIXES


def is_dataset_dir(path: Path) -> bool:
  """A `datasets` Dataset or DatasetDict written by save_to_disk."""
  return (path / DATASET_STATE).is_file() or (path / DATASET_DICT).is_file()


def dataset_files(path: Path) -> list[Path]:
  """The Arrow files of a save_to_disk directory, in the dataset's row order."""
  if (path / DATASET_DICT).is_file():
    splits = _json(path / DATASET_DICT).get("splits")
    raise ConfigError(f"{path} is a datasets DatasetDict with splits {splits}; give one "
                      f"split's directory, e.g. {path / str((splits or ['train'])[0])}")
  state = _json(path / DATASET_STATE)
  files = state.get("_data_files") if isinstance(state, dict) else None
  if not isinstance(files, list) or not all(
      isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
    raise ConfigError(f"{path / DATASET_STATE} has no list of data files (_data_files: "
                      f"[{{\"filename\": ...}}]); is it a directory written by "
                      f"datasets' save_to_disk?")
  found = [path / f["filename"] for f in files]
  missing = [str(f) for f in found if not f.is_file()]
  if missing:
    raise ConfigError(f"{path / DATASET_STATE} lists data files that are missing: {missing}")
  return found


def _json(path: Path):
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path} cannot be read as JSON ({type(e).__name__}: {e})") from None


def _pyarrow():
  try:
    import pyarrow
    import pyarrow.ipc
    import pyarrow.parquet
  except ImportError:
    raise ConfigError("reading Parquet, Arrow or a datasets directory needs the 'pyarrow' "
                      "library: pip install 'shardlab[data]' (or pip install pyarrow)") from None
  return pyarrow


def texts(path: Path, field: str) -> Iterator[str]:
  """The `field` column of a Parquet or Arrow file, row by row, read a batch at a time."""
  pa = _pyarrow()
  try:
    if path.suffix in PARQUET:
      parquet = pa.parquet.ParquetFile(str(path))
      _check(path, parquet.schema_arrow, field, pa)
      batches = parquet.iter_batches(batch_size=BATCH_ROWS, columns=[field])
    else:
      batches = _arrow_batches(path, field, pa)
    row = 0
    for batch in batches:
      column = batch.column(field)
      if column.null_count:
        first = next(i for i, v in enumerate(column.is_valid().to_pylist()) if not v)
        raise ConfigError(f"{path} row {row + first}: column {field!r} is null; every row "
                          f"needs text")
      yield from column.to_pylist()
      row += len(column)
  except (pa.ArrowException, OSError) as e:  # a truncated or damaged file
    raise ConfigError(f"{path} cannot be read as {'Parquet' if path.suffix in PARQUET else 'Arrow'}"
                      f" ({type(e).__name__}: {e})") from None


def _arrow_batches(path: Path, field: str, pa):
  """Record batches of an Arrow IPC file in either format, memory-mapped: a batch's text
  column is read where it lies, the others are never touched."""
  try:
    reader = pa.ipc.open_file(pa.memory_map(str(path)))
  except pa.ArrowInvalid:  # no file footer: the streaming format (datasets writes it)
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    _check(path, reader.schema, field, pa)
    yield from reader
    return
  _check(path, reader.schema, field, pa)
  for i in range(reader.num_record_batches):
    yield reader.get_batch(i)


def _check(path: Path, schema, field: str, pa) -> None:
  """The column exists and holds strings; else an error naming the file's columns."""
  is_text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or (
      hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))
  if field not in schema.names:
    raise ConfigError(f"{path} has no column {field!r} (--text-field / data.text_field); its "
                      f"columns: {schema.names}")
  kind = schema.field(field).type
  if not is_text(kind):
    text = [f.name for f in schema if is_text(f.type)]
    raise ConfigError(f"{path} column {field!r} holds {kind}, not text (string); its text "
                      f"columns: {text or 'none'}")
