"""`python -m swapformer ...` runs the `swapformer` command (so `accelerate launch -m swapformer train`
works)."""

import sys

from swapformer_command import main

sys.exit(main())
