"""torch tensors in and out (CPU and CUDA), the current stream, CUDA-graph capture, and every operator as a torch
custom operator: eager, torch.compile(fullgraph=True), torch.export and torch.library.opcheck against the float64
reference. Skipped without torch; the CUDA tests need a GPU and a build of attnforge with CUDA
(scripts/device-check)."""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnforge as flashinfer  # noqa: E402
from reference import DTYPES, assert_close, attention, paged_cache, rope, rounded  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 128, 16
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer.cuda_available()),
                          reason="needs a GPU and attnforge built with CUDA")


def _case(rng, kv_lens, device, dtype=torch.bfloat16):
    name = str(dtype).split(".")[1]
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, name)
    q64 = rng.standard_normal((len(kv_lens), HEADS, DIM))
    q = torch.tensor(q64, dtype=dtype, device=device)
    q64 = q.float().cpu().double().numpy()
    as_torch = lambda a: torch.from_numpy(a.astype(np.float32)).to(dtype).to(device)  # noqa: E731
    ref = np.concatenate([attention(q64[b:b + 1], k_seq[b], v_seq[b])[0] for b in range(len(kv_lens))])
    meta = [torch.from_numpy(x) for x in (indptr, indices, last)]  # host metadata: plan() never synchronizes
    return q, (as_torch(k_cache), as_torch(v_cache)), meta, ref


def _wrapper(device, **kwargs):
    workspace = torch.zeros(32 << 20, dtype=torch.uint8, device=device)
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)


def _to_numpy(t):
    return t.float().cpu().numpy()


def _tensors(device, *arrays):
    """torch tensors of numpy arrays (ml_dtypes bfloat16 goes through float32), on `device`."""
    def one(a):
        if a.dtype == DTYPES["bfloat16"]:
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return tuple(one(a) for a in arrays)


def test_tensors_read_from_their_cpp_objects(rng):
    """With attnforge._torch_reader built against this torch, tensors are read from their C++ objects
    (torch_reader_status says so), strided views at offsets included: q a slice of a wider tensor, out a view one
    row into a NaN-filled one; the result matches the float64 reference and leaves the row before out alone."""
    import importlib.util
    if importlib.util.find_spec("attnforge._torch_reader") is None:
        pytest.skip("attnforge._torch_reader is not built (torch was not importable at build time)")
    status = flashinfer._C.torch_reader_status()
    assert status.startswith("C++"), status
    q, kv, meta, ref = _case(rng, [37, 5, 64], "cpu")
    wide = torch.zeros(q.shape[0], HEADS, 2 * DIM, dtype=q.dtype)
    wide[:, :, DIM:] = q
    out_rows = torch.full((q.shape[0] + 1, HEADS, DIM), float("nan"), dtype=q.dtype)
    wrapper = _wrapper("cpu")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    assert wrapper.run(wide[:, :, DIM:], kv, out=out_rows[1:]).data_ptr() == out_rows[1:].data_ptr()
    assert_close(_to_numpy(out_rows[1:]), ref, "bfloat16")
    assert torch.isnan(out_rows[0]).all()


