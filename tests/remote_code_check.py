"""A saved folder loaded with trust_remote_code=True in a fresh Python where swapformer cannot be imported,
for the remote-code tests (tests/conversion/test_remote_code.py) and Linformer's
(tests/variants/test_linformer.py)."""

from __future__ import annotations

import os
import textwrap

from safetensors.torch import save_file

from conftest import run_python

# Runs in a fresh interpreter: swapformer is made unimportable before anything else happens.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["swapformer"] = None
    import torch, transformers
    from safetensors.torch import load_file
    folder, auto_name, arch = sys.argv[1:4]
    data = load_file(folder + "/../io.safetensors")
    model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
    kw = dict(attention_mask=data["mask"])
    if arch == "seq2seq":
        kw.update(decoder_input_ids=data["ids"][:, :5])
    report = {"class": type(model).__module__ + "." + type(model).__name__}
    for attn in ("sdpa", "eager"):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            logits = model(data["ids"], **kw).logits
        report[attn] = (logits - data["logits"]).abs().max().item()
    report["attn_after_switch"] = model.config._attn_implementation
    print("REPORT " + json.dumps(report))
    """
)


def load_without_swapformer(folder, auto_name: str, arch: str, tmp_path, ids, mask, logits) -> dict:
    """Load `folder` with trust_remote_code=True in a fresh Python where swapformer cannot be imported,
    run `ids`/`mask` on sdpa and eager, and report the largest difference from `logits`."""
    save_file({"ids": ids, "mask": mask, "logits": logits.contiguous()}, tmp_path / "io.safetensors")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    result = run_python(SCRIPT, folder, auto_name, arch, env=env, tag="REPORT", cwd=tmp_path)
    assert result["class"].startswith("transformers_modules."), result["class"]
    return result
