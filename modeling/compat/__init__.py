"""The ledgers of every touch point with transformers, torch and Accelerate beyond their public APIs."""
