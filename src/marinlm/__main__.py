"""`python -m marinlm ...` (and `torchrun ... -m marinlm train ...`): the `marinlm` command."""

import sys

from marinlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
