"""Probe: are HF ``generate()`` tokens of the Llama-3.1-8B config (random bf16 weights) the same natively,
across processes, and offloaded under a budget? Where they differ, which decode step and which decoder layer
first.

Each run is its own process (``native`` twice, then ``ours`` under each budget), so cross-process
repeatability is measured; each records the greedy tokens, every step's logits and every decoder layer's
last-token output, and ``compare`` names the first step, the first layer and the largest difference.
    device tool: carry [".whl"], command: source scripts/gpu_env.sh; bash scripts/probe_generate.sh
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

PROMPT, NEW = 2048, 64
RECORDS = Path(os.environ.get("PROBE_RECORDS", "/tmp/probe_generate"))


def build_model():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.workloads import build_empty, get_workload, load_weights

    work = get_workload("llama32")
    model = build_empty(work)
    load_weights(work, model, "cuda")
    return model


def record_layers(model) -> list[list[torch.Tensor]]:
    """Every decoder layer's output at the last position, one list per forward (prefill, then each step)."""
    calls: list[list[torch.Tensor]] = []
    layers = model.model.layers

    def first(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if module is layers[0]:
            calls.append([])
        calls[-1].append(hidden[:, -1].float().cpu())

    for layer in layers:
        layer.register_forward_hook(first)
    return calls


def generate(model, ids):
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    torch.cuda.synchronize()
    tokens = out.sequences[0, ids.shape[1] :].cpu()
    logits = torch.stack([s[0].float().cpu() for s in out.logits])
    return tokens, logits


def run(tag: str, budget: str | None, repeats: int) -> None:
    model = build_model()
    ids = torch.randint(0, 128256, (1, PROMPT), generator=torch.Generator().manual_seed(7)).cuda()
    if budget is None:
        model = model.cuda()
    else:
        import flextensor

        config = flextensor.OffloadConfig(include_patterns=["model.layers.*"], gpu_memory_budget=budget)
        model = flextensor.offload(model, config)
    calls = record_layers(model)
    RECORDS.mkdir(parents=True, exist_ok=True)
    for i in range(repeats):
        calls.clear()
        t0 = time.perf_counter()
        tokens, logits = generate(model, ids)
        seconds = time.perf_counter() - t0
        layers = torch.stack([torch.stack(c) for c in calls])  # (forwards, layers, batch, hidden)
        name = f"{tag}-{i}"
        torch.save({"tokens": tokens, "logits": logits, "layers": layers}, RECORDS / f"{name}.pt")
        peak = torch.cuda.max_memory_allocated() / 1e9
        print(f"{name}: {seconds:.2f} s, peak {peak:.2f} GB, tokens {tokens[:8].tolist()}...", flush=True)
        if budget is not None:
            import flextensor

            print(f"  phase {flextensor.phase(model)}", flush=True)


def first_difference(a: dict, b: dict) -> dict:
    tok = (a["tokens"] != b["tokens"]).nonzero()
    step_logits = [(a["logits"][s] - b["logits"][s]).abs().max().item() for s in range(len(a["logits"]))]
    first_logit = next((s for s, d in enumerate(step_logits) if d > 0), None)
    report = {
        "first_token_differs": int(tok[0]) if len(tok) else None,
        "first_step_logits_differ": first_logit,
        "max_logit_diff": max(step_logits),
    }
    forwards = min(len(a["layers"]), len(b["layers"]))
    for f in range(forwards):
        diff = (a["layers"][f] - b["layers"][f]).abs().flatten(1).amax(1)
        nonzero = diff.nonzero()
        if len(nonzero):
            layer = int(nonzero[0])
            report["first_forward_layers_differ"] = f
            report["first_layer_differs"] = layer
            report["layer_diff_there"] = diff[layer].item()
            break
    return report


def compare() -> None:
    files = sorted(RECORDS.glob("*.pt"))
    records = {f.stem: torch.load(f) for f in files}
    base = records.get("native_a-0")
    results = {}
    for name, rec in records.items():
        if base is not None and name != "native_a-0":
            results[name] = first_difference(base, rec)
            print(f"native_a-0 vs {name}: {results[name]}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "probe_generate.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["native", "ours", "compare"])
    parser.add_argument("--tag", default="native_a")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.mode == "compare":
        compare()
    else:
        run(args.tag, args.budget if args.mode == "ours" else None, args.repeats)


if __name__ == "__main__":
    main()
