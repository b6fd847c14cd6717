"""The core a forward runs: norms, MLP, attention, block, stack, the input checks and positions, the plan."""
