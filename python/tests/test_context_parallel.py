"""Context parallelism (attnforge.distributed) on the CPU: ranks simulated in one process. Every rank's wrapper
plans the whole batch and runs its share into its slot of one shared gathered buffer (what NCCL's all-gather
leaves on every rank); the merge must give the single-run result and the float64 reference, for both partitions,
decode and prefill, with requests that have no page on some ranks. Options a split cannot honour are refused,
naming themselves. The NCCL runs on a GPU are in test_context_parallel_cuda.py."""
import numpy as np
import pytest

import attnforge
from attnforge import distributed
from reference import assert_close, attention, paged_cache, rounded

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 64, 5
KV_LENS = [1, 17, 0, 33, 12, 4]   # 1, 4, 0, 7, 3 and 1 pages: with 3 ranks, requests 0 and 5 are on one rank only
PARTITIONS = ["round_robin_pages", "contiguous"]
WRAPPERS = {"decode": (attnforge.BatchDecodeWithPagedKVCacheWrapper,
                       attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper),
            "prefill": (attnforge.BatchPrefillWithPagedKVCacheWrapper,
                        attnforge.ContextParallelBatchPrefillWithPagedKVCacheWrapper)}


def _batch(rng, kind, dtype="float32", kv_lens=KV_LENS):
    k_cache, v_cache, indptr, indices, last, k_seq, v_seq = paged_cache(rng, kv_lens, PAGE, KV_HEADS, DIM, dtype)
    qo_lens = [1] * len(kv_lens) if kind == "decode" else [min(3, n) if n else 2 for n in kv_lens]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q, q64 = rounded(rng.standard_normal((qo[-1], HEADS, DIM)), dtype)
    return q, q64, qo, (k_cache, v_cache), (indptr, indices, last), k_seq, v_seq


def _plan(wrapper, kind, qo, table, dtype, **options):
    if kind == "decode":
        wrapper.plan(*table, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype, **options)
    else:
        wrapper.plan(qo, *table, HEADS, KV_HEADS, DIM, PAGE, q_data_type=dtype, **options)


def _simulate(kind, world_size, partition, q, qo, kv, table, dtype, plan_options=None, run_options=None):
    """The merged (out, lse) of `world_size` simulated ranks, and their wrappers."""
    plan_options, run_options = plan_options or {}, run_options or {}
    ranks = []
    gathered = None
    for rank in range(world_size):
        w = WRAPPERS[kind][1](np.zeros(4 << 20, np.uint8), world_size=world_size, rank=rank, partition=partition,
                              gathered_buffer=gathered)
        _plan(w, kind, qo, table, dtype, **plan_options)
        gathered = w.gathered_buffer  # one buffer for all ranks, as after the all-gather
        gathered[:] = 0xFF            # NaN in every slot: a slot no rank wrote cannot pass
        ranks.append(w)
    for w in ranks:
        assert w.gathered_buffer is gathered
        w.run_rank(q, kv, **run_options)
    out, lse = ranks[-1].merge(return_lse=True)
    return out, lse, ranks


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_simulated_ranks_equal_one_run(rng, kind, partition, world_size):
    dtype = "float32"
    q, q64, qo, kv, table, k_seq, v_seq = _batch(rng, kind, dtype)
    single = WRAPPERS[kind][0](np.zeros(4 << 20, np.uint8))
    _plan(single, kind, qo, table, dtype)
    ref_out, ref_lse = single.run(q, kv, return_lse=True)
    out, lse, ranks = _simulate(kind, world_size, partition, q, qo, kv, table, dtype)
    # The batch has requests without a page on some rank (what the test is about), and every token on one rank.
    kv_lens = np.stack([w.rank_page_table[3] for w in ranks])
    assert np.array_equal(kv_lens.sum(axis=0), KV_LENS)
    if world_size > 1:
        assert ((kv_lens == 0) & (np.array(KV_LENS) > 0)).any()
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.dtype == np.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype, "lse")
    f64_out = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k_seq[b], v_seq[b])[0] for b in range(len(KV_LENS))])
    assert_close(out, f64_out, dtype)
    empty = slice(qo[2], qo[3])  # request 2 has no KV: the identity of the merge
    assert np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_per_layer_options_and_output_dtype(rng, kind):
    dtype = "bfloat16"
    q, q64, qo, kv, table, k_seq, v_seq = _batch(rng, kind, dtype)
    options = {"sm_scale": 0.07, "logits_soft_cap": 2.5}
    single = WRAPPERS[kind][0](np.zeros(4 << 20, np.uint8))
    _plan(single, kind, qo, table, dtype)
    ref_out = single.run(q, kv, **options)
    out, _, _ = _simulate(kind, 4, "round_robin_pages", q, qo, kv, table, dtype, run_options=options)
    assert out.dtype == q.dtype
    assert_close(out, ref_out.astype(np.float32), dtype)
    # The options matter (a run without them is far off) and the same options at plan() give the same result.
    assert np.abs(out.astype(np.float32) - single.run(q, kv).astype(np.float32)).max() > 0.05
    planned, _, _ = _simulate(kind, 2, "contiguous", q, qo, kv, table, dtype, plan_options=options)
    assert_close(planned, ref_out.astype(np.float32), dtype)
    f64 = np.concatenate([attention(q64[qo[b]:qo[b + 1]], k_seq[b], v_seq[b], sm_scale=0.07, soft_cap=2.5)[0]
                          for b in range(len(KV_LENS))])
    assert_close(out, f64, dtype)


