"""JSON files in a workdir: atomic writes, and reads of files that may not be there (yet)."""

import json
import os
from typing import Any


def write_json(path: str, obj: Any) -> None:
    """Write, then rename: readers such as the sweep runner never see half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, default=float)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def read_json_if_present(path: str) -> Any | None:
    """The file's JSON, or None when it is missing or incomplete (its writer was killed)."""
    try:
        return read_json(path)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: str) -> list[Any]:
    """One JSON value per non-empty line (e.g. metrics.jsonl); [] when the file is missing."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
