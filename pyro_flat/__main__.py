"""``python -m pyro_flat``: the comparison harness (see :mod:`pyro_flat.bench.cli`)."""

from __future__ import annotations

import sys

from .bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
