"""What the pipeline examples share: their command line, building or loading the pipeline, running it
natively and offloaded with timing and peak memory, and writing the video.

Each example (wan2_2_t2v.py, ltx2.py, cosmos.py) supplies three things: how to load its pipeline from
the hub cache (``--model-id``), how to build a tiny one from local configs (``--random-weights --tiny``)
and the keyword arguments of one generation. :func:`main` does the rest:

1. ``flextensor.offload(pipe, ...)`` under ``--budget``; with ``--profile`` a saved profile starts every
   component in steady state, and one is written there after the run when none existed;
2. warm-up generations until every component is steady (each learns its plan in its first calls; none
   with a saved profile), then ``--runs`` timed generations, with the peak memory of each;
3. the frames written to ``--output`` (an mp4);
4. with ``--compare-native`` and when the weights fit the device, the pipeline released and run without
   flextensor the same way: as many warm-up generations, then ``--runs`` timed ones; the median times
   compared, and a check that the frames equal native's bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import flextensor

MAX_WARMUPS = 6
"""Generations that may run before every component is steady (a component called once per generation
needs about three: discovery, profiling, then its plan)."""


@dataclass(frozen=True)
class Example:
    """One example pipeline: how to get it and how to run it."""

    name: str
    description: str
    load: Callable[[argparse.Namespace], Any]
    """``--model-id``: the pipeline from the user's hub cache (``from_pretrained``)."""
    build_tiny: Callable[[argparse.Namespace], Any]
    """``--random-weights --tiny``: the same pipeline classes from small local configs, random weights."""
    call_kwargs: Callable[[Any, argparse.Namespace], dict[str, Any]]
    """Keyword arguments of one generation (a fresh seeded generator each time)."""
    defaults: dict[str, Any]
    """Defaults of --steps/--frames/--height/--width/--fps for real weights."""
    tiny_defaults: dict[str, Any]
    """The same for ``--tiny``."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Options of this example only."""
    check_requirements: Callable[[], None] | None = None
    """What it needs beyond ``.[examples]``, checked before anything is built: SystemExit saying what to
    install."""


