"""What the entry scripts (train.py, eval.py, sample.py, average.py) share: flags that cannot
be used fail in one line, as data and config errors do, not after the script's whole help."""

import os
import sys
from collections.abc import Callable

from absl import app


def run(main: Callable[[list[str]], None], **kwargs) -> None:
    """absl's app.run(main, **kwargs), with an app.UsageError printed as one line
    "<script>: <message> (--helpshort lists the flags)", exit status 1."""

    def one_line_usage_errors(argv: list[str]) -> None:
        try:
            main(argv)
        except app.UsageError as e:
            script = os.path.basename(sys.argv[0])
            sys.exit(f"{script}: {e} (--helpshort lists the flags)")

    app.run(one_line_usage_errors, **kwargs)