def test_attribute_reads_with_the_reader_off():
    """ATTNFORGE_TORCH_READER=0 keeps the attribute reads (the path of builds without the reader): the status says
    so, and the eager operator cases and the strided-view case pass through it, in a child process."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(flashinfer.__file__)))  # this attnforge
    env = dict(os.environ, ATTNFORGE_TORCH_READER="0",
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    status = subprocess.run([sys.executable, "-c", "import torch, attnforge; print(attnforge._C.torch_reader_status())"],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert status == "attributes: ATTNFORGE_TORCH_READER=0", status
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, "test_torch.py"),
                        "-k", "test_eager_cpu"], env=env, capture_output=True, text=True, cwd=here)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# Every operator of the package as a case: (make, call, check). make() gives fresh torch arguments (some operators
# write into them), call(*make()) runs the operator as an engine would, check(result) compares with the float64
# reference. Each case runs eagerly, under torch.compile(fullgraph=True), and through the dispatcher with opcheck.
def _batch_decode(rng, device):
    q, kv, meta, ref = _case(rng, [1, 17, 0, 40], device)
    wrapper = _wrapper(device)
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)

    def check(result):
        out, lse = result
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (4, HEADS)
        assert_close(_to_numpy(out), ref, "bfloat16")
    return lambda: (q, *kv), lambda q, k, v: wrapper.run(q, (k, v), return_lse=True), check


def _single_decode(rng, device):
    q, q64 = rounded(rng.standard_normal((HEADS, DIM)), "bfloat16")
    k, k64 = rounded(rng.standard_normal((29, KV_HEADS, DIM)), "bfloat16")
    v, v64 = rounded(rng.standard_normal((29, KV_HEADS, DIM)), "bfloat16")
    ref_out, ref_lse = attention(q64[None], k64, v64, soft_cap=3.0, window_left=11)

    def call(q, k, v):
        return flashinfer.single_decode_with_kv_cache(q, k, v, "NHD", logits_soft_cap=3.0, window_left=11,
                                                      return_lse=True)

    def check(result):
        out, lse = result
        assert out.dtype == torch.bfloat16 and out.shape == (HEADS, DIM) and lse.shape == (HEADS,)
        assert_close(_to_numpy(out), ref_out[0], "bfloat16")
        assert_close(_to_numpy(lse), ref_lse[0], "float16", "lse")
    return lambda: _tensors(device, q, k, v), call, check


def _single_decode_into_out(rng, device):
    q, q64 = rounded(rng.standard_normal((HEADS, DIM)), "float32")
    k, k64 = rounded(rng.standard_normal((KV_HEADS, 40, DIM)), "float32")  # HND
    v, v64 = rounded(rng.standard_normal((KV_HEADS, 40, DIM)), "float32")
    ref = attention(q64[None], k64.transpose(1, 0, 2), v64.transpose(1, 0, 2), sm_scale=0.2)[0][0]

    def call(q, k, v, out):
        assert flashinfer.single_decode_with_kv_cache(q, k, v, "HND", sm_scale=0.1, q_scale=2.0, out=out) is out
        return out
    return (lambda: (*_tensors(device, q, k, v), torch.full((HEADS, DIM), float("nan"), device=device)), call,
            lambda out: assert_close(_to_numpy(out), ref, "float32"))


def _single_prefill(rng, device):
    q, q64 = rounded(rng.standard_normal((7, HEADS, DIM)), "float32")
    k, k64 = rounded(rng.standard_normal((19, KV_HEADS, DIM)), "float32")
    v, v64 = rounded(rng.standard_normal((19, KV_HEADS, DIM)), "float32")
    mask = rng.random((7, 19)) < 0.7
    ref_out, ref_lse = attention(q64, k64, v64, causal=True, mask=mask)

    def call(q, k, v, mask):
        return flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, causal=True, return_lse=True,
                                                       o_dtype=torch.bfloat16)

    def check(result):
        out, lse = result
        assert out.dtype == torch.bfloat16 and out.shape == (7, HEADS, DIM) and lse.shape == (7, HEADS)
        assert_close(_to_numpy(out), ref_out, "bfloat16")
        assert_close(_to_numpy(lse), ref_lse, "float32", "lse")
    return lambda: _tensors(device, q, k, v, mask), call, check


def _segments(rng, cuts):
    """float32 states of 5 queries over the KV segments between `cuts` (float64 reference states, rounded), and
    the float64 attention over all of it."""
    q = rng.standard_normal((5, HEADS, DIM))
    k = rng.standard_normal((cuts[-1], KV_HEADS, DIM))
    v = rng.standard_normal((cuts[-1], KV_HEADS, DIM))
    states = [attention(q, k[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    return [(o.astype(np.float32), s.astype(np.float32)) for o, s in states], attention(q, k, v)


def _check_state(ref):
    def check(result):
        assert result[0].shape == ref[0].shape and result[1].dtype == torch.float32
        assert_close(_to_numpy(result[0]), ref[0], "float32")
        assert_close(_to_numpy(result[1]), ref[1], "float32", "lse")
    return check


def _merge_state(rng, device):
    (a, b), ref = _segments(rng, [0, 13, 40])
    return lambda: _tensors(device, *a, *b), flashinfer.merge_state, _check_state(ref)


def _merge_states(rng, device):
    states, ref = _segments(rng, [0, 9, 9, 30])  # the middle segment is empty: (0, -inf)
    v = np.stack([o for o, _ in states], axis=1)
    s = np.stack([s for _, s in states], axis=1)
    return lambda: _tensors(device, v, s), flashinfer.merge_states, _check_state(ref)


def _append(rng, device, one_array):
    page, appends = 4, [2, 5, 1]
    k_cache, v_cache, indptr, indices, last, _, _ = paged_cache(rng, [5, 5, 10], page, KV_HEADS, DIM, "float32")
    append_indptr = np.concatenate([[0], np.cumsum(appends)]).astype(np.int32)
    batch_indices, positions = flashinfer.get_batch_indices_positions(append_indptr, np.array([5, 5, 10]), 8)
    append_k, append_k64 = rounded(rng.standard_normal((8, KV_HEADS, DIM)), "bfloat16")
    append_v, append_v64 = rounded(rng.standard_normal((8, KV_HEADS, DIM)), "bfloat16")
    before = np.stack([k_cache, v_cache], axis=1)
    expected = before.copy()
    for r, (b, p) in enumerate(zip(batch_indices, positions)):
        expected[indices[indptr[b] + p // page], :, p % page] = np.stack([append_k64[r], append_v64[r]])
    arrays = (append_k, append_v, batch_indices, positions, indices, indptr, last)

    def call(append_k, append_v, batch_indices, positions, indices, indptr, last, *cache):
        kv = cache[0] if one_array else cache
        flashinfer.append_paged_kv_cache(append_k, append_v, batch_indices, positions, kv, indices, indptr, last)
        return torch.stack(cache, dim=1) if len(cache) == 2 else cache[0]

    caches = (before,) if one_array else (k_cache, v_cache)
    # Exact: the appended bfloat16 values are exact in the float32 cache; NaN tails and spare pages stay NaN.
    return (lambda: _tensors(device, *arrays, *caches), call,
            lambda cache: np.testing.assert_array_equal(_to_numpy(cache), expected))


def _rope_case(inplace, pos_ids, llama31=None):
    def case(rng, device):
        indptr, offsets = np.array([0, 3, 8], np.int32), np.array([5, 100], np.int32)
        pos = np.concatenate([np.arange(3) + 5, np.arange(5) + 100]).astype(np.int32)
        if llama31:
            pos[-1] = 20000  # beyond old_context_len
        q = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
        k = rng.standard_normal((8, KV_HEADS, DIM)).astype(np.float32)
        theta = 5e5 if llama31 else 1e4
        factors = (8.0, 1.0, 4.0, 8192.0) if llama31 else None
        ref = [rope(x, pos.astype(np.float64), theta, interleave=True, rotary_dim=32, llama31=factors)
               for x in (q, k)]
        name = "apply_llama31_rope" if llama31 else "apply_rope"
        function = getattr(flashinfer, name + ("_pos_ids" if pos_ids else "") + ("_inplace" if inplace else ""))
        where = (pos,) if pos_ids else (indptr, offsets)

        def call(q, k, *where):
            result = function(q, k, *where, rotary_dim=32, interleave=True)
            return (q, k) if inplace else result

        def check(result):
            assert_close(_to_numpy(result[0]), ref[0], "float32")
            assert_close(_to_numpy(result[1]), ref[1], "float32")
        return lambda: _tensors(device, q, k, *where), call, check
    return case


CASES = {
    "batch_decode_run": _batch_decode,
    "single_decode": _single_decode,
    "single_decode_out": _single_decode_into_out,
    "single_prefill": _single_prefill,
    "merge_state": _merge_state,
    "merge_states": _merge_states,
    "append_paged_kv_cache": lambda rng, device: _append(rng, device, False),
    "append_paged_kv_cache_one_array": lambda rng, device: _append(rng, device, True),
    "apply_rope": _rope_case(False, False),
    "apply_rope_inplace": _rope_case(True, False),
    "apply_rope_pos_ids": _rope_case(False, True),
    "apply_rope_pos_ids_inplace": _rope_case(True, True),
    "apply_llama31_rope_pos_ids": _rope_case(False, True, llama31=True),
}
FUNCTIONAL = [name for name in CASES if name != "batch_decode_run"]


@pytest.mark.parametrize("name", CASES)
def test_eager_cpu(rng, name):
    make, call, check = CASES[name](rng, "cpu")
    check(call(*make()))


@pytest.mark.parametrize("name", CASES)
def test_compile_fullgraph_cpu(rng, name):
    make, call, check = CASES[name](rng, "cpu")
    torch._dynamo.reset()
    check(torch.compile(call, fullgraph=True)(*make()))  # inductor, as engines compile


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the attnforge custom operators called (with their arguments) and runs every operator."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "attnforge":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", CASES)
def test_custom_operator_opcheck(rng, name):
    """Under a dispatch mode (here one that records), eager calls go through the dispatcher and give the reference
    result, and torch.library.opcheck validates each operator met: its schema (mutated arguments declared), its
    fake implementation under FakeTensorMode and its tracing by AOTAutograd with dynamic shapes."""
    _opcheck(CASES[name](rng, "cpu"))


@cuda
def test_cuda_batch_run_opcheck(rng):
    _opcheck(_batch_decode(rng, "cuda"))


def _opcheck(case):
    make, call, check = case
    with _Recorder() as recorder:
        check(call(*make()))
    assert recorder.calls, "no attnforge custom operator was called"
    for func, args, kwargs in recorder.calls:
        torch.library.opcheck(func, args, kwargs)


@pytest.mark.parametrize("name", CASES)
def test_make_fx_and_fake_tensor_mode(rng, name):
    """make_fx (symbolic shapes) records the operators; under FakeTensorMode an eager call gives outputs of the
    shapes, dtypes and devices the real call gives, without running anything."""
    make, call, _ = CASES[name](rng, "cpu")
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda *args: call(*args), tracing_mode="symbolic")(*make())
    assert any(str(node.target).startswith("attnforge.") for node in graph.graph.nodes)
    real = call(*make())
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = call(*(mode.from_tensor(t) for t in make()))
    real, fake = (x if isinstance(x, tuple) else (x,) for x in (real, fake))
    assert [(t.shape, t.dtype, t.device) for t in fake] == [(t.shape, t.dtype, t.device) for t in real]


def test_errors_keep_their_class_through_the_custom_operator(rng):
    make, _, _ = _merge_state(rng, "cpu")
    v_a, s_a, v_b, s_b = make()
    compiled = torch.compile(flashinfer.merge_state, fullgraph=True, backend="aot_eager")
    with pytest.raises(flashinfer.InvalidArgumentError, match="s_b"):
        compiled(v_a, s_a, v_b, s_b[:, :2])


@pytest.mark.parametrize("torch_first", [True, False])
def test_registered_whichever_is_imported_first(torch_first):
    """The operators are registered when attnforge is imported after torch, or right after torch's import."""
    imports = "import torch, attnforge" if torch_first else "import attnforge, torch"
    code = (f"{imports}\n"
            "v = torch.zeros(3, 2, 8); s = torch.zeros(3, 2)\n"
            "f = torch.compile(lambda *a: attnforge.merge_state(*a)[1] + 1, fullgraph=True, backend='aot_eager')\n"
            "assert torch.equal(f(v, s, v, s), s + 2)\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@cuda
def test_cuda_decode_against_reference(rng):
    q, kv, meta, ref = _case(rng, [1, 17, 0, 300, 45], "cuda")
    wrapper = _wrapper("cuda")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, kv, return_lse=True)
    torch.cuda.synchronize()
    assert out.device.type == "cuda"
    assert_close(_to_numpy(out), ref, "bfloat16")
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()  # the empty request


