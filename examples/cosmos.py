"""Cosmos-Transfer2.5 (a video generated under a ControlNet's control maps) with every component
offloaded by one flextensor call.

    python examples/cosmos.py --model-id nvidia/Cosmos-Transfer2.5-2B --controls edges.mp4 --budget 8GiB
    python examples/cosmos.py --random-weights --tiny --compare-native

``Cosmos2_5_TransferPipeline`` runs a Qwen2.5-VL text encoder, then at every step the transformer and
its ControlNet side by side, then the Wan VAE's decode: four components under one budget (see
docs/pipelines.md). ``--controls`` is a video of pre-computed control maps (edges for the default edge
ControlNet); without it a synthetic one is made.

diffusers' Cosmos models need torchvision, built for the installed torch: ``pip install -e '.[cosmos]'``
after installing the pair (see :func:`require_torchvision`).

diffusers requires NVIDIA's guardrail (``pip install cosmos_guardrail``) for the real model, and it is
used with ``--model-id``. Its models cannot be built from configs, so ``--random-weights`` runs without
it: random weights generate noise, which there is nothing to check in (see :class:`NoGuardrail`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
from example_common import PROMPT_WORDS, Example, generator, main, word_tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% for part in message['content'] %}{{ part['text'] }} {% endfor %}{% endfor %}"
)
"""The tiny tokenizer's chat template: the pipeline formats each prompt as a system and a user turn."""


class NoGuardrail:
    """What ``--random-weights`` gives the pipeline for its safety checker: it passes text and video
    through. Only for random weights (their output is noise); the real model gets NVIDIA's."""

    def to(self, *args: Any, **kwargs: Any) -> NoGuardrail:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video: np.ndarray) -> np.ndarray:
        return video


def require_torchvision() -> None:
    """diffusers' Cosmos models resize their padding mask with torchvision; without it they fail deep
    inside diffusers with a NameError. Checked before anything is built or loaded."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # a wheel built for another torch fails with more than ImportError
        raise SystemExit(torchvision_advice(error)) from None


def torchvision_advice(error: BaseException) -> str:
    version = torch.__version__.split("+")[0]
    major, minor = (int(part) for part in version.split(".")[:2])
    pair = f" (torchvision 0.{minor + 15}.* for torch {major}.{minor})" if major == 2 else ""
    return (
        f"cosmos needs torchvision (diffusers' Cosmos models resize their padding mask with it), and it does "
        f"not import here: {error}\n"
        f"Install the torchvision release built for your torch {torch.__version__}{pair}, from the same "
        "package index as that torch (PyPI's torchvision does not load beside a CPU-only torch), or both as "
        "PyPI's pair (CUDA builds, several GB), e.g. pip install torch==2.14.1 torchvision==0.29.1; "
        "then pip install -e '.[cosmos]'. "
        "An unpinned torchvision would bring the torch it was built for in place of yours."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cosmos")
    group.add_argument("--controls", help="video of control maps (default: a synthetic one)")
    group.add_argument("--revision", default="diffusers/general", help="the pipeline's hub revision")
    group.add_argument("--controlnet-revision", default="diffusers/controlnet/general/edge",
                       help="the ControlNet's hub revision (edge, depth, seg or blur)")  # fmt: skip


def load(args: argparse.Namespace) -> Any:
    from diffusers import Cosmos2_5_TransferPipeline, CosmosControlNetModel

    controlnet = CosmosControlNetModel.from_pretrained(
        args.model_id, revision=args.controlnet_revision, torch_dtype=args.dtype
    )
    return Cosmos2_5_TransferPipeline.from_pretrained(
        args.model_id, controlnet=controlnet, revision=args.revision, torch_dtype=args.dtype
    )


def build_tiny(args: argparse.Namespace) -> Any:
    from diffusers import (
        AutoencoderKLWan,
        Cosmos2_5_TransferPipeline,
        CosmosControlNetModel,
        CosmosTransformer3DModel,
        UniPCMultistepScheduler,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = word_tokenizer([*PROMPT_WORDS, "system", "user", "You", "are", "helpful", "assistant",
                                "who", "will", "provide", "prompts", "to", "an", "image", "generator"],
                               chat_template=CHAT_TEMPLATE)  # fmt: skip
    vocab = len(tokenizer) + 3
    torch.manual_seed(args.seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": vocab,
                         "bos_token_id": None, "eos_token_id": None, "rope_theta": 1000000.0,
                         "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}},
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16},
            hidden_size=16, vocab_size=vocab, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2,
            vision_token_id=vocab - 1,
        )
    )  # fmt: skip
    shared = dict(num_attention_heads=2, attention_head_dim=16, mlp_ratio=2, text_embed_dim=32,
                  adaln_lora_dim=4, patch_size=(1, 2, 2), max_size=(4, 32, 32),
                  rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable", img_context_dim_in=32,
                  img_context_dim_out=32)  # fmt: skip
    torch.manual_seed(args.seed + 1)
    transformer = CosmosTransformer3DModel(
        in_channels=16 + 1, out_channels=16, num_layers=2, concat_padding_mask=True,
        controlnet_block_every_n=1, img_context_num_tokens=4, **shared,
    )  # fmt: skip
    torch.manual_seed(args.seed + 2)
    controlnet = CosmosControlNetModel(
        n_controlnet_blocks=2, in_channels=16 + 1 + 1, latent_channels=16 + 1 + 1, model_channels=32,
        use_crossattn_projection=False, **shared,
    )  # fmt: skip
    torch.manual_seed(args.seed + 3)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])  # fmt: skip
    pipe = Cosmos2_5_TransferPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(),
        controlnet=controlnet,
        safety_checker=NoGuardrail(),
    )
    return pipe if args.dtype == torch.float32 else pipe.to(args.dtype)


def controls(args: argparse.Namespace) -> list[Any]:
    """The control maps: the frames of ``--controls``, or moving stripes (an edge map's kind of input)."""
    if args.controls:
        from diffusers.utils import load_video

        return load_video(args.controls)[: args.frames]
    y, x = np.mgrid[0 : args.height, 0 : args.width]
    frames = [((x + y + 4 * t) // 8 % 2).astype(np.float32) for t in range(args.frames)]
    return [torch.from_numpy(f).expand(3, -1, -1) for f in frames]  # CHW in [0, 1]


def call_kwargs(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "controls": controls(args),
        "prompt": args.prompt,
        "negative_prompt": "blurry, bad quality",
        "num_frames": args.frames,
        "num_frames_per_chunk": 93 if not args.tiny else 16,
        "height": args.height,
        "width": args.width,
        "num_inference_steps": args.steps,
        "guidance_scale": 3.0,
        "generator": generator(args),
        "output_type": "np",
        "max_sequence_length": 16 if args.tiny else 512,
    }


EXAMPLE = Example(
    name="cosmos",
    description="Cosmos-Transfer2.5 (ControlNet video generation), every component offloaded by one "
    "flextensor call.",
    load=load,
    build_tiny=build_tiny,
    call_kwargs=call_kwargs,
    defaults={"steps": 36, "frames": 93, "height": 704, "width": 1280, "fps": 30},
    tiny_defaults={"steps": 2, "frames": 3, "height": 32, "width": 32, "fps": 8},
    add_arguments=add_arguments,
    check_requirements=require_torchvision,
)

if __name__ == "__main__":
    sys.exit(main(EXAMPLE))
