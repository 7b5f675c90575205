"""Whole-pipeline workloads: a diffusers Wan2.2 text-to-video pipeline, all of it, one generation a step.

``wan22_pipeline`` is Wan2.2-T2V-A14B at its real config: two 40-block transformers (the high-noise
expert ``transformer`` and the low-noise ``transformer_2``, switched at ``boundary_ratio`` 0.875), the
UMT5-XXL text encoder and the Wan VAE, random bf16 weights (about 69 GB: generated on the GPU, never
cached on disk), 81 frames at 832x480, classifier-free guidance on, four steps with the sampling shift of
12 so that two run on each expert, then the VAE decode.

The harness sees the pipeline as one module (:class:`PipelineModule`): its components are submodules, so
weights load and ``.to()`` move as for any model, and a call is one generation. :class:`PhaseTimer`
times each phase (text encoding, each expert's steps, the decode) and records its peak memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from torch import nn

# UMT5-XXL encoder (google/umt5-xxl, Wan's text encoder), transformers' UMT5Config names.
UMT5_XXL: dict[str, Any] = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
}
UMT5_TINY: dict[str, Any] = {**UMT5_XXL, "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 32,
                             "num_layers": 2, "num_heads": 2}  # fmt: skip
# The Wan VAE (AutoencoderKLWan's defaults are Wan2.1's, which Wan2.2-A14B uses) and a tiny one.
WAN_VAE: dict[str, Any] = {}
WAN_VAE_TINY: dict[str, Any] = {"base_dim": 16, "dim_mult": [1, 2], "num_res_blocks": 1,
                                "temperal_downsample": [False]}  # fmt: skip

PROMPT_WORDS = ("a", "cat", "runs", "in", "the", "snow", "at", "dawn", "blurry", "low", "quality")
PHASES = ("encode", "transformer", "transformer_2", "decode")


class PipelineModule(nn.Module):
    """A diffusers pipeline as one module for the harness: its ``nn.Module`` components are submodules
    (``named_parameters`` names them ``transformer.blocks.0...``), and a call runs one generation."""

    def __init__(self, pipe: Any) -> None:
        super().__init__()
        self.pipe = pipe
        for name, component in pipe.components.items():
            if isinstance(component, nn.Module):
                self.add_module(name, component)
        self.timer = PhaseTimer(pipe)

    def forward(self, **call: Any) -> torch.Tensor:
        import torch

        call = dict(call)
        call["generator"] = torch.Generator().manual_seed(call.pop("seed"))  # the same noise every step
        self.timer.begin_step()
        frames = self.pipe(**call).frames
        self.timer.end_step()
        return frames


def build_pipeline(model_kwargs: dict[str, Any], tiny: bool) -> PipelineModule:
    """The pipeline with its parameters on the meta device (buffers real), in eval mode."""
    from accelerate import init_empty_weights
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    with init_empty_weights(include_buffers=False):
        text_encoder = UMT5EncoderModel(UMT5Config(**model_kwargs["text_encoder"]))
        transformer = WanTransformer3DModel(**model_kwargs["transformer"])
        transformer_2 = WanTransformer3DModel(**model_kwargs["transformer"])
        vae = AutoencoderKLWan(**model_kwargs["vae"])
    pipe = WanPipeline(
        tokenizer=_tokenizer(model_kwargs["text_encoder"]["vocab_size"]),
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=model_kwargs["shift"]),
        transformer=transformer.eval(),
        transformer_2=transformer_2.eval(),
        boundary_ratio=model_kwargs["boundary_ratio"],
    )
    pipe.set_progress_bar_config(disable=True)
    return PipelineModule(pipe).eval()


def _tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer built here (nothing downloaded), its ids within the encoder's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *PROMPT_WORDS]
    assert len(words) <= vocab_size
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def pipeline_inputs(shape: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one generation (``seed`` becomes the generator)."""
    return {
        "prompt": "a cat runs in the snow at dawn",
        "negative_prompt": "blurry low quality",
        "height": shape["height"],
        "width": shape["width"],
        "num_frames": shape["num_frames"],
        "num_inference_steps": shape["steps"],
        "guidance_scale": shape["guidance"],
        "guidance_scale_2": shape["guidance_2"],
        "max_sequence_length": shape["text_len"],
        "output_type": "pt",
        "seed": 7,
    }


