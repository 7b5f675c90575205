"""vLLM throughput with flextensor against vLLM's own offloading (issue 13, Must 6), one engine per process.

    python -m benchmarks.vllm_serve --save /tmp/llama8b          # Llama-3.1-8B config, random bf16 weights
    python -m benchmarks.vllm_serve --model /tmp/llama8b --method flextensor --batch 1,32 --out results.jsonl

Methods, all at the same ``--gpu-memory-utilization`` (low enough that the 16 GB model does not fit):
``native`` (reference; give it a utilization where the model fits), ``uva`` (``cpu_offload_gb``),
``prefetch`` (``offload_backend="prefetch"``), ``flextensor`` (``load_format="flextensor"`` with
``--budget``, and ``--compression lossless`` for compressed streaming). Prefill: ``batch`` prompts of
``--prompt-len`` tokens, one output token each. Decode: ``--decode-tokens`` tokens each, timed after the
prefill. Each phase runs ``--warmup`` times first (the first steps of flextensor learn the model). One
engine measures every ``--batch`` size in turn. Prints and appends one JSON line per batch size, with a
digest of the greedy tokens (equal digests: equal outputs), the runner and the offloader vLLM ran
(``uva`` and ``prefetch`` run on vLLM's V1 runner: 0.26's V2 runner ignores vLLM's own offload options
and keeps every weight on the GPU; ``VLLM_USE_V2_MODEL_RUNNER`` set by the caller wins).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

from benchmarks.workloads import LLAMA_8B


def save_random_llama(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    config = LlamaConfig(**LLAMA_8B, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    # Initialised on the GPU where there is one: 8B random weights take minutes on a CPU.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs: dict = {
        "model": args.model,
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "max_model_len": args.prompt_len + args.decode_tokens + 16,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        # The same KV cache for every method, whatever each one's weights take.
        "kv_cache_memory_bytes": int(args.kv_cache_gb * 2**30),
        "max_num_seqs": max(args.batches),
        "seed": 0,
    }
    if args.method == "uva":
        kwargs["cpu_offload_gb"] = args.cpu_offload_gb
    elif args.method == "prefetch":
        kwargs.update(offload_backend="prefetch", offload_group_size=args.group_size, offload_num_in_group=1)
    elif args.method == "flextensor":
        kwargs.update(
            load_format="flextensor",
            additional_config={
                "flextensor": {"gpu_memory_budget": args.budget, "compression": args.compression}
            },
        )
    if args.cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    # Every method: the workers' device memory (flextensor_device_memory), to compare at equal memory.
    kwargs["worker_extension_cls"] = "flextensor.vllm.WorkerExtension"
    if args.eager:
        kwargs["enforce_eager"] = True
    return kwargs


def timed(llm, prompts, params, tokens: list | None = None) -> float:
    """Seconds to generate; the greedy token ids go into ``tokens`` when given."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if tokens is not None:
        tokens[:] = [list(o.outputs[0].token_ids) for o in outputs]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", help="write the random Llama-3.1-8B checkpoint here and exit")
    parser.add_argument("--model")
    parser.add_argument("--method", choices=["native", "uva", "prefetch", "flextensor"], default="flextensor")
    parser.add_argument("--batch", default="1", help="batch sizes, comma-separated: one engine runs each")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.11)
    parser.add_argument("--kv-cache-gb", type=float, default=4.0)
    parser.add_argument("--budget", default="8GiB", help="flextensor's gpu_memory_budget")
    # 16.06 GB of weights less the 8 GiB (8.59 GB) flextensor keeps by default: the same weights on the GPU.
    parser.add_argument("--cpu-offload-gb", type=float, default=7.5, help="uva: GB of weights in host RAM")
    parser.add_argument("--group-size", type=int, default=2, help="prefetch: one layer per group offloaded")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile, no graphs)")
    parser.add_argument(
        "--cudagraph-mode",
        default=None,
        help="vLLM's cudagraph_mode (default: vLLM's; flextensor: FULL_DECODE_ONLY)",
    )
    parser.add_argument(
        "--compression", choices=["off", "lossless"], default="off", help="flextensor's compression"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/vllm_serve.jsonl")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batch.split(",")]
    if args.save:
        save_random_llama(args.save)
        return
    if args.method in ("uva", "prefetch"):
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # see the module docstring
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    start_s = time.perf_counter() - started
    for batch in args.batches:
        row = measure(llm, args, batch, SamplingParams, TokensPrompt)
        row["engine_start_s"] = round(start_s, 1)
        print(json.dumps(row), flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def measure(llm, args: argparse.Namespace, batch: int, SamplingParams, TokensPrompt) -> dict:
    """Prefill and decode throughput of ``batch`` prompts on the running engine, as one result row."""
    import torch
    import vllm

    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * b + 13 * i) % 32000 + 1 for i in range(args.prompt_len)])
        for b in range(batch)
    ]
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    full = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True, detokenize=False)
    for _ in range(args.warmup):  # flextensor learns each new step shape in its first steps
        timed(llm, prompts, full)
    prefill_s = min(timed(llm, prompts, prefill) for _ in range(2))
    tokens: list = []
    total_s = min(timed(llm, prompts, full, tokens) for _ in range(2))
    decode_s = max(total_s - prefill_s, 1e-9)
    row = {
        "when": time.strftime("%Y-%m-%dT%H:%M"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "vllm": vllm.__version__,
        "method": args.method,
        "batch": batch,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "budget": args.budget if args.method == "flextensor" else None,
        "compression": args.compression if args.method == "flextensor" else None,
        "kv_cache_gb": args.kv_cache_gb,
        "eager": args.eager,
        "prefill_tokens_per_s": round(batch * args.prompt_len / prefill_s, 1),
        "decode_tokens_per_s": round(batch * (args.decode_tokens - 1) / decode_s, 1),
        # Greedy tokens of the last timed run: equal digests mean equal outputs across methods.
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
    }
    row.update(llm.collective_rpc("flextensor_runtime")[0])  # runner, offloader, CUDA graphs
    memory = llm.collective_rpc("flextensor_device_memory")[0]
    row["gpu_allocated_gb"] = round(memory["allocated"] / 1e9, 2)  # weights, KV cache, what stays
    row["gpu_peak_allocated_gb"] = round(memory["peak"] / 1e9, 2)
    if args.method == "flextensor":
        report = llm.collective_rpc("flextensor_report")[0]  # the plan of this batch's decode steps
        row["streamed_units"] = sum(u["placement"] == "streamed" for u in report["units"])
    return row


if __name__ == "__main__":
    main()