def parse_args(example: Example, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=example.description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("weights (one of)")
    source.add_argument("--model-id", help="hub id or folder of the diffusers pipeline (from the cache)")
    source.add_argument(
        "--random-weights", action="store_true", help="random weights, nothing loaded (needs --tiny)"
    )
    source.add_argument("--tiny", action="store_true", help="tiny configs built here (with --random-weights)")
    run = parser.add_argument_group("run")
    run.add_argument("--budget", help="flextensor's gpu_memory_budget, e.g. 8GiB (default: none)")
    run.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    run.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                     help="weights' dtype (default: bfloat16, float32 with --tiny)")  # fmt: skip
    run.add_argument("--steps", type=int, help="denoising steps")
    run.add_argument("--frames", type=int, help="frames to generate")
    run.add_argument("--height", type=int, help="frame height in pixels")
    run.add_argument("--width", type=int, help="frame width in pixels")
    run.add_argument("--fps", type=int, help="frames per second of the mp4")
    run.add_argument("--prompt", default="a cat runs in the snow")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--runs", type=int, default=1, help="timed generations once every component is steady")
    run.add_argument("--profile", help="profile file: loaded when it exists, written after the run otherwise")
    run.add_argument("--compare-native", action="store_true",
                     help="also run without flextensor when the weights fit the device, and check the "
                     "frames are bitwise equal")  # fmt: skip
    run.add_argument("--output", default=f"{example.name}.mp4", help="where the mp4 goes ('-': none)")
    if example.add_arguments is not None:
        example.add_arguments(parser)
    args = parser.parse_args(argv)
    if bool(args.model_id) == bool(args.random_weights):
        parser.error("give either --model-id or --random-weights --tiny")
    if args.random_weights and not args.tiny:
        parser.error("--random-weights builds tiny configs locally: add --tiny")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for key, value in (example.tiny_defaults if args.tiny else example.defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    return args


def main(example: Example, argv: list[str] | None = None) -> int:
    args = parse_args(example, argv)
    if example.check_requirements is not None:
        example.check_requirements()
    pipe = example.build_tiny(args) if args.tiny else example.load(args)
    for module in modules(pipe).values():
        module.eval()  # built from configs, they start in training mode (dropout on)
    pipe.set_progress_bar_config(disable=True)
    weights = sum(p.numel() * p.element_size() for m in modules(pipe).values() for p in m.parameters())
    print(f"{example.name}: {type(pipe).__name__}, {gib(weights)} of weights, device {args.device}")

    warmups, ours = offloaded_generations(example, pipe, args)
    if args.output != "-":
        write_video(ours[-1].frames, args.output, args.fps)
        print(f"wrote {args.output} ({len(ours[-1].frames)} frames)")
    if not args.compare_native:
        flextensor.release(pipe)
        return 0
    native = native_generations(example, pipe, args, warmups, weights)
    if native is None:
        return 0
    same = np.array_equal(native[-1].frames, ours[-1].frames)
    native_s, ours_s = (statistics.median(g.seconds for g in runs) for runs in (native, ours))
    print(f"time: native {native_s:.2f} s, flextensor {ours_s:.2f} s ({ours_s / native_s:.2f}x), median of "
          f"{args.runs} timed generation(s) after {warmups} untimed one(s), each")  # fmt: skip
    print(f"peak on the device: native {device_text(native)}, flextensor {device_text(ours)}")
    print(f"outputs match native: {'bitwise' if same else 'NO'}")
    return 0 if same else 1


def offloaded_generations(
    example: Example, pipe: Any, args: argparse.Namespace
) -> tuple[int, list[Generation]]:
    """Offload ``pipe``, run warm-ups until every component is steady, then ``--runs`` timed generations;
    returns how many warm-ups ran and the timed generations. The pipe stays offloaded."""
    config = flextensor.OffloadConfig(device=args.device, gpu_memory_budget=args.budget)
    saved = args.profile is not None and os.path.exists(args.profile)
    if saved:
        config = config.model_copy(update={"profile": args.profile})
    flextensor.offload(pipe, config)
    print(f"flextensor: offloaded, budget {args.budget or 'none'}, phase {flextensor.phase(pipe)}")
    warmups = 0
    while flextensor.phase(pipe) != "inference" and warmups < MAX_WARMUPS:
        warmups += 1  # every component learns its plan in its first calls (none with a saved profile)
        timed_generation(example, pipe, args, f"flextensor warm-up {warmups} ({flextensor.phase(pipe)})")
    learning = [n for n, m in modules(pipe).items() if flextensor.phase(m) != "inference"]
    if learning:  # a component the pipeline never calls never leaves discovery
        print(f"still learning after {warmups} warm-ups: {', '.join(learning)}")
    ours = [
        timed_generation(example, pipe, args, f"flextensor run {run + 1} ({flextensor.phase(pipe)})")
        for run in range(args.runs)
    ]
    if args.profile is not None and not saved and flextensor.phase(pipe) == "inference":
        flextensor.save_profile(pipe, args.profile)
        print(f"profile saved to {args.profile}")
    calls = {name: flextensor.status(m).forwards for name, m in modules(pipe).items()}
    print("calls per component over the runs: " + ", ".join(f"{n} {c}" for n, c in calls.items()))
    return warmups, ours


def native_generations(
    example: Example, pipe: Any, args: argparse.Namespace, warmups: int, weights: int
) -> list[Generation] | None:
    """Release ``pipe`` and run it without flextensor, warmed up as the offloaded runs were: ``warmups``
    generations, then ``--runs`` timed ones (a first generation pays one-off costs, first kernel launches
    and the allocator's growth, that a cold native run against warm offloaded ones would charge to native
    alone). None when the weights do not fit the device."""
    flextensor.release(pipe, "cpu")
    gc.collect()
    empty_cache(args.device)
    if not fits_natively(weights, args.device):
        print(f"native: skipped, {gib(weights)} of weights do not fit the device")
        return None
    pipe.to(args.device)
    for warmup in range(warmups):
        timed_generation(example, pipe, args, f"native warm-up {warmup + 1}")
    return [timed_generation(example, pipe, args, f"native run {run + 1}") for run in range(args.runs)]


def modules(pipe: Any) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


@dataclass(frozen=True)
class Generation:
    frames: np.ndarray
    seconds: float
    device_peak_bytes: int | None
    host_rss_peak_bytes: int


def timed_generation(example: Example, pipe: Any, args: argparse.Namespace, label: str) -> Generation:
    reset_peak(args.device)
    sync(args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = pipe(**example.call_kwargs(pipe, args))
    sync(args.device)
    seconds = time.perf_counter() - start
    frames = np.asarray(output.frames[0])
    result = Generation(frames, seconds, device_peak(args.device), host_rss_peak())
    print(f"{label}: {seconds:.2f} s, peak {memory_text(result)}")
    return result


def generator(args: argparse.Namespace) -> torch.Generator:
    """A fresh generator per generation (on the CPU: the same noise on every device)."""
    return torch.Generator().manual_seed(args.seed)


def write_video(frames: np.ndarray, path: str, fps: int) -> None:
    from diffusers.utils import export_to_video

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Tiny frames are smaller than a codec's macroblock: imageio pads them up (macro_block_size).
    export_to_video(list(np.clip(frames, 0.0, 1.0)), path, fps=fps)


def fits_natively(weights: int, device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return weights < 0.9 * free  # activations need room too; a miss shows as an out-of-memory error


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def device_peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated(torch.device(device)) if device.startswith("cuda") else None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def host_rss_peak() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**26 else f"{nbytes / 2**20:.2f} MiB"


def device_text(runs: list[Generation]) -> str:
    peaks = [g.device_peak_bytes for g in runs if g.device_peak_bytes is not None]
    return gib(max(peaks)) if peaks else "n/a on CPU"


def memory_text(result: Generation) -> str:
    device = "n/a on CPU" if result.device_peak_bytes is None else gib(result.device_peak_bytes)
    return f"{device} allocated on the device, host RSS max so far {gib(result.host_rss_peak_bytes)}"


def word_tokenizer(words: list[str], chat_template: str | None = None) -> Any:
    """A word-level tokenizer built here (nothing downloaded), for the tiny pipelines' prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "</s>", "<unk>", *words]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


PROMPT_WORDS = ["a", "cat", "runs", "in", "the", "snow", "blurry", "bad", "quality"]
