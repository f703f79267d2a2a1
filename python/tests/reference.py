"""float64 references and adversarial test data for the Python tests (numpy only)."""
import math

import ml_dtypes
import numpy as np

LOG2E = 1.0 / math.log(2.0)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def rounded(x, dtype):
    """x rounded to `dtype` (a name), as the array attnforge gets, and its float64 value."""
    a = np.asarray(x, dtype=np.float64).astype(DTYPES[dtype])
    return a, a.astype(np.float64)


def attention(q, k, v, *, causal=False, sm_scale=None, window_left=-1, soft_cap=0.0, alibi=None, sinks=None,
              k_scale=1.0, v_scale=1.0, mask=None):
    """One request in float64: q [qo_len, H, D], k [kv_len, Hk, D], v [kv_len, Hk, Dv]; mask bool [qo_len, kv_len]
    (True = attend). Returns (out [qo_len, H, Dv], lse [qo_len, H] in log2 units)."""
    qo_len, heads, dim = q.shape
    kv_len, kv_heads, dim_v = v.shape
    group = heads // kv_heads
    scale = (1.0 / math.sqrt(dim) if sm_scale is None else sm_scale) * k_scale
    out = np.zeros((qo_len, heads, dim_v))
    lse = np.full((qo_len, heads), -np.inf)
    q_pos = kv_len - qo_len + np.arange(qo_len)
    kv_pos = np.arange(kv_len)
    allowed = np.ones((qo_len, kv_len), dtype=bool)
    if causal:
        allowed &= kv_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        allowed &= kv_pos[None, :] >= q_pos[:, None] - window_left
    if mask is not None:
        allowed &= mask
    for h in range(heads):
        s = scale * q[:, h, :] @ k[:, h // group, :].T
        if soft_cap > 0:
            s = soft_cap * np.tanh(s / soft_cap)
        if alibi is not None:
            s = s + alibi[h] * (kv_pos[None, :] - q_pos[:, None])
        s = np.where(allowed, s, -np.inf)
        if sinks is not None:
            s = np.concatenate([s, np.full((qo_len, 1), float(sinks[h]))], axis=1)
        m = np.max(s, axis=1, keepdims=True, initial=-np.inf)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        total = p.sum(axis=1)
        with np.errstate(divide="ignore"):
            lse[:, h] = np.log2(total) + m[:, 0] * LOG2E
        if sinks is not None:
            p = p[:, :-1]
        with np.errstate(invalid="ignore"):
            out[:, h, :] = np.where(total[:, None] > 0, (p @ (v[:, h // group, :] * v_scale)) / total[:, None], 0.0)
    return out, lse


def paged_cache(rng, kv_lens, page_size, kv_heads, dim, dtype, layout="NHD", spare_pages=3, dim_v=None):
    """A paged cache holding kv_lens tokens per request on shuffled pages, with spare pages and the tail of every
    last page filled with NaN. Returns (k_cache, v_cache, indptr, indices, last_page_len, k_seq, v_seq), where
    k_seq[b], v_seq[b] are request b's float64 values (what the reference reads, never through the page table)."""
    dim_v = dim if dim_v is None else dim_v
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    num_pages = sum(pages) + spare_pages
    order = rng.permutation(num_pages)
    shape_k = (num_pages, page_size, kv_heads, dim)
    shape_v = (num_pages, page_size, kv_heads, dim_v)
    k64 = np.full(shape_k, np.nan)
    v64 = np.full(shape_v, np.nan)
    indptr, indices, last, k_seq, v_seq = [0], [], [], [], []
    next_page = 0
    for n, p in zip(kv_lens, pages):
        ks = rng.standard_normal((n, kv_heads, dim))
        vs = rng.standard_normal((n, kv_heads, dim_v))
        ids = order[next_page:next_page + p]
        next_page += p
        for j, page in enumerate(ids):
            rows = slice(j * page_size, min(n, (j + 1) * page_size))
            count = rows.stop - rows.start
            k64[page, :count] = ks[rows]
            v64[page, :count] = vs[rows]
        indices.extend(int(i) for i in ids)
        indptr.append(len(indices))
        last.append(0 if n == 0 else n - (p - 1) * page_size)
        k_seq.append(ks)
        v_seq.append(vs)
    k_cache, _ = rounded(k64, dtype)
    v_cache, _ = rounded(v64, dtype)
    k_seq = [rounded(x, dtype)[1] for x in k_seq]
    v_seq = [rounded(x, dtype)[1] for x in v_seq]
    if layout == "HND":
        k_cache = np.ascontiguousarray(k_cache.transpose(0, 2, 1, 3))
        v_cache = np.ascontiguousarray(v_cache.transpose(0, 2, 1, 3))
    as32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return k_cache, v_cache, as32(indptr), as32(indices), as32(last), k_seq, v_seq


def assert_close(actual, expected, dtype, what="out"):
    """Compares an attnforge result with the float64 reference: NaN/inf positions must match; the worst element
    is reported with its index and both values."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape}, expected {e.shape}"
    tol = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}.get(dtype, 6e-2)
    inf_a, inf_e = ~np.isfinite(a), ~np.isfinite(e)
    assert np.array_equal(inf_a, inf_e) and np.array_equal(a[inf_a], e[inf_e]), \
        f"{what}: non-finite positions differ: {np.argwhere(inf_a != inf_e)[:5].tolist()}"
    with np.errstate(invalid="ignore"):
        err = np.where(inf_e, 0.0, np.abs(a - e) - tol * (1 + np.abs(e)))
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert err.size == 0 or err[worst] <= 0, \
        f"{what}: worst element {tuple(int(i) for i in worst)}: {a[worst]} vs reference {e[worst]} (tolerance {tol})"


def rope(x, pos, theta, scale=1.0, interleave=False, rotary_dim=None, llama31=None):
    """x [nnz, heads, head_dim] rotated in float64 at positions pos [nnz]; llama31 = (factor, low_freq_factor,
    high_freq_factor, old_context_len) or None."""
    x = x.astype(np.float64)
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    freqs = theta ** (-np.arange(0, d, 2) / d)
    if llama31 is not None:
        factor, low, high, old = llama31
        wavelen = 2 * math.pi / freqs
        smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
        freqs = (1 - smooth) * freqs / factor + smooth * freqs
    angles = (pos[:, None] / scale) * freqs[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    out = x.copy()
    if interleave:
        a, b = x[..., 0:d:2], x[..., 1:d:2]
        out[..., 0:d:2], out[..., 1:d:2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., :d // 2], x[..., d // 2:d]
        out[..., :d // 2], out[..., d // 2:d] = a * cos - b * sin, b * cos + a * sin
    return out
