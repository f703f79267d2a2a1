# Builds FlashInfer JIT modules (decode d128; prefill fa2/fa3 d64/128/256) for the AOT folder that
# scripts/peers-flashinfer carries as .fi/aot. Usage, in a venv with the .whl packages and a CPU torch:
#   FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=1 python3 build_modules.py decode prefill_fa2_d128
# then copy each built .so (the script prints its path) to .fi/aot/<module name>/<module name>.so (scripts/flashinfer/README.md).
import os, sys, time, torch
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
from flashinfer.jit import env as jit_env
which = sys.argv[1:]
specs = {}
bf = torch.bfloat16
if "decode" in which:
    specs["decode"] = gen_batch_decode_module(bf, bf, bf, torch.int32, 128, 128, 0, False, False)
for be in ("fa2", "fa3"):
    for d in (64, 128, 256):
        key = f"prefill_{be}_d{d}"
        if key in which:
            specs[key] = gen_batch_prefill_module(be, bf, bf, bf, torch.int32, d, d, 0, False, False, False)
print("JIT_DIR", jit_env.FLASHINFER_JIT_DIR, "AOT_DIR", jit_env.FLASHINFER_AOT_DIR)
for k, s in specs.items():
    print(k, s.name, [str(p) for p in s.sources], flush=True)
    if os.environ.get("DRY"):
        s.write_ninja(); continue
    t = time.time(); s.build(verbose=False); print(k, "built in", round(time.time()-t,1), "s", s.jit_library_path, flush=True)
