"""How a benchmark script ends: its summary, with the machine, jax's version and the exact
command added, printed as JSON and written to a file under the checkout."""

import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from xformer.files import write_json  # noqa: E402
from xformer.provenance import machine_string  # noqa: E402


def command_line() -> str:
    """The command that ran this script, from the checkout, quoted for a shell."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join(["python", script, *sys.argv[1:]])


def finish(summary: dict, output: str) -> None:
    """Print `summary` with "device", "jax" and "command" added, and write it to `output`
    (relative to the checkout unless absolute)."""
    import jax  # here: command_line's users need not import it

    summary = {
        **summary,
        "device": machine_string(),
        "jax": jax.__version__,
        "command": command_line(),
    }
    print(json.dumps(summary, indent=2))
    path = os.path.join(ROOT, output)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, summary)