@cuda
def test_cuda_runs_on_the_current_stream(rng):
    q, kv, meta, ref = _case(rng, [700, 3], "cuda")
    wrapper = _wrapper("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
        out = wrapper.run(q, kv)
    side.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")


@cuda
def test_cuda_graph_replays_a_replan(rng):
    q, kv, meta, ref = _case(rng, [40, 9, 300, 1], "cuda")
    wrapper = _wrapper("cuda", use_cuda_graph=True)
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        wrapper.run(q, kv, out=out)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, kv, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")
    # Same batch size, other lengths and page table (a pool of the same size, the graph holds its address):
    # plan() again, replay the same graph.
    q2, kv2, meta2, ref2 = _case(rng, [300, 40, 1, 9], "cuda")
    q.copy_(q2)
    kv[0].copy_(kv2[0])
    kv[1].copy_(kv2[1])
    wrapper.plan(*meta2, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref2, "bfloat16")
    _, _, meta3, _ = _case(rng, [5, 6], "cuda")
    with pytest.raises(flashinfer.InvalidArgumentError, match="CUDA-graph mode"):
        wrapper.plan(*meta3, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)


@cuda
def test_cuda_compile_fullgraph(rng):
    q, kv, meta, ref = _case(rng, [77, 5], "cuda")
    wrapper = _wrapper("cuda")
    wrapper.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    compiled = torch.compile(lambda x: wrapper.run(x, kv, return_lse=True), fullgraph=True, backend="aot_eager")
    out, lse = compiled(q)
    torch.cuda.synchronize()
    assert_close(_to_numpy(out), ref, "bfloat16")


@cuda
def test_cuda_errors(rng):
    q, kv, meta, ref = _case(rng, [4, 4], "cuda")
    small = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(256, dtype=torch.uint8, device="cuda"))
    with pytest.raises(flashinfer.WorkspaceError, match=r"float_workspace_buffer: \d+ usable bytes.*needs \d+"):
        small.plan(*meta, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16)
    prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
    with pytest.raises(flashinfer.UnsupportedError, match="head_dim 96/96"):
        prefill.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), HEADS,
                     KV_HEADS, 96, q_data_type=torch.bfloat16)


