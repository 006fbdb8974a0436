"""Files in a workdir: atomic JSON writes, reads of files that may not be there (yet), and
checks that an output can be written, made before any compute."""

import json
import os
from typing import Any


def write_json(path: str, obj: Any) -> None:
    """Write, then rename: readers such as the sweep runner never see half a file (the
    temporary name is the writer's own, so two writers of one file do not mix their parts)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=float)
    os.replace(tmp, path)


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
    """One JSON value per non-empty line (e.g. metrics.jsonl); [] when the file is missing. A
    line that is not JSON (cut by a kill while it was written) is skipped."""
    if not os.path.exists(path):
        return []
    values = []
    with open(path) as f:
        for line in f:
            try:
                values.append(json.loads(line))
            except json.JSONDecodeError:  # (an empty line too)
                continue
    return values


def check_writable(directory: str, what: str) -> None:
    """Make `directory` if needed; raise OSError naming it (as `what`) when that fails or it
    cannot be written."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"{what} {directory}: cannot be made ({e.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"{what} {directory}: cannot write files there")


def check_output_file(path: str, flag: str) -> None:
    """Raise OSError naming `flag` when the file `path` could not be written: it is a directory,
    or names one (ends in a separator), or its folder cannot be made or written."""
    if os.path.isdir(path) or not os.path.basename(path):
        raise IsADirectoryError(f"{flag}={path} is a directory, not a file")
    check_writable(os.path.dirname(os.path.abspath(path)), f"{flag}={path}: its folder")
