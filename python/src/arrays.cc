#include "arrays.h"

#include <algorithm>

#if ATTNFORGE_NUMPY_API
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL attnforge_numpy_api
#include <numpy/arrayobject.h>
#endif

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>

#include "attnforge/dlpack.h"
#include "core/check.h"
#include "core/env.h"
#include "torch_reader.h"

namespace nb = nanobind;

namespace attnforge::python {

namespace {

// DLPack 1.x codes for fp8 (older dlpack.h headers do not name them); src/core/dlpack.cc reads the same codes.
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;

// torch is never imported here: its types are looked up once the program has imported it.
struct TorchTypes {
  PyObject* tensor_type = nullptr;  // torch.Tensor (a borrowed reference kept alive by the torch module)
  struct Entry {
    PyObject* dtype;
    DLDataType dl;
  };
  Entry dtypes[10] = {};
  int num_dtypes = 0;
};

TorchTypes& torch_types() {
  static TorchTypes t;
  if (t.tensor_type != nullptr) return t;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed; null before import
  if (torch == nullptr) return t;
  nb::handle mod(torch);
  if (!nb::hasattr(mod, "Tensor") || !nb::hasattr(mod, "float8_e5m2")) return t;  // partly imported
  const std::pair<const char*, DLDataType> table[] = {
      {"float32", {kDLFloat, 32, 1}},          {"float16", {kDLFloat, 16, 1}},
      {"bfloat16", {kDLBfloat, 16, 1}},        {"float8_e4m3fn", {kDLFloat8E4M3FN, 8, 1}},
      {"float8_e5m2", {kDLFloat8E5M2, 8, 1}}, {"int32", {kDLInt, 32, 1}},
      {"int64", {kDLInt, 64, 1}},              {"uint8", {kDLUInt, 8, 1}},
      {"float64", {kDLFloat, 64, 1}},          {"int16", {kDLInt, 16, 1}},
  };
  for (const auto& [name, dl] : table) t.dtypes[t.num_dtypes++] = {mod.attr(name).ptr(), dl};
  t.tensor_type = mod.attr("Tensor").ptr();
  return t;
}

int64_t as_int64(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

// Attribute and method names of torch tensors, interned once: a lookup by C string builds a new str every call.
struct TorchNames {
  PyObject *dtype, *is_cuda, *is_cpu, *get_device, *shape, *stride, *data_ptr;
};
const TorchNames& torch_names() {
  static const TorchNames n = {PyUnicode_InternFromString("dtype"),      PyUnicode_InternFromString("is_cuda"),
                               PyUnicode_InternFromString("is_cpu"),     PyUnicode_InternFromString("get_device"),
                               PyUnicode_InternFromString("shape"),      PyUnicode_InternFromString("stride"),
                               PyUnicode_InternFromString("data_ptr")};
  return n;
}

// obj.<name> and obj.<name>() as new references (vectorcall, no bound-method object); a Python error is thrown.
nb::object get_attr(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}
nb::object call_method(nb::handle obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

// attnforge._torch_reader's reader (torch_reader.h) when that module exists and was built against the running
// torch; otherwise null, with the reason in `why`. Looked up once, after torch has been imported.
struct ReaderLookup {
  TorchReader read = nullptr;
  std::string why;
};
const ReaderLookup& torch_reader() {
  static const ReaderLookup lookup = [] {
    ReaderLookup r;
    // 0: the attribute reads, for A/B runs and tests.
    if (detail::env_choice("ATTNFORGE_TORCH_READER", {"0", "1"}, "1") == "0") {
      r.why = "ATTNFORGE_TORCH_READER=0";
      return r;
    }
    PyObject* module = PyImport_ImportModule("attnforge._torch_reader");
    if (module == nullptr) {
      if (PyErr_ExceptionMatches(PyExc_ModuleNotFoundError)) {
        r.why = "attnforge._torch_reader is not built (torch was not importable when attnforge was built)";
      } else {  // built, but it does not load with this torch (an ABI or library mismatch): say what failed
        nb::python_error e;
        r.why = std::string("attnforge._torch_reader does not import: ") + e.what();
      }
      PyErr_Clear();
      return r;
    }
    nb::object mod = nb::steal(module);
    const std::string built = nb::cast<std::string>(mod.attr("__torch_version__"));
    const std::string running =
        nb::cast<std::string>(nb::handle(PyDict_GetItemString(PyImport_GetModuleDict(), "torch")).attr("__version__"));
    if (built != running) {
      r.why = "attnforge._torch_reader was built against torch " + built + ", this is torch " + running;
      return r;
    }
    r.read = reinterpret_cast<TorchReader>(PyCapsule_GetPointer(mod.attr("read").ptr(), kTorchReaderCapsule));
    if (r.read == nullptr) {
      PyErr_Clear();
      r.why = "attnforge._torch_reader has no reader capsule";
    } else {
      r.why = "torch " + running;
    }
    return r;
  }();
  return lookup;
}

// A torch tensor read from its C++ object (torch_reader), then checked by from_dlpack like any DLPack tensor; false
// for what it cannot describe (another device, dtype or rank), which the DLPack import then reports.
bool torch_view_native(TorchReader read, nb::handle obj, const char* name, TensorView& out) {
  TorchTensorInfo info;
  if (!read(obj.ptr(), &info) || info.device_type == 0 || info.bits == 0 || info.ndim < 0 || info.ndim > kMaxDims)
    return false;
  DLTensor dl{};
  dl.data = info.data;
  dl.device = {info.device_type == 2 ? kDLCUDA : kDLCPU, info.device_id};
  dl.ndim = info.ndim;
  dl.dtype = {info.code, info.bits, 1};
  dl.shape = info.shape;
  dl.strides = info.strides;
  out = from_dlpack(dl, name);
  return true;
}

// A torch tensor read from its C++ object when attnforge._torch_reader serves this torch (torch_view_native), else
// through its attributes, then checked by from_dlpack like any DLPack tensor. (The attribute reads cost about
// 0.6 us per tensor with torch 2.15 on the dev machine, most of run()'s overhead above the C++ call.)
bool torch_view(nb::handle obj, const char* name, TensorView& out) {
  TorchTypes& torch = torch_types();
  if (torch.tensor_type == nullptr || !PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(torch.tensor_type)))
    return false;
  if (const TorchReader read = torch_reader().read) return torch_view_native(read, obj, name, out);
  const TorchNames& names = torch_names();
  nb::object dtype = get_attr(obj, names.dtype);
  const TorchTypes::Entry* entry = nullptr;
  for (int i = 0; i < torch.num_dtypes; ++i)
    if (torch.dtypes[i].dtype == dtype.ptr()) entry = &torch.dtypes[i];
  if (entry == nullptr) return false;  // a dtype outside the table: DLPack import reports it
  DLDevice device{};
  if (get_attr(obj, names.is_cuda).ptr() == Py_True) {
    device = {kDLCUDA, static_cast<int32_t>(as_int64(call_method(obj, names.get_device).ptr()))};
  } else if (get_attr(obj, names.is_cpu).ptr() == Py_True) {
    device = {kDLCPU, 0};
  } else {
    return false;  // other torch devices: DLPack import reports them
  }
  nb::object shape = get_attr(obj, names.shape);
  nb::object strides = call_method(obj, names.stride);
  const Py_ssize_t ndim = PyTuple_Size(shape.ptr());
  if (ndim < 0 || ndim > kMaxDims) detail::fail_arg("{}: {} dimensions; expected 0 to {}", name, ndim, kMaxDims);
  int64_t shape_v[kMaxDims], strides_v[kMaxDims];
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    shape_v[i] = as_int64(PyTuple_GET_ITEM(shape.ptr(), i));
    strides_v[i] = as_int64(PyTuple_GET_ITEM(strides.ptr(), i));
  }
  DLTensor dl{};
  dl.data = PyLong_AsVoidPtr(call_method(obj, names.data_ptr).ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  dl.device = device;
  dl.ndim = static_cast<int32_t>(ndim);
  dl.dtype = entry->dl;
  dl.shape = shape_v;
  dl.strides = strides_v;
  out = from_dlpack(dl, name);
  return true;
}

// Imported read-only: nanobind then takes the exporter's cheaper unversioned capsule. attnforge validates outputs
// itself; a read-only output array is the caller's contract to keep.
// `dtype`, when given, replaces the exported element type (same size).
bool dlpack_view(nb::handle obj, const char* name, TensorView& out, const DLDataType* dtype = nullptr) {
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a, false)) return false;
  DLTensor dl{};
  dl.data = a.data_handle();
  dl.byte_offset = a.byte_offset();
  dl.device = {static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  dl.ndim = static_cast<int32_t>(a.ndim());
  dl.dtype = dtype ? *dtype : DLDataType{a.dtype().code, a.dtype().bits, a.dtype().lanes};
  dl.shape = const_cast<int64_t*>(a.shape_ptr());
  dl.strides = const_cast<int64_t*>(a.stride_ptr());
  out = from_dlpack(dl, name);
  return true;
}

#if !ATTNFORGE_NUMPY_API
// numpy arrays of ml_dtypes types: numpy's DLPack export refuses them, so they are viewed as unsigned integers of
// the same size and relabelled.
bool ml_dtypes_view(nb::handle obj, const char* name, TensorView& out) {
  static PyObject* ndarray_type = nullptr;
  if (ndarray_type == nullptr) {
    PyObject* numpy = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");  // borrowed
    if (numpy == nullptr) return false;
    ndarray_type = nb::handle(numpy).attr("ndarray").ptr();
  }
  if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(ndarray_type)) return false;
  nb::object dtype = obj.attr("dtype");
  if (nb::cast<std::string>(dtype.attr("kind")) != "V") return false;  // ml_dtypes types are numpy "void" kinds
  const std::string dtype_name = nb::cast<std::string>(nb::str(dtype.attr("name")));
  DLDataType real;
  const char* as_int;
  if (dtype_name == "bfloat16") real = {kDLBfloat, 16, 1}, as_int = "uint16";
  else if (dtype_name == "float8_e4m3fn") real = {kDLFloat8E4M3FN, 8, 1}, as_int = "uint8";
  else if (dtype_name == "float8_e5m2") real = {kDLFloat8E5M2, 8, 1}, as_int = "uint8";
  else return false;
  return dlpack_view(obj.attr("view")(nb::str(as_int)), name, out, &real);
}
#endif

#if ATTNFORGE_NUMPY_API
// numpy arrays read through numpy's C API: a few field reads instead of a DLPack capsule per call, and the
// ml_dtypes types (which numpy's DLPack export refuses) recognized by their scalar types.
bool numpy_view(nb::handle obj, const char* name, TensorView& out) {
  if (!PyArray_Check(obj.ptr())) return false;
  auto* a = reinterpret_cast<PyArrayObject*>(obj.ptr());
  const PyArray_Descr* d = PyArray_DESCR(a);
  DLDataType dt{};
  switch (d->type_num) {
    case NPY_FLOAT32: dt = {kDLFloat, 32, 1}; break;
    case NPY_FLOAT16: dt = {kDLFloat, 16, 1}; break;
    case NPY_FLOAT64: dt = {kDLFloat, 64, 1}; break;
    case NPY_INT32: dt = {kDLInt, 32, 1}; break;
    case NPY_INT64: dt = {kDLInt, 64, 1}; break;
    case NPY_UINT8: dt = {kDLUInt, 8, 1}; break;
    case NPY_INT8: dt = {kDLInt, 8, 1}; break;
    case NPY_INT16: dt = {kDLInt, 16, 1}; break;
    default: {
      static PyObject *bf16 = nullptr, *e4m3 = nullptr, *e5m2 = nullptr;
      if (bf16 == nullptr) {
        PyObject* ml = PyDict_GetItemString(PyImport_GetModuleDict(), "ml_dtypes");  // borrowed
        if (ml == nullptr) return false;
        nb::handle m(ml);
        bf16 = m.attr("bfloat16").ptr(), e4m3 = m.attr("float8_e4m3fn").ptr(), e5m2 = m.attr("float8_e5m2").ptr();
      }
      const auto* type = reinterpret_cast<PyObject*>(d->typeobj);
      if (type == bf16) dt = {kDLBfloat, 16, 1};
      else if (type == e4m3) dt = {kDLFloat8E4M3FN, 8, 1};
      else if (type == e5m2) dt = {kDLFloat8E5M2, 8, 1};
      else return false;  // DLPack import reports it
    }
  }
  const int ndim = PyArray_NDIM(a);
  if (ndim > kMaxDims) detail::fail_arg("{}: {} dimensions; expected 0 to {}", name, ndim, kMaxDims);
  const int64_t itemsize = PyArray_ITEMSIZE(a);
  int64_t shape[kMaxDims], strides[kMaxDims];
  for (int i = 0; i < ndim; ++i) {
    shape[i] = PyArray_DIMS(a)[i];
    const int64_t bytes = PyArray_STRIDES(a)[i];
    if (bytes % itemsize != 0)
      detail::fail_arg("{}: stride of {} bytes in dimension {} is not a multiple of the element size {}", name, bytes,
                       i, itemsize);
    strides[i] = bytes / itemsize;
  }
  if (PyArray_SIZE(a) == 0) {  // numpy may give an array without elements zero strides: give it dense ones
    int64_t dense = 1;
    for (int i = ndim - 1; i >= 0; --i) strides[i] = dense, dense *= std::max<int64_t>(shape[i], 1);
  }
  DLTensor dl{};
  dl.data = PyArray_DATA(a);
  dl.device = {kDLCPU, 0};
  dl.ndim = ndim;
  dl.dtype = dt;
  dl.shape = shape;
  dl.strides = strides;
  out = from_dlpack(dl, name);
  return true;
}
#endif

}  // namespace