# Functional cases with a CUDA path: single decode in bf16 (the C++ single_decode on CUDA, with a workspace the
# wrapper allocates from q's framework) and merge_state(s). The others take fp32 inputs the CUDA attention kernels
# refuse, or operators with no CUDA path yet (docs/python-compat.md).
CUDA_FUNCTIONAL = {"single_decode", "merge_state", "merge_states"}


@cuda
@pytest.mark.parametrize("name", FUNCTIONAL)
def test_cuda_functional_operators(rng, name):
    """On CUDA tensors, eagerly and from a compiled graph: the reference checks where the operator has a CUDA path,
    UnsupportedError where it has none (the fake implementations trace CUDA tensors as any others)."""
    make, call, check = CASES[name](rng, "cuda")
    if name in CUDA_FUNCTIONAL:
        check(call(*make()))
        torch._dynamo.reset()
        check(torch.compile(call, fullgraph=True, backend="aot_eager")(*make()))
        return
    with pytest.raises(flashinfer.UnsupportedError):
        call(*make())
    torch._dynamo.reset()
    with pytest.raises(flashinfer.UnsupportedError):
        torch.compile(call, fullgraph=True, backend="aot_eager")(*make())


@pytest.mark.parametrize("strict", [True, False])
def test_torch_export(rng, strict):
    """torch.export (dynamo, or non-strict Python tracing with fake tensors) records the custom operator too."""
    make, call, check = _merge_state(rng, "cpu")

    class Merge(torch.nn.Module):
        def forward(self, *args):
            return call(*args)

    program = torch.export.export(Merge(), make(), strict=strict)
    assert any(str(node.target) == "attnforge.merge_state.default" for node in program.graph.nodes)
    check(program.module()(*make()))