def test_block_tables_and_float32_output(rng):
    q, q64, qo, kv, (indptr, indices, last), k_seq, v_seq = _batch(rng, "decode")
    table = np.full((len(KV_LENS), 9), -1, np.int32)
    for b in range(len(KV_LENS)):
        table[b, :indptr[b + 1] - indptr[b]] = indices[indptr[b]:indptr[b + 1]]
    gathered = None
    ranks = []
    for rank in range(2):
        w = attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper(
            np.zeros(4 << 20, np.uint8), world_size=2, rank=rank, gathered_buffer=gathered)
        w.plan(None, None, None, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", block_tables=table,
               seq_lens=np.array(KV_LENS, np.int32))
        gathered = w.gathered_buffer
        ranks.append(w)
    for w in ranks:
        w.run_rank(q, kv)
    out = ranks[0].merge()
    ref = np.concatenate([attention(q64[b:b + 1], k_seq[b], v_seq[b])[0] for b in range(len(KV_LENS))])
    assert_close(out, ref, "float32")


def test_partition_and_merge_functions_by_hand(rng):
    """partition_pages and merge_gathered_states with the single-GPU wrapper writing into the slots."""
    q, q64, qo, kv, table, k_seq, v_seq = _batch(rng, "decode")
    world_size = 3
    layout = distributed.RankStateLayout(len(KV_LENS), HEADS, DIM)
    buffer = np.zeros(distributed.gathered_buffer_bytes(layout, world_size), np.uint8)
    start = (-buffer.ctypes.data) % 256
    pages = []
    for rank in range(world_size):
        indptr, indices, last, kv_lens = distributed.partition_pages(*table, PAGE, world_size, rank)
        pages.append(indices)
        slot = buffer[start + rank * layout.rank_bytes:start + (rank + 1) * layout.rank_bytes]
        o = slot[:layout.lse_offset].view(np.float32)[:len(KV_LENS) * HEADS * DIM].reshape(len(KV_LENS), HEADS, DIM)
        s = slot[layout.lse_offset:].view(np.float32)[:len(KV_LENS) * HEADS].reshape(len(KV_LENS), HEADS)
        w = attnforge.BatchDecodeWithPagedKVCacheWrapper(np.zeros(4 << 20, np.uint8))
        w.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32", o_data_type="float32")
        w.run(q, kv, out=o, lse=s, return_lse=True)
    # Round robin: rank r holds pages r, r + 3, ... of every request; together, every page once.
    assert sorted(np.concatenate(pages).tolist()) == sorted(table[1].tolist())
    indptr, indices = table[0], table[1]
    expected = np.concatenate([indices[indptr[b]:indptr[b + 1]][1::world_size] for b in range(len(KV_LENS))])
    assert np.array_equal(pages[1], expected)
    out, lse = distributed.merge_gathered_states(layout, buffer, world_size, return_lse=True)
    ref = [attention(q64[b:b + 1], k_seq[b], v_seq[b]) for b in range(len(KV_LENS))]
    assert_close(out, np.concatenate([r[0] for r in ref]), "float32")
    assert_close(lse, np.concatenate([r[1] for r in ref]), "float32", "lse")
    # Merging fewer ranks than ran leaves pages out: the result changes.
    assert not np.allclose(distributed.merge_gathered_states(layout, buffer, 2), out)


REFUSED = [
    ("prefill", {"causal": True}, {}, "causal"),
    ("decode", {"q_len_per_req": 2}, {}, "causal"),
    ("decode", {"window_left": 8}, {}, "window_left"),
    ("prefill", {}, {"window_left": 3}, "window_left"),
    ("decode", {"pos_encoding_mode": "ALIBI"}, {}, "alibi_slopes"),
    ("prefill", {"pos_encoding_mode": "ROPE_LLAMA"}, {}, "rope"),
    ("decode", {}, {"sinks": np.zeros(HEADS, np.float32)}, "sinks"),
]


