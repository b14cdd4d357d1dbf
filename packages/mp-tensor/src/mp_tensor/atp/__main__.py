"""``python -m mp_tensor.atp``: see :mod:`mp_tensor.atp.cli`."""

from __future__ import annotations

import sys

from mp_tensor.atp.cli import main

if __name__ == "__main__":
    sys.exit(main())
