"""Importing flextensor is light: no CUDA initialised, no optional integration imported."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
import torch
import flextensor
import flextensor.cli.main, flextensor.observe.report, flextensor.observe.trace, flextensor.vllm
print(json.dumps({
    "cuda_initialized": torch.cuda.is_initialized(),
    "modules": sorted(
        m for m in ("vllm", "diffusers", "transformers", "accelerate", "peft") if m in sys.modules
    ),
}))
"""


def test_import_touches_no_cuda_and_no_optional_integration() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"cuda_initialized": False, "modules": []}
