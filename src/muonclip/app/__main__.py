"""``python -m muonclip.app``: the ``muonclip`` command (see `muonclip.app.main`)."""

import sys

from .main import main

if __name__ == "__main__":  # not when a `compare` worker process re-imports the main module
    sys.exit(main())
