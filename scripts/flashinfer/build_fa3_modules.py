"""Usage as build_modules.py, with module keys fa3_d64 fa3_d128 fa3_d256.
Build FlashInfer prefill modules with the kernels of mask modes 2 (custom) and 3 (multi-item scoring) replaced by
stubs that return cudaErrorNotSupported (these mask modes are never used by bench/peers_flashinfer.py)."""
import os, re, sys, time, torch
from flashinfer.jit.attention.modules import gen_batch_prefill_module
from flashinfer.jit import env as jit_env

DECL = '''#include <cstdint>
#include <cuda_runtime.h>
#include <type_traits>
// Forward declarations only (no CUTLASS, no kernels): the specializations below get the same mangled names as the
// explicit instantiations they replace (checked with nm on the linked module: no undefined *Dispatched* symbol).
struct PagedParams;
struct RaggedParams;
namespace flashinfer {{
enum class MaskMode;
struct StandardAttention;
struct LogitsSoftCap;
template <bool use_logits_soft_cap>
using DefaultAttention = std::conditional_t<use_logits_soft_cap, LogitsSoftCap, StandardAttention>;  // hopper/variants.cuh
template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,
          bool SAME_SCHEDULE_FOR_ALL_HEADS, typename AttentionVariant, typename Params>
cudaError_t BatchPrefillWithRaggedKVCacheDispatched(Params& params, bool enable_pdl, cudaStream_t stream);
template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,
          bool SAME_SCHEDULE_FOR_ALL_HEADS, typename AttentionVariant, typename Params>
cudaError_t BatchPrefillWithPagedKVCacheDispatched(Params& params, bool enable_pdl, cudaStream_t stream);
}}
'''
bf = torch.bfloat16
for key in sys.argv[1:]:
    be, d = key.split("_d"); d = int(d)
    assert be == "fa3"
    spec = gen_batch_prefill_module(be, bf, bf, bf, torch.int32, d, d, 0, False, False, False)
    for src in spec.sources:
        if not re.search(r"kernel_mask_[23]\.cu$", src.name):
            continue
        text = src.read_text()
        if "STUB-LIGHT2" in text:
            continue
        cfg = re.search(r'#include "([^"]+config\.inc)"', text).group(1)
        body = text[text.index("namespace flashinfer {"):]
        body, n = re.subn(r"template cudaError_t (\w+)\s*<([^;]*?)>\((\w+)& params, bool enable_pdl, cudaStream_t stream\);",
                          r"template <> cudaError_t \1<\2>(\3& params, bool enable_pdl, cudaStream_t stream) { return cudaErrorNotSupported; }",
                          body, flags=re.S)
        assert n == 2, (src, n)
        body = body.replace("MaskMode::kCustom", "static_cast<MaskMode>(2)").replace(
            "MaskMode::kMultiItemScoring", "static_cast<MaskMode>(3)")
        src.write_text("// STUB-LIGHT2: mask mode not used by attnforge's peer bench\n" + DECL.format(cfg=cfg) + body)
    t = time.time(); spec.build(verbose=False)
    print(key, spec.name, "built in", round(time.time() - t, 1), "s", flush=True)
    import subprocess
    und = [l for l in subprocess.run(["nm", "-D", "--undefined-only", str(spec.jit_library_path)], capture_output=True,
                                     text=True).stdout.splitlines() if "Dispatched" in l]
    print(key, "undefined *Dispatched* symbols:", len(und), flush=True)
    assert not und, und
