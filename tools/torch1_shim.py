"""Lets transformers 4.51 (the first with Qwen 3) import on Debian 12's torch 1.13: stubs for
the torch 2 names it touches at import time but an eager fp32 CPU forward and backward never
use (torch.distributed.tensor, torch.compiler, the float8 and unsigned dtypes). Imported before
transformers by the tools that need Qwen 3; does nothing on torch >= 2."""
import sys
import types

import torch

if int(torch.__version__.split(".")[0]) < 2:
    if "torch.distributed.tensor" not in sys.modules:
        import torch.distributed
        stub = types.ModuleType("torch.distributed.tensor")
        sys.modules["torch.distributed.tensor"] = stub
        torch.distributed.tensor = stub
    if not hasattr(torch, "compiler"):
        compiler = types.ModuleType("torch.compiler")
        compiler.is_compiling = lambda: False
        compiler.disable = lambda fn=None, recursive=True: fn if fn is not None else (lambda f: f)
        sys.modules["torch.compiler"] = compiler
        torch.compiler = compiler
    class _MissingDtype:  # a key of its own in dtype tables (safetensors' sizes), never made
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return "torch." + self.name + " (absent in torch " + torch.__version__ + ")"

    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if not hasattr(torch, name):
            setattr(torch, name, _MissingDtype(name))
