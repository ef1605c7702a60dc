"""``python -m muonclip.app``: the ``muonclip`` command (see `muonclip.app.main`)."""

import sys

from .main import main

sys.exit(main())
