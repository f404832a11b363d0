"""The text a corpus holds, document by document: a text file, a directory of them, JSONL
records, and Parquet, Arrow and `datasets` directories (records.py)."""

import json
import sys
from pathlib import Path
from typing import Iterator

from shardlab.errors import ConfigError
from shardlab.data import listing, outdir, records


def documents(source: str, text_field: str = "text", max_bytes: int | None = None,
              stdlib_files=None) -> Iterator[str]:
  """The documents of a text source: each file of a file or directory (or of `stdlib_files`
  for "stdlib"), each line's `text_field` of a .jsonl file, or each row's `text_field`
  column of a Parquet or Arrow file or a `datasets` save_to_disk directory; at most
  `max_bytes` of text. The source is checked now, its files read as they are iterated."""
  files = stdlib_files if source == "stdlib" else _text_files(source)
  return _read(files, text_field, max_bytes)


def _read(files: list[Path], text_field: str, max_bytes: int | None) -> Iterator[str]:
  budget = max_bytes or sys.maxsize
  for path in files:
    if budget <= 0:
      return
    if path.suffix == ".jsonl" or records.is_record_file(path):
      rows = (records.texts(path, text_field) if records.is_record_file(path)
              else _jsonl(path, text_field))
      for text in rows:
        if budget <= 0:
          break
        budget -= len(text)
        yield text
      continue
    with open(path, "rb") as stream:
      data = stream.read(budget if max_bytes else -1)
    budget -= len(data)
    yield data.decode("utf-8", errors="replace")


def _jsonl(path: Path, text_field: str) -> Iterator[str]:
  with path.open(encoding="utf-8", errors="replace") as stream:
    for n, line in enumerate(stream):
      if line.strip():
        yield _field(line, text_field, path, n + 1)


def is_records(source: str) -> bool:
  """Whether `source` is read as records of a text field (not as whole text files)."""
  path = Path(source)
  return (source.endswith(".jsonl") or records.is_record_file(path)
          or (path.is_dir() and records.is_dataset_dir(path)))


def _text_files(source: str) -> list[Path]:
  path = Path(source)
  if path.is_dir():
    if records.is_dataset_dir(path):
      return records.dataset_files(path)
    files = listing.files_under(path)
    outdir.refuse_unfinished(files)
    return files
  if path.is_file():
    return [path]
  raise ConfigError(f"data.corpus {source!r} does not exist; give a text file, a directory "
                    f"of text files, a .jsonl, .parquet or .arrow file, a datasets "
                    f"save_to_disk directory, a prepared directory, a .bin/.npy token "
                    f"file, or 'stdlib'")


def _field(line: str, field: str, path: Path, n: int) -> str:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}:{n} is not JSON ({e})") from None
  if not isinstance(record, dict) or not isinstance(record.get(field), str):
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(f"{path}:{n} has no text field {field!r} (data.text_field); its keys: "
                      f"{keys}")
  return record[field]
