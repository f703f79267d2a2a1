// attnforge._torch_reader: reads torch tensors for attnforge._C from their C++ objects (torch_reader.h). Built only
// when torch is importable at build time, against that torch; attnforge._C checks that the running torch has the
// version recorded here (__torch_version__) before it uses the reader.
#include "torch_reader.h"

#include <torch/csrc/autograd/python_variable.h>

namespace {

using attnforge::python::TorchTensorInfo;

void dtype_of(c10::ScalarType t, TorchTensorInfo* info) {
  // DLPack codes: 0 int, 1 uint, 2 float, 4 bfloat; 10 / 12 fp8 e4m3fn / e5m2 (DLPack 1.x)
  switch (t) {
    case c10::ScalarType::Float: info->code = 2, info->bits = 32; break;
    case c10::ScalarType::Half: info->code = 2, info->bits = 16; break;
    case c10::ScalarType::BFloat16: info->code = 4, info->bits = 16; break;
    case c10::ScalarType::Float8_e4m3fn: info->code = 10, info->bits = 8; break;
    case c10::ScalarType::Float8_e5m2: info->code = 12, info->bits = 8; break;
    case c10::ScalarType::Int: info->code = 0, info->bits = 32; break;
    case c10::ScalarType::Long: info->code = 0, info->bits = 64; break;
    case c10::ScalarType::Short: info->code = 0, info->bits = 16; break;
    case c10::ScalarType::Byte: info->code = 1, info->bits = 8; break;
    case c10::ScalarType::Double: info->code = 2, info->bits = 64; break;
    default: info->code = 0, info->bits = 0; break;
  }
}

int read_tensor(PyObject* obj, TorchTensorInfo* info) {
  if (!THPVariable_Check(obj)) return 0;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage()) return 0;  // undefined, or a tensor without memory (meta, fake): Python path
  const c10::Device d = t.device();
  info->device_type = d.is_cuda() ? 2 : d.is_cpu() ? 1 : 0;
  info->device_id = d.is_cuda() ? d.index() : 0;
  dtype_of(t.scalar_type(), info);
  const int64_t ndim = t.dim();
  info->ndim = ndim > attnforge::python::kTorchReaderMaxDims ? -1 : static_cast<int32_t>(ndim);
  if (info->ndim >= 0) {
    const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
    for (int64_t i = 0; i < ndim; ++i) info->shape[i] = sizes[i], info->strides[i] = strides[i];
  }
  info->data = t.data_ptr();
  return 1;
}

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_torch_reader",
                          "Reads torch tensors for attnforge._C from their C++ objects.", -1};

}  // namespace

PyMODINIT_FUNC PyInit__torch_reader() {
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  attnforge::python::TorchReader reader = &read_tensor;
  PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(reader), attnforge::python::kTorchReaderCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "read", capsule) < 0 ||
      PyModule_AddStringConstant(m, "__torch_version__", ATTNFORGE_TORCH_VERSION) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
