"""`python -m swapformer ...` runs the `swapformer` command (so `accelerate launch -m swapformer train`
works)."""

import sys

from .cli import main

sys.exit(main())
