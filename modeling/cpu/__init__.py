"""The CPU speed routes, behind one seam.

The model classes hold plain torch modules and call this package at four places only, each of which
is the plain torch expression wherever its route does not apply:
- `core.layers.project(module, x)`: every projection and head; it reads the linear route in force as
  values (`routes.Seam`) and calls `routes.onednn_project` where it is
  "onednn" (oneDNN's linear op for a plain `nn.Linear` in fp32 CPU inference, linear.py), else
  `module(x)`, so PEFT's, quantizers' and hooked layers run as themselves;
- `cpu_mlp(mlp, x)`: the MLP without gradients when its activations take more than one chunk
  (`core.layers.MLP.forward` asks); row chunks with an in-place activation (mlp.py);
- `copies_for_generate(model, args, kwargs)`: around generate(); input-major copies of the decoding
  weights (weight_copies.py), else nothing;
- `sparse_native_applies` / `sparse_native_attend`: the sparse backend's native fp32 CPU kernels
  (sparse_native*.py, csrc/), else its PyTorch path.

One switch turns them all off: `cpu_routes(False)` or SWAPFORMER_CPU_ROUTES=off (routes.py), over the
per-route switches (`cpu_linear`, `sparse_cpu`, `model.decoding_copies`). `swapformer env` lists each
route, whether it is in force and why (`in_force`).
"""

from __future__ import annotations

from .mlp import IN_PLACE
from .routes import (
    Seam,
    cpu_linear,
    cpu_linear_route,
    cpu_mlp,
    cpu_routes,
    cpu_routes_on,
    linear_route_in_force,
    routes_off_reason,
)
from .sparse_native import applies as sparse_native_applies
from .sparse_native import attend as sparse_native_attend
from .sparse_native import sparse_cpu, sparse_cpu_route, sparse_route_in_force
from .weight_copies import DecodingWeights, copies_for_generate, copies_in_force


def chunking_in_force() -> str:
    """Whether MLP chunking is in force and why, for `swapformer env`."""
    off = routes_off_reason()
    if off is not None:
        return f"off ({off})"
    return f"on (without gradients, {Seam.mlp_chunk_bytes / 2**20:g} MiB of activations at a time)"


def in_force() -> dict[str, str]:
    """Each route and whether it is in force, with the reason, for `swapformer env`."""
    return {
        "CPU routes": f"off ({routes_off_reason()})" if not cpu_routes_on() else "on",
        "linear": linear_route_in_force(),
        "MLP chunking": chunking_in_force(),
        "decoding copies": copies_in_force(),
        "sparse native": sparse_route_in_force(),
    }


__all__ = [
    "IN_PLACE",
    "DecodingWeights",
    "copies_for_generate",
    "cpu_linear",
    "cpu_linear_route",
    "cpu_mlp",
    "cpu_routes",
    "cpu_routes_on",
    "in_force",
    "sparse_cpu",
    "sparse_cpu_route",
    "sparse_native_applies",
    "sparse_native_attend",
]
