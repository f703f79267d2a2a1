"""Arrays of any framework: dtype names, output allocation in the caller's framework, host copies of metadata and
the CUDA stream to run on. torch and cupy are used only when the caller's arrays are theirs (never imported here
otherwise); numpy and ml_dtypes are dependencies.
"""
import sys

import ml_dtypes
import numpy as np

from . import _C, _torch
from ._errors import invalid

_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
    "int": "int32",
}
_ACCEPTED = "{float32, float16, bfloat16, float8_e4m3fn, float8_e5m2}"
_NUMPY = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
}


def dtype_name(spec):
    """The attnforge name of a dtype given as a string, numpy/ml_dtypes dtype or torch dtype; None for None."""
    if spec is None:
        return None
    if isinstance(spec, _C.DType):
        return spec.name
    if isinstance(spec, str):
        name = spec
    else:
        text = str(spec)
        if text.startswith("torch."):
            name = text[len("torch."):]
        else:
            try:
                name = np.dtype(spec).name
            except TypeError:
                name = text
    return _DTYPE_ALIASES.get(name, name)


def data_dtype_name(spec, what):
    """The attnforge name of a data dtype given in any of the forms dtype_name() takes; an error naming `what` for
    others."""
    name = dtype_name(spec)
    if name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return name
    raise invalid(f"{what}: dtype {spec!r} is not accepted; expected one of {_ACCEPTED}")


def dtype_of(spec, what):
    """A _C.DType for a data dtype given in any of the forms dtype_name() takes."""
    return getattr(_C.DType, data_dtype_name(spec, what))


def _framework(a):
    module = type(a).__module__.split(".", 1)[0]
    if module in ("torch", "cupy"):
        return module
    if isinstance(a, np.ndarray):
        return "numpy"
    return module


def _torch_allocator():
    torch = sys.modules["torch"]
    empty_like, contiguous = torch.empty_like, torch.contiguous_format

    # The cheapest torch calls for the job (CPU tensors, torch 2.15: empty_like 1.0 us, new_empty 1.4-1.6 us,
    # torch.empty with dtype and device 1.7 us); both keep like's device. Outputs are always contiguous.
    def empty(like, shape, dtype):
        target = like.dtype if dtype is None else getattr(torch, dtype)
        if target == like.dtype and like.shape == shape:
            return empty_like(like, memory_format=contiguous)
        return like.new_empty(shape, dtype=target)

    return empty


def _cupy_allocator():
    cupy = sys.modules["cupy"]

    def empty(like, shape, dtype):
        if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raise invalid(f"out: cupy has no {dtype} arrays; pass out= and lse= (e.g. torch tensors)")
        with like.device:
            return cupy.empty(shape, dtype=like.dtype if dtype is None else _NUMPY[dtype])

    return empty


def _numpy_empty(like, shape, dtype):
    return np.empty(shape, dtype=like.dtype if dtype is None else _NUMPY[dtype])


_ALLOCATORS = {}


def empty(like, shape, dtype=None):
    """An uninitialized array of `shape` in the framework and on the device of `like`; `dtype` is an attnforge
    dtype name (dtype_name()), None for like's. Traceable by torch.compile (dynamo) for torch tensors."""
    allocator = _ALLOCATORS.get(type(like))
    if allocator is None:
        framework = _framework(like)
        if framework == "numpy":
            allocator = _numpy_empty
        elif framework == "torch":
            allocator = _torch_allocator()
        elif framework == "cupy":
            allocator = _cupy_allocator()
        else:
            raise invalid(f"q: cannot allocate outputs for a {type(like).__name__}; pass out= (and lse=) explicitly")
        if not _torch.tracing():  # a write that dynamo would have to replay after the graph
            _ALLOCATORS[type(like)] = allocator
    return allocator(like, shape, dtype)


def outputs(like, out, lse, out_shape, dtype=None, with_lse=True):
    """(out, lse) as given, or allocated beside `like`: out [*out_shape] of `dtype` (a name; None for like's), lse
    float32 [*out_shape[:-1]] (None unless with_lse)."""
    if out is None:
        out = empty(like, out_shape, dtype)
    if lse is None and with_lse:
        lse = empty(like, out_shape[:-1], "float32")
    return out, lse


def host_array(a, dtype, what):
    """A contiguous numpy copy (or view) of `a` with `dtype`, read from any framework or device.

    Reading device memory synchronizes with the device; pass host (CPU) metadata to plan() to avoid it.
    """
    if a is None:
        return None
    framework = _framework(a)
    if framework == "torch":
        a = a.detach().cpu().numpy()
    elif framework == "cupy":
        a = a.get()
    elif not isinstance(a, np.ndarray):
        try:
            a = np.from_dlpack(a)
        except (TypeError, BufferError, RuntimeError):
            a = np.asarray(a)
    if a.dtype != dtype and not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise invalid(f"{what}: dtype {a.dtype}; expected an integer array")
    return np.ascontiguousarray(a, dtype=dtype)


def int32_host(a, what):
    return host_array(a, np.int32, what)


def device_of(a):
    """("cpu", 0) or ("cuda", index) for an array of any framework (used at plan time only)."""
    framework = _framework(a)
    if framework == "torch":
        return (a.device.type, a.device.index or 0)
    if framework == "cupy":
        return ("cuda", a.device.id)
    if hasattr(a, "__dlpack_device__"):
        kind, index = a.__dlpack_device__()
        return ("cuda" if int(kind) in (2, 13) else "cpu", index)
    return ("cpu", 0)


def _torch_stream_getter():
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _cupy_stream_getter():
    cupy = sys.modules["cupy"]
    return lambda index: cupy.cuda.get_current_stream().ptr


_STREAM_GETTERS = {}


def current_stream(like, device_index):
    """The framework's current CUDA stream (an integer handle) for `like`'s framework; 0 (the default stream) for
    frameworks without one."""
    getter = _STREAM_GETTERS.get(type(like))
    if getter is None:
        framework = _framework(like)
        if framework == "torch":
            getter = _torch_stream_getter()
        elif framework == "cupy":
            getter = _cupy_stream_getter()
        else:
            getter = lambda index: 0  # noqa: E731
        _STREAM_GETTERS[type(like)] = getter
    return getter(device_index)


def stream_for(like, stream):
    """`stream` when given, else the current stream of `like`'s framework on its device (0 on the CPU)."""
    if stream is not None:
        return stream
    kind, index = device_of(like)
    return current_stream(like, index) if kind == "cuda" else 0


def is_torch(a):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def layout_of(kv_layout):
    if kv_layout == "NHD":
        return _C.KVLayout.NHD
    if kv_layout == "HND":
        return _C.KVLayout.HND
    raise invalid(f"kv_layout: {kv_layout!r}; expected one of {{'NHD', 'HND'}}")
