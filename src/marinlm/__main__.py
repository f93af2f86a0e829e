"""`python -m marinlm ...` (and `torchrun ... -m marinlm train ...`): the `marinlm` command."""

import gc
import sys

from marinlm.cli import main


def entry() -> int:
    """`main` as a process runs it (the `marinlm` script, `python -m marinlm`, torchrun's workers):
    then every object left is frozen out of the garbage collector, so that the interpreter's exit
    does not sweep all of torch's for cycles first. Nothing is lost: main has closed what it opened,
    and atexit handlers and the flush of stdout and stderr still run."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(entry())