class PhaseTimer:
    """Time and peak allocated memory of each phase of a generation, without synchronising the device
    inside it.

    Phases: ``encode`` (text encoder calls), ``transformer`` and ``transformer_2`` (each expert's
    forwards, guidance included), ``decode`` (``vae.decode``). Timed from the outermost entry into a
    component until it returns; time between components (the scheduler, latents, an offloader's switch
    made before the component's first hook) counts to none, and is recorded by transition instead
    (``between_s``: ``start->encode`` from the generation's start, ``encode->transformer``, ...,
    ``decode->end`` until it returned).

    On a GPU each entry and exit records an event on the current stream, and the phase's time is the
    device time between them, read once the generation has returned. A synchronisation at each phase
    boundary (this timer's first form) changed what it measured: it drained the copies an offloader
    queues ahead of a component's first unit, which the device otherwise overlaps with that unit's
    compute, so they showed as time between phases that a user's run does not spend. The peak memory
    needs no synchronisation: the caching allocator counts at allocation time, on the host. Each phase
    resets it, so the timer keeps the peak across phases and the time between them (``take_highest``).
    """

    def __init__(self, pipe: Any) -> None:
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.last_step: dict[str, Any] = {}
        self._depth = 0
        self._start: Any = 0.0  # a CUDA event on a GPU, else perf_counter's reading (see _mark)
        self._begun: Any = 0.0  # the generation's start, the same way
        self.highest = 0  # peak allocated bytes since take_highest(), across the per-phase resets
        self.highest_ever = 0
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, start, end) of this generation
        for phase, component in (
            ("encode", pipe.text_encoder),
            ("transformer", pipe.transformer),
            ("transformer_2", pipe.transformer_2),
        ):
            component.register_forward_pre_hook(self._enter_hook(phase))
            component.register_forward_hook(self._exit_hook(phase), always_call=True)
        decode = pipe.vae.decode  # wrapped on the instance: offloaders that bracket decode wrap this

        def timed_decode(*args: Any, **kwargs: Any) -> Any:
            self._enter("decode")
            try:
                return decode(*args, **kwargs)
            finally:
                self._exit("decode")

        pipe.vae.decode = timed_decode

    def _enter_hook(self, phase: str) -> Callable[..., None]:
        return lambda module, args: self._enter(phase)

    def _exit_hook(self, phase: str) -> Callable[..., None]:
        return lambda module, args, output: self._exit(phase)

    def _enter(self, phase: str) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._note_peak(_peak())  # before the reset: what ran since the last phase (a switch, latents)
        self._start = _mark()
        _reset_peak()

    def _note_peak(self, nbytes: int) -> None:
        self.highest = max(self.highest, nbytes)
        self.highest_ever = max(self.highest_ever, nbytes)

    def take_highest(self) -> int:
        """The peak allocated memory since the last call (or since the timer began), phases and the time
        between them alike: the resets at each phase hide it from ``torch.cuda.max_memory_allocated``."""
        highest, self.highest = max(self.highest, _peak()), 0
        self.highest_ever = max(self.highest_ever, highest)
        return highest

    def _exit(self, phase: str) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        self._spans.append((phase, self._start, _mark()))
        self.peaks[phase] = max(self.peaks.get(phase, 0), _peak())
        self._note_peak(self.peaks[phase])
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def begin_step(self) -> None:
        self.seconds, self.peaks, self.calls, self._spans = {}, {}, {}, []
        self._begun = _mark()

    def end_step(self) -> None:
        """Each phase's time, and the time between phases by transition (``start->encode``, ...,
        ``decode->end``: the generation's start and its return bracket the first and last)."""
        finished = _mark()
        if not isinstance(finished, float):
            finished.synchronize()  # every event before it is done
        between: dict[str, float] = {}
        previous, previous_end = "start", self._begun
        for phase, start, end in self._spans:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + _elapsed(start, end)
            key = f"{previous}->{phase}"
            between[key] = between.get(key, 0.0) + _elapsed(previous_end, start)
            previous, previous_end = phase, end
        between[f"{previous}->end"] = _elapsed(previous_end, finished)
        self._spans = []
        self.last_step = {
            "phase_s": {p: round(s, 4) for p, s in self.seconds.items()},
            "between_s": {k: round(v, 4) for k, v in between.items()},
            "phase_peak_allocated_bytes": dict(self.peaks),
            "phase_calls": dict(self.calls),
        }


def _elapsed(start: Any, end: Any) -> float:
    """Seconds between two marks (see :func:`_mark`)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000.0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _mark() -> Any:
    """An event recorded on the current stream on a GPU (no synchronisation), else the wall clock."""
    import torch

    if not _cuda():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _reset_peak() -> None:
    import torch

    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if _cuda() else 0
