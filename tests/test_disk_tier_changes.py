"""The disk tier's checkpoint changed after offload(): written over in place or truncated, the model's next
forward, ``state_dict()`` and ``release()`` raise a CheckpointError naming the file, never compute with or
hand out other weights, and never crash the process (a truncated file's mapped pages are SIGBUS when read,
so that case runs in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import flextensor
from engine_helpers import LEARN, assert_all_equal, first_tensor, run_forwards
from flextensor import CheckpointError
from real_models import llama_inputs, tiny_llama
from test_disk_tier import LAYER_COUNT, offload_with_disk

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor]:
    model = tiny_llama(layers=LAYER_COUNT)
    with torch.no_grad():
        return model, first_tensor(model(llama_inputs()))


def _overwrite_in_place(path: Path) -> None:
    """Every byte of the data changed, the size kept: a fine-tune saved over the file it was loaded from."""
    raw = path.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    with open(path, "r+b") as file:
        file.seek(header)
        file.write(bytes((b + 1) % 256 for b in raw[header:]))
    assert path.stat().st_size == len(raw)


def test_a_checkpoint_written_over_in_place_is_refused_at_the_next_forward(tmp_path: Path, llama) -> None:
    reference, expected = llama
    reference.save_pretrained(tmp_path / "llama")
    model = offload_with_disk(reference, tmp_path / "llama")
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 1), expected)
    assert flextensor.status(model).disk_bytes > 0
    _overwrite_in_place(tmp_path / "llama" / "model.safetensors")
    changed = r"model\.safetensors changed after offload\(\) \(written to"
    for _ in range(2):  # every forward, not only the first
        with pytest.raises(CheckpointError, match=changed):
            run_forwards(model, llama_inputs(), 1)
    with pytest.raises(CheckpointError, match=changed):
        model.state_dict()
    with pytest.raises(CheckpointError, match=changed):
        flextensor.release(model, "cpu")
    assert flextensor.status(model).phase == "inference"  # still offloaded: release changed nothing


def test_a_checkpoint_left_as_it_was_still_runs_after_a_refused_step(tmp_path: Path, llama) -> None:
    """Restoring the file's bytes is still a change (its modification time): refused, not half-trusted;
    an untouched checkpoint, read many steps, is never taken for a changed one."""
    reference, expected = llama
    reference.save_pretrained(tmp_path / "llama")
    model = offload_with_disk(reference, tmp_path / "llama")
    assert_all_equal(run_forwards(model, llama_inputs(), LEARN + 4), expected)
    path = tmp_path / "llama" / "model.safetensors"
    path.write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match="changed after offload"):
        run_forwards(model, llama_inputs(), 1)


_TRUNCATED_CHILD = """
import sys
from pathlib import Path

import torch

import flextensor
from engine_helpers import LEARN, run_forwards
from real_models import llama_inputs, tiny_llama
from test_disk_tier import LAYER_COUNT, offload_with_disk

folder = Path(sys.argv[1])
reference = tiny_llama(layers=LAYER_COUNT)
reference.save_pretrained(folder)
model = offload_with_disk(reference, folder)
run_forwards(model, llama_inputs(), LEARN + 1)
assert flextensor.status(model).disk_bytes > 0
path = folder / "model.safetensors"
size = path.stat().st_size
with open(path, "r+b") as file:
    file.truncate(size // 2)  # the later units' bytes, and their mapped pages, are gone
for what, call in [
    ("forward", lambda: run_forwards(model, llama_inputs(), 1)),
    ("state_dict", lambda: [t.sum() for t in model.state_dict().values()]),  # read every value
    ("release", lambda: flextensor.release(model, "cpu")),
]:
    try:
        call()
    except flextensor.CheckpointError as error:
        # a forward's reads see the truncation too; state_dict() and release() only through the check
        assert what == "forward" or f"its size went from {size} to {size // 2} bytes" in str(error), error
        print(what, "refused")
    else:
        print(what, "ran")
"""


def test_a_truncated_checkpoint_is_refused_without_a_crash(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        "FT_PROGRESS": "0",
    }
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRUNCATED_CHILD), str(tmp_path / "llama")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode} (-7 is SIGBUS): {result.stderr[-3000:]}"
    assert result.stdout.split("\n")[-4:-1] == ["forward refused", "state_dict refused", "release refused"]
