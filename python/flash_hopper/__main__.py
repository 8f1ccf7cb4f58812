"""`python -m flash_hopper`: the same command as the `flash-hopper` console script."""

import sys

from flash_hopper.cli import main

if __name__ == "__main__":
    sys.exit(main())
