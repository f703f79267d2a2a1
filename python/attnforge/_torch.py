"""torch integration, active once the program imports torch (attnforge never imports it itself).

Every operator of the package (the wrappers' run() included) is a function that writes into the arrays it is given,
outputs allocated by its caller, and returns nothing. ``operator`` registers such a function as the torch custom
operator ``attnforge::NAME``, mutating the arguments it names, with a fake (meta) implementation that returns
nothing, as the real one does. While torch traces (torch.compile, torch.export, make_fx, FakeTensorMode: see
`tracing`), the callers' output allocations are torch.empty calls in the graph and the work is the custom operator,
so ``torch.compile(fullgraph=True)`` traces through every operator. Eager calls bypass the dispatcher (it costs
microseconds) and call the function directly; so do calls captured in a CUDA graph.

The operators are registered when attnforge is imported if torch already is, and otherwise right after torch's own
import completes (an import hook), so the order of the two imports does not matter.
"""
import functools
import importlib.util
import inspect
import itertools
import sys
import typing
import warnings
import weakref


class Tensor:
    """The annotation of an array argument in an operator's signature: torch.Tensor in the registered operator."""


_operators = []  # (name, function, mutated argument names) of every operator, registered once torch is seen
_wrappers = weakref.WeakValueDictionary()  # handle -> wrapper, for attnforge::batch_run
_next_handle = itertools.count(1)
_torch = None  # the torch module once the operators are registered


def _never():
    return False


# Once torch is seen: whether torch traces, so that the operators must go through the dispatcher. Dynamo and
# torch.export evaluate torch.compiler.is_compiling() to True; make_fx, FakeTensorMode and other Python dispatch modes
# hand the operators tensors without data (or must see them), and are on torch's dispatch mode stack.
tracing = _never


def register_wrapper(wrapper):
    handle = next(_next_handle)
    _wrappers[handle] = wrapper
    return handle


def wrapper(handle):
    return _wrappers[handle]


def _returns_nothing(*args, **kwargs):
    return None


def _register(torch, name, function, mutates_args):
    types = {Tensor: torch.Tensor, typing.Optional[Tensor]: typing.Optional[torch.Tensor]}
    signature = inspect.signature(function)

    def implementation(*args, **kwargs):
        function(*args, **kwargs)

    # torch infers the operator's schema from the annotations: attnforge's Tensor becomes torch.Tensor.
    implementation.__signature__ = signature.replace(
        parameters=[p.replace(annotation=types.get(p.annotation, p.annotation))
                    for p in signature.parameters.values()],
        return_annotation=None)
    op = torch.library.custom_op(f"attnforge::{name}", implementation, mutates_args=mutates_args)
    op.register_fake(_returns_nothing)


def operator(name, mutates_args):
    """Decorator: `function` (annotated with Tensor, Optional[Tensor], int, float, bool, str, lists and Optional
    scalars; returns None) becomes attnforge::`name` once torch is seen, mutating `mutates_args`. The returned
    callable runs `function` directly, or the custom operator while torch.compile traces."""
    def decorate(function):
        _operators.append((name, function, tuple(mutates_args)))
        if _torch is not None:
            _register(_torch, name, function, tuple(mutates_args))

        @functools.wraps(function)
        def call(*args):
            if tracing():
                return getattr(_torch.ops.attnforge, name)(*args)
            return function(*args)

        return call

    return decorate


def _register_ops(torch):
    global _torch, tracing
    for name, function, mutates_args in _operators:
        _register(torch, name, function, mutates_args)
    is_compiling = torch.compiler.is_compiling
    dispatch_modes = torch._C._len_torch_dispatch_stack

    def torch_traces():
        return is_compiling() or dispatch_modes() > 0  # dynamo stops at the first: a constant True for it

    _torch = torch
    tracing = torch_traces


def ensure_registered():
    """Registers the operators if the program has imported torch (at import of attnforge and at every plan())."""
    if _torch is None and "torch" in sys.modules:
        _register_ops(sys.modules["torch"])


class _AfterTorchImport:
    """A meta path finder that registers the operators as soon as torch's own import has completed: an operator
    that dynamo meets unregistered could not be registered during the trace (that is a graph break)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                _register_ops(module)
            except Exception as e:  # a failure here must not fail the program's `import torch`
                warnings.warn(f"attnforge: registering the torch custom operators failed ({e!r}); torch.compile "
                              "will not trace attnforge's operators", RuntimeWarning, stacklevel=2)

        spec.loader.exec_module = exec_then_register
        return spec


def register_now_or_after_torch_import():
    if "torch" in sys.modules:
        ensure_registered()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())