@pytest.mark.parametrize("kind,plan_options,run_options,option", REFUSED)
@pytest.mark.parametrize("partition", PARTITIONS)
def test_refused_options_name_themselves(rng, kind, plan_options, run_options, option, partition):
    q, _, qo, kv, table, _, _ = _batch(rng, kind)
    if plan_options.get("q_len_per_req"):
        q = np.concatenate([q, q])
    w = WRAPPERS[kind][1](np.zeros(4 << 20, np.uint8), world_size=2, rank=0, partition=partition)
    with pytest.raises(attnforge.UnsupportedError, match=rf"^{option}.*{partition} partition"):
        _plan(w, kind, qo, table, "float32", **plan_options)
        w.run_rank(q, kv, **run_options)


def test_refused_custom_mask(rng):
    q, _, qo, kv, table, k_seq, _ = _batch(rng, "prefill")
    mask = np.concatenate([np.ones(int(qo[b + 1] - qo[b]) * len(k_seq[b]), bool) for b in range(len(KV_LENS))])
    w = attnforge.ContextParallelBatchPrefillWithPagedKVCacheWrapper(np.zeros(4 << 20, np.uint8), world_size=2,
                                                                     rank=1)
    with pytest.raises(attnforge.UnsupportedError, match="^custom_mask"):
        _plan(w, "prefill", qo, table, "float32", custom_mask=mask)
    with pytest.raises(attnforge.InvalidArgumentError, match="before plan"):  # the refused plan is not kept
        w.run_rank(q, kv)


def test_argument_errors(rng):
    ws = np.zeros(4 << 20, np.uint8)
    cls = attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper
    with pytest.raises(attnforge.InvalidArgumentError, match=r"partition: 'ring'.*'round_robin_pages', 'contiguous'"):
        cls(ws, world_size=2, rank=0, partition="ring")
    with pytest.raises(attnforge.InvalidArgumentError, match=r"rank: 2; expected in \[0, 2\)"):
        cls(ws, world_size=2, rank=2)
    with pytest.raises(attnforge.InvalidArgumentError, match="world_size: 0; expected an int >= 1"):
        cls(ws, world_size=0, rank=0)
    with pytest.raises(attnforge.InvalidArgumentError, match="communicator: None; expected"):
        cls(ws)
    with pytest.raises(attnforge.InvalidArgumentError, match="communicator: str; expected"):
        cls(ws, communicator="nccl")
    with pytest.raises(attnforge.InvalidArgumentError, match=r"unique_id: 3 bytes; expected the 128 bytes"):
        distributed.NcclCommunicator(2, 0, b"abc")
    q, _, qo, kv, table, _, _ = _batch(rng, "decode")
    w = cls(ws, world_size=2, rank=0)
    w.plan(*table, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")
    with pytest.raises(attnforge.InvalidArgumentError, match="no communicator"):
        w.run(q, kv)
    small = cls(ws, world_size=2, rank=0, gathered_buffer=np.zeros(64, np.uint8))
    small.plan(*table, HEADS, KV_HEADS, DIM, PAGE, q_data_type="float32")  # a larger buffer replaces it
    assert small.gathered_buffer.nbytes == distributed.gathered_buffer_bytes(small.state_layout, 2)
    layout = small.state_layout
    with pytest.raises(attnforge.WorkspaceError, match=r"gathered_buffer: 64 bytes.*2 ranks' states need"):
        distributed.merge_gathered_states(layout, np.zeros(64, np.uint8), 2)


def test_enable_pdl_reaches_the_rank_run(rng):
    """run() and run_rank() take FlashInfer's enable_pdl like the single-GPU wrapper's run(): None, True and False
    give the same merged result (the CPU has no programmatic launch), and a value that is not a bool is refused by
    the binding."""
    q, _, qo, kv, table, _, _ = _batch(rng, "decode")
    results = [_simulate("decode", 2, PARTITIONS[0], q, qo, kv, table, "float32", run_options={"enable_pdl": e})[:2]
               for e in (None, True, False)]
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])
    w = WRAPPERS["decode"][1](np.zeros(4 << 20, np.uint8), world_size=2, rank=0)
    _plan(w, "decode", qo, table, "float32")
    with pytest.raises(TypeError):
        w.run_rank(q, kv, enable_pdl="yes")


@pytest.mark.skipif("CUDA off" not in attnforge.build_info(), reason="this build has CUDA; see the GPU tests")
def test_cpu_build_has_no_nccl():
    with pytest.raises(attnforge.UnsupportedError, match="nccl_unique_id: this build has no CUDA backend"):
        distributed.nccl_unique_id()
    with pytest.raises(attnforge.UnsupportedError, match="no CUDA backend"):
        distributed.NcclCommunicator(1, 0, bytes(128))
    with pytest.raises(attnforge.UnsupportedError, match="no CUDA backend"):
        attnforge.ContextParallelBatchDecodeWithPagedKVCacheWrapper(np.zeros(1024, np.uint8), communicator=12345)
