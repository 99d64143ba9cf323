"""``python -m conformance.bench``: the same command as ``python -m conformance bench``."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
