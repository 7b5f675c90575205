"""One vLLM engine in a process of its own, for tests/test_vllm.py (the offloader and vLLM's plugin flag
are process globals): ``python tests/vllm_engine.py MODEL_DIR OUT.json [--flextensor JSON] [--compiled]
[--report]``. Writes the greedy tokens and logprobs of fixed prompts, and the flextensor report."""

from __future__ import annotations

import argparse
import json
import os

PROMPTS = [[1, 17, 230, 5, 99, 480], [1, 3, 900], [1, 64, 64, 2, 11, 302, 7, 45, 871, 12]]
"""Token ids; three lengths, so prefill and decode run at more than one batch size."""


def build_tiny_llama(directory: str) -> None:
    """A 4-layer Llama with random weights (seeded), saved as a transformers checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)


def generate(
    model_dir: str,
    flextensor: dict | None,
    compiled: bool,
    report: bool,
    save_profile: str | None = None,
    dtype: str = "float32",
) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = {}
    if flextensor is not None:
        kwargs.update(load_format="flextensor", additional_config={"flextensor": flextensor})
    if report or save_profile is not None:
        kwargs["worker_extension_cls"] = "flextensor.vllm.WorkerExtension"
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=128,
        seed=0,
        enforce_eager=not compiled,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS]
    results: dict = {"tokens": [], "logprobs": []}
    for _ in range(2):  # the first generate call discovers and profiles; the second runs the plan
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results["tokens"].append([list(o.outputs[0].token_ids) for o in outputs])
        results["logprobs"].append(
            [
                [
                    step[token].logprob
                    for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                ]
                for o in outputs
            ]
        )
    if report:
        results["runtime"] = llm.collective_rpc("flextensor_runtime")
        results["reports"] = llm.collective_rpc("flextensor_report")
        results["memory"] = llm.collective_rpc("flextensor_device_memory")
    if save_profile is not None:
        results["profiles"] = llm.collective_rpc("flextensor_save_profile", args=(save_profile,))
    return results


def compress_every_unit() -> None:
    """compression="lossless" for this process's engine without changing vLLM's additional_config (it is
    hashed into vLLM's compile cache: a run with it would compile graphs of its own, whose GPU kernels
    may round differently), and every unit compressed: the tiny Llama's layers are too small for a coded
    load to pay on its own."""
    import flextensor.store.coded_loads as pack_compression
    from flextensor.vllm import loader

    configured = loader.offload_config_from
    loader.offload_config_from = lambda vllm_config: configured(vllm_config).model_copy(
        update={"compression": "lossless"}
    )
    pack_compression.coded_load_pays = lambda *args: True


BAD_INPUTS = {
    "unknown_key": {"additional_config": {"flextensor": {"gpu_memory_bugdet": "1GiB"}}},
    "vllm_offload_too": {"additional_config": {"flextensor": {}}, "cpu_offload_gb": 1},
    "vllm_backend_too": {"additional_config": {"flextensor": {}}, "offload_backend": "uva"},
    "no_such_units": {"additional_config": {"flextensor": {"include_patterns": ["no.such.module"]}}},
    "budget_too_small": {"additional_config": {"flextensor": {"gpu_memory_budget": "1MiB"}}},
}
"""Engines that must refuse to start, by name: what the user passes to LLM besides the model."""


def refusals(model_dir: str) -> dict:
    """Start each engine of BAD_INPUTS; for each, the error's type and message, and the offloader vLLM
    has afterwards (the previous one must be back)."""
    from vllm import LLM
    from vllm.model_executor.offloader.base import get_offloader

    results = {}
    for name, kwargs in BAD_INPUTS.items():
        try:
            LLM(
                model=model_dir,
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=128,
                enforce_eager=True,
                load_format="flextensor",
                **kwargs,
            )
            error = None
        except Exception as e:
            error = e
            while error.__cause__ is not None and "flextensor" not in type(error).__module__:
                error = error.__cause__
        results[name] = {
            "error": None if error is None else type(error).__name__,
            "message": str(error),
            "offloader": type(get_offloader()).__name__,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--flextensor", type=json.loads, default=None)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--save-profile", default=None, help="save each worker's profile to this path")
    parser.add_argument("--bad", action="store_true", help="start the engines of BAD_INPUTS")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--compress",
        action="store_true",
        help="stream compressed, every unit (see compress_every_unit): the same additional_config, so the "
        "same compiled graphs as without",
    )
    parser.add_argument("--build", action="store_true", help="save the tiny Llama to model_dir and exit")
    args = parser.parse_args()
    if args.build:
        build_tiny_llama(args.model_dir)
        return
    for name, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.bad:
        results = refusals(args.model_dir)
    else:
        if args.compress:
            compress_every_unit()
        results = generate(
            args.model_dir, args.flextensor, args.compiled, args.report, args.save_profile, args.dtype
        )
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
