"""Lets transformers 4.51 (the first with Qwen 3) run on Debian 12's torch 1.13: stubs for the
torch 2 names it touches at import time but an eager fp32 CPU forward and backward never use
(torch.distributed.tensor, torch.compiler, the float8 and unsigned dtypes), and
Module.named_parameters / named_buffers taking torch 2's remove_duplicate and load_state_dict its
assign (from_pretrained passes both). Imported before transformers by the tools that
need Qwen 3; does nothing on torch >= 2."""
import inspect
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

    def _with_remove_duplicate(method, table):
        def wrapper(self, prefix="", recurse=True, remove_duplicate=True):
            if remove_duplicate:
                return method(self, prefix=prefix, recurse=recurse)
            # torch 2's remove_duplicate=False: a tensor under every name it has (tied weights).
            modules = (self.named_modules(prefix=prefix, remove_duplicate=False) if recurse
                       else [(prefix, self)])
            return ((module_prefix + ("." if module_prefix else "") + name, value)
                    for module_prefix, module in modules
                    for name, value in getattr(module, table).items() if value is not None)
        return wrapper

    for name, table in (("named_parameters", "_parameters"), ("named_buffers", "_buffers")):
        method = getattr(torch.nn.Module, name)
        if "remove_duplicate" not in inspect.signature(method).parameters:
            setattr(torch.nn.Module, name, _with_remove_duplicate(method, table))

    _load_state_dict = torch.nn.Module.load_state_dict
    if "assign" not in inspect.signature(_load_state_dict).parameters:
        def load_state_dict(self, state_dict, strict=True, assign=False):
            if not assign:
                return _load_state_dict(self, state_dict, strict=strict)
            # torch 2's assign=True as from_pretrained uses it: the module's own tensors replaced
            # by the given ones (parameters kept parameters), nothing copied.
            for key, value in state_dict.items():
                if key in self._parameters:
                    old = self._parameters[key]
                    self._parameters[key] = torch.nn.Parameter(
                        value, requires_grad=old.requires_grad if old is not None else True)
                elif key in self._buffers:
                    self._buffers[key] = value
                else:
                    raise KeyError(f"load_state_dict(assign=True): no tensor {key} here")
            return torch.nn.modules.module._IncompatibleKeys([], [])
        torch.nn.Module.load_state_dict = load_state_dict
