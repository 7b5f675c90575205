"""Probe for a possible feature (nothing in flextensor uses it yet): can a CUDA kernel read a token
embedding table that stays in page-locked host memory (zero-copy over the link), bitwise, and how fast?

A text encoder's embedding (UMT5-XXL: 2.1 GB, 256384 x 4096 bf16) is read a few rows per call, yet it
streams or stays resident whole. Prints whether cudaHostRegister'd memory maps into the device's address
space, whether F.embedding on that mapping equals the device table bitwise (eager, torch.compile, a CUDA
graph), and the gather's time for 1 to 65536 rows against one full copy of the table.
    device tool: carry [".whl"], command: source scripts/gpu_env.sh; python3 scripts/probe_mapped.py
"""

import ctypes
import time

import torch
import torch.nn.functional as F

from flextensor.device.cudart import loaded_cudart_path

torch.cuda.init()
lib = ctypes.CDLL(loaded_cudart_path())
V, D = 256384, 4096
w = torch.randn(V, D, dtype=torch.bfloat16)
nbytes = w.numel() * 2
cr = torch.cuda.cudart()
print("register flags 0:", int(cr.cudaHostRegister(w.data_ptr(), nbytes, 0)))
p = ctypes.c_void_p()
e = lib.cudaHostGetDevicePointer(ctypes.byref(p), ctypes.c_void_p(w.data_ptr()), 0)
print("devptr err", e, hex(p.value or 0), hex(w.data_ptr()))
attr = ctypes.c_int()
lib.cudaDeviceGetAttribute(ctypes.byref(attr), 91, 0)  # cudaDevAttrCanUseHostPointerForRegisteredMem
print("can use host pointer for registered mem:", attr.value)


class Iface:
    def __init__(self, ptr, shape, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (ptr, False), "version": 3}


mapped = torch.as_tensor(Iface(p.value, (V, D), w), device="cuda").view(torch.bfloat16)
print("mapped", mapped.device, mapped.shape, hex(mapped.data_ptr()))
wd = w.cuda()
for n in (1, 32, 512, 8192, 65536):
    ids = torch.randint(0, V, (1, n), device="cuda")
    ref = F.embedding(ids, wd)
    out = F.embedding(ids, mapped)
    torch.cuda.synchronize()
    for _ in range(3):
        F.embedding(ids, mapped)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        F.embedding(ids, mapped)
    torch.cuda.synchronize()
    tm = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(20):
        F.embedding(ids, wd)
    torch.cuda.synchronize()
    td = (time.perf_counter() - t) / 20
    print(
        f"rows {n}: equal {torch.equal(ref, out)} mapped {tm * 1e3:.3f} ms device {td * 1e3:.3f} ms "
        f"({n * D * 2 / tm / 1e9:.1f} GB/s)"
    )
t = time.perf_counter()
buf = torch.empty_like(wd)
for _ in range(3):
    buf.copy_(w, non_blocking=True)
torch.cuda.synchronize()
print(f"full copy {(time.perf_counter() - t) / 3 * 1e3:.1f} ms for {nbytes / 1e9:.2f} GB")
x = torch.randn(8, D, device="cuda", dtype=torch.bfloat16)
print("matmul equal", torch.equal(x @ mapped[:4096].T, x @ wd[:4096].T))
emb = torch.nn.Embedding(V, D, dtype=torch.bfloat16, device="meta")
emb.weight = torch.nn.Parameter(mapped, requires_grad=False)
f = torch.compile(lambda i: emb(i) * 2)
ids = torch.randint(0, V, (1, 512), device="cuda")
print("compiled equal", torch.equal(f(ids), F.embedding(ids, wd) * 2))
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    F.embedding(ids, mapped)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    o = F.embedding(ids, mapped)
g.replay()
torch.cuda.synchronize()
print("graph equal", torch.equal(o, F.embedding(ids, wd)))
