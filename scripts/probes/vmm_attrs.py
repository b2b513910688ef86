#!/usr/bin/env python3
"""Probe: what the driver reports for tensors of torch's expandable segments (cuMemCreate/cuMemMap
memory), the memory commd registers through POSIX-fd export instead of cuIpcGetMemHandle.

Run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (and without, to compare). Prints, per
tensor, the pointer attributes commd's registration uses: RANGE_START/SIZE, MAPPING_BASE/SIZE,
BUFFER_ID, MEMORY_BLOCK_ID, IS_LEGACY_CUDA_IPC_CAPABLE, ALLOWED_HANDLE_TYPES, and whether
cuIpcGetMemHandle / cuMemRetainAllocationHandle + cuMemExportToShareableHandle(POSIX fd) work,
walking the mappings a large tensor spans.
"""

import ctypes as C
import os

import torch

cu = C.CDLL("libcuda.so.1")
ATTR = {  # name: (attribute, ctype)
    "range_start": (11, C.c_uint64), "range_size": (12, C.c_size_t),
    "buffer_id": (7, C.c_uint64), "legacy_ipc": (10, C.c_int), "mapped": (13, C.c_int),
    "handle_types": (14, C.c_uint), "mapping_base": (19, C.c_uint64),
    "mapping_size": (18, C.c_size_t), "block_id": (20, C.c_uint64),
}


def attrs(ptr: int) -> dict:
    out = {}
    for name, (a, t) in ATTR.items():
        v = t()
        rc = cu.cuPointerGetAttribute(C.byref(v), a, C.c_uint64(ptr))
        out[name] = v.value if rc == 0 else f"rc{rc}"
    return out


def export(ptr: int) -> str:
    h = C.c_uint64()
    rc = cu.cuMemRetainAllocationHandle(C.byref(h), C.c_void_p(ptr))
    if rc:
        return f"retain rc{rc}"
    fd = C.c_int(-1)
    rc2 = cu.cuMemExportToShareableHandle(C.byref(fd), h, 1, C.c_ulonglong(0))
    cu.cuMemRelease(h)
    if rc2:
        return f"export rc{rc2}"
    os.close(fd.value)
    return "fd ok"


def ipc(ptr: int) -> str:
    buf = (C.c_char * 64)()
    rc = cu.cuIpcGetMemHandle(buf, C.c_uint64(ptr))
    return "ok" if rc == 0 else f"rc{rc}"


def show(name: str, t: torch.Tensor) -> None:
    p = t.data_ptr()
    end = p + t.numel() * t.element_size()
    print(f"== {name}: ptr {p:#x}, {end - p} bytes; ipc {ipc(p)}; export {export(p)}")
    q = p
    n = 0
    while q < end and n < 8:
        a = attrs(q)
        print(f"   at {q:#x}: {a}")
        mb, ms = a["mapping_base"], a["mapping_size"]
        if not isinstance(mb, int) or not isinstance(ms, int) or ms == 0:
            break
        q = mb + ms
        n += 1


torch.cuda.init()
print("PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
c = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
d = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
small = torch.empty(1000, dtype=torch.float32, device="cuda")
for n, t in (("1 MiB a", a), ("1 MiB b", b), ("100 MiB", c), ("3 GiB", d), ("4 KB", small)):
    show(n, t)
del c
torch.cuda.empty_cache()
c2 = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
show("100 MiB after free+empty_cache", c2)