void init_arrays() {
#if ATTNFORGE_NUMPY_API
  if (_import_array() < 0) throw nb::python_error();
#endif
}

TensorView view_of(nb::handle obj, const char* name) {
  TensorView v;
  if (obj.is_none()) detail::fail_arg("{}: None; expected an array", name);
#if ATTNFORGE_NUMPY_API
  if (numpy_view(obj, name, v) || torch_view(obj, name, v) || dlpack_view(obj, name, v)) return v;
#else
  if (torch_view(obj, name, v) || ml_dtypes_view(obj, name, v) || dlpack_view(obj, name, v)) return v;
#endif
  // Let the DLPack exporter explain itself (e.g. "unsupported dtype"), then name the argument.
  std::string why;
  if (nb::hasattr(obj, "__dlpack__")) {
    try {
      obj.attr("__dlpack__")();
    } catch (const nb::python_error& e) {
      why = std::string("; its __dlpack__() says: ") + e.what();
    }
  }
  detail::fail_arg("{}: a {} is not accepted{}; expected an array with __dlpack__ (numpy, torch, cupy, ...) of "
                   "dtype float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, int64 or uint8",
                   name, nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))))), why);
}

TensorView optional_view(nb::handle obj, const char* name) {
  if (!obj.is_valid() || obj.is_none()) return TensorView{};
  return view_of(obj, name);
}

std::string torch_reader_status() {
  if (PyDict_GetItemString(PyImport_GetModuleDict(), "torch") == nullptr) return "not asked: torch is not imported";
  const ReaderLookup& r = torch_reader();
  return r.read ? "C++ (attnforge._torch_reader, " + r.why + ")" : "attributes: " + r.why;
}

}  // namespace attnforge::python
