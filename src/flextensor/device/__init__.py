"""The device runtime and its CPU stand-ins, resolving the device, budget and pinning once, raw
CUDA runtime calls, link probes, host limits.

May import: common, codec, config, plan, errors.
"""
