"""Context parallelism: one batch's paged KV cache split over ranks (one GPU each), every rank running the batch's
queries on its share of the pages and the ranks' attention states merged exactly (attnforge/context_parallel.h).

Each rank makes a wrapper over its own communicator and plans with the *whole* batch's page table; plan() keeps
this rank's share (``partition``: "round_robin_pages" or "contiguous"). run() then runs the share into this rank's
slot of a buffer of all ranks' packed states, all-gathers the slots over NCCL in place and merges them, all on the
framework's current stream, allocating nothing (a torch CUDA graph captures it). Queries are replicated: every rank
passes all of q. Options that depend on absolute KV positions (causal, windows, ALiBi, RoPE, custom masks) and
attention sinks are refused, with the reason (include/attnforge/context_parallel.h).

Communicators: ``NcclCommunicator(world_size, rank, nccl_unique_id_from_rank_0, device=...)``, or the integer
``ncclComm_t`` of one made elsewhere (cupy's ``NcclCommunicator().comm``, torch's ProcessGroupNCCL: see
docs/python-compat.md), which stays the caller's. NCCL is opened at run time: libnccl.so.2, or the path in
ATTNFORGE_NCCL_LIBRARY (PyTorch wheels carry one under nvidia/nccl/lib).

Without a communicator (``world_size=`` and ``rank=`` given instead) run_rank() writes this rank's slot only and
merge() merges a filled buffer: ranks simulated in one process, or states moved by the caller's own transport.
"""
import sys
from typing import Optional

import numpy as np

from . import _C, _torch
from ._arrays import current_stream, data_dtype_name, device_of, empty, host_array, outputs, stream_for
from ._errors import invalid
from ._torch import Tensor, operator
from ._wrapper import no_custom_args
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper

RankStateLayout = _C.RankStateLayout
KVPartition = _C.KVPartition

_PARTITIONS = {"round_robin_pages": KVPartition.round_robin_pages, "contiguous": KVPartition.contiguous}
_UNIQUE_ID_BYTES = 128
_ALIGN = 256  # the packed states start at the gathered buffer's first 256-byte aligned address


def _partition_of(partition):
    if isinstance(partition, KVPartition):
        return partition
    if partition not in _PARTITIONS:
        raise invalid(f"partition: {partition!r}; expected one of {{'round_robin_pages', 'contiguous'}}")
    return _PARTITIONS[partition]


def _count(value, what, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise invalid(f"{what}: {value!r}; expected an int >= {minimum}")
    return int(value)


def _world_and_rank(world_size, rank):
    world_size = _count(world_size, "world_size", 1)
    rank = _count(rank, "rank", 0)
    if rank >= world_size:
        raise invalid(f"rank: {rank}; expected in [0, {world_size}) for world_size {world_size}")
    return world_size, rank


def nccl_unique_id():
    """NCCL's unique id (128 bytes) for a new communicator: made on one rank, sent to the others by any channel
    (e.g. ``torch.distributed.broadcast_object_list([uid], src=0)``), then given to NcclCommunicator on every rank.
    Raises UnsupportedError in builds without CUDA, BackendError when NCCL cannot be loaded."""
    return _C.nccl_unique_id()


def _cuda_index(device):
    """The CUDA device index of `device`: an int, "cuda" / "cuda:N", a torch.device, or None (torch's current
    device when torch is imported and initialized, else 0)."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        return int(device)
    text = str(device)
    if text == "cuda":
        return _cuda_index(None)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise invalid(f"device: {device!r}; expected a CUDA device: an int index, 'cuda', 'cuda:N' or a torch.device")


class NcclCommunicator:
    """An NCCL communicator of ``world_size`` ranks made by attnforge, for callers without one. Every rank constructs
    it with the same ``unique_id`` (nccl_unique_id() of one rank) at about the same time: the constructor blocks
    until all ranks have joined. ``device``: this rank's GPU (int, "cuda:N", torch.device; default: torch's current
    device, else 0). destroy() (or ``with``, or garbage collection) frees it; wrappers using it must be done first.
    """

    def __init__(self, world_size, rank, unique_id, *, device=None):
        world_size, rank = _world_and_rank(world_size, rank)
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _UNIQUE_ID_BYTES:
            got = f"{len(unique_id)} bytes" if isinstance(unique_id, (bytes, bytearray)) else type(unique_id).__name__
            raise invalid(f"unique_id: {got}; expected the {_UNIQUE_ID_BYTES} bytes of nccl_unique_id() from one rank")
        self._handle = 0
        self.world_size, self.rank, self.device = world_size, rank, _cuda_index(device)
        self._handle = _C.nccl_comm_init_rank(world_size, rank, bytes(unique_id), self.device)

    @property
    def handle(self):
        """The ncclComm_t as an int (0 once destroyed)."""
        return self._handle

    def destroy(self):
        handle, self._handle = self._handle, 0
        if handle:
            _C.nccl_comm_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # at interpreter exit NCCL or CUDA may be gone already
            pass

    def __repr__(self):
        return f"NcclCommunicator(world_size={self.world_size}, rank={self.rank}, device=cuda:{self.device})"


def partition_pages(indptr, indices, last_page_len, page_size, world_size, rank, *, partition="round_robin_pages",
                    block_tables=None, seq_lens=None):
    """The share of ``rank`` of a batch's page table (FlashInfer's CSR arrays, or block_tables with seq_lens), as
    host int32 arrays (indptr, indices, last_page_len, kv_lens) of a CSR table into the same cache. A request with
    no page on this rank has no pages and last_page_len 0."""
    world_size, rank = _world_and_rank(world_size, rank)
    if block_tables is not None:
        if seq_lens is None:
            raise invalid("seq_lens: None with block_tables given; expected int32 [batch_size] KV lengths")
        args = (None, None, None, host_array(block_tables, np.int32, "block_tables"),
                host_array(seq_lens, np.int32, "seq_lens"))
    else:
        args = (host_array(indptr, np.int32, "indptr"), host_array(indices, np.int32, "indices"),
                host_array(last_page_len, np.int32, "last_page_len"), None, None)
    share = _C.partition_pages(*args, int(page_size), world_size, rank, _partition_of(partition))
    return tuple(np.asarray(a, dtype=np.int32) for a in share)


def gathered_buffer_bytes(layout, world_size):
    """Bytes of a gathered buffer for `world_size` ranks' states (with room to start at a 256-byte boundary)."""
    return _count(world_size, "world_size", 1) * layout.rank_bytes + _ALIGN


def merge_gathered_states(layout, gathered_buffer, world_size, *, out=None, lse=None, return_lse=False,
                          o_data_type="float32", stream=None):
    """Merges the packed states of `world_size` ranks in `gathered_buffer` (slot r from its first 256-byte aligned
    address + r * layout.rank_bytes) into out [n, num_heads, head_dim] (allocated beside the buffer with
    ``o_data_type`` when not given), and lse [n, num_heads] (log2) when ``return_lse`` or given."""
    out, lse = outputs(gathered_buffer, out, lse, (layout.n, layout.num_heads, layout.head_dim),
                       data_dtype_name(o_data_type, "o_data_type"), return_lse or lse is not None)
    _C.merge_gathered_states(layout, gathered_buffer, int(world_size), out, lse, stream_for(gathered_buffer, stream))
    return (out, lse) if return_lse else out


class _ContextParallel:
    """plan() and run() of the two context-parallel wrappers, on top of the single-GPU wrapper they derive from:
    the rank's share planned by the base class, the run through BatchAttention.run_context_parallel."""

    def _init_context_parallel(self, communicator, world_size, rank, partition, gathered_buffer):
        self._partition = _partition_of(partition)
        if communicator is None:
            if world_size is None or rank is None:
                raise invalid("communicator: None; expected an attnforge.distributed.NcclCommunicator, an int "
                              "ncclComm_t, or None with world_size= and rank= (run_rank() and merge() only)")
            self._communicator, self._comm_handle = None, 0
            self._world_size, self._rank = _world_and_rank(world_size, rank)
        else:
            if isinstance(communicator, NcclCommunicator):
                handle = communicator.handle
                if handle == 0:
                    raise invalid("communicator: destroyed; expected a live NcclCommunicator")
            elif isinstance(communicator, (int, np.integer)) and not isinstance(communicator, bool):
                handle = int(communicator)
                if handle == 0:
                    raise invalid("communicator: 0 (a null ncclComm_t); expected an initialized communicator")
            else:
                raise invalid(f"communicator: {type(communicator).__name__}; expected an "
                              "attnforge.distributed.NcclCommunicator, an int ncclComm_t, or None")
            comm_world, comm_rank, comm_device = _C.nccl_comm_info(handle)
            for name, given, actual in (("world_size", world_size, comm_world), ("rank", rank, comm_rank)):
                if given is not None and given != actual:
                    raise invalid(f"{name}: {given}; the communicator has {name} {actual}")
            kind, index = device_of(self._float_workspace_buffer)
            if kind == "cuda" and index != comm_device:
                raise invalid(f"communicator: on cuda:{comm_device}; the workspace is on cuda:{index} (one GPU per "
                              "rank: make the communicator on the workspace's device)")
            self._communicator, self._comm_handle = communicator, handle  # the object stays alive with the wrapper
            self._world_size, self._rank = comm_world, comm_rank
        self._gathered = gathered_buffer
        self._layout = self._share = None

    @property
    def world_size(self):
        return self._world_size

    @property
    def rank(self):
        return self._rank

    @property
    def partition(self):
        return self._partition.name

    @property
    def state_layout(self):
        """The RankStateLayout of the current plan (o float32, then lse, per rank)."""
        return self._layout

    @property
    def gathered_buffer(self):
        """The buffer of all ranks' packed states (allocated at plan() beside the workspace unless given)."""
        return self._gathered

    @property
    def rank_page_table(self):
        """This rank's share of the planned batch: (indptr, indices, last_page_len, kv_lens), host int32."""
        return self._share

    def _plan(self, *, kv_format, page_size, num_qo_heads, head_dim_qk, head_dim_vo, q_data_type, o_data_type,
              metadata, options, **kwargs):
        self._planned, self._layout = False, None
        _C.check_context_parallel_options(options, metadata.get("alibi_slopes"), metadata.get("mask"),
                                          self._partition)
        table = {name: metadata.pop(name, None) for name in ("kv_indptr", "kv_indices", "last_page_len",
                                                             "block_table", "seq_lens")}
        self._share = tuple(np.asarray(a, dtype=np.int32) for a in _C.partition_pages(
            table["kv_indptr"], table["kv_indices"], table["last_page_len"], table["block_table"], table["seq_lens"],
            int(page_size), self._world_size, self._rank, self._partition))
        metadata.update(kv_indptr=self._share[0], kv_indices=self._share[1], last_page_len=self._share[2])
        # The rank's partial states stay float32 until the merge; out gets the dtype asked for.
        o_final = data_dtype_name(q_data_type if o_data_type is None else o_data_type, "o_data_type")
        super()._plan(kv_format=_C.KVFormat.paged_csr, page_size=page_size, num_qo_heads=num_qo_heads,
                      head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_data_type=q_data_type,
                      o_data_type="float32", metadata=metadata, options=options, **kwargs)
        self._o_dtype_name = o_final
        self._layout = RankStateLayout(self._impl.total_qo, int(num_qo_heads),
                                       int(head_dim_qk if head_dim_vo is None else head_dim_vo))
        nbytes = gathered_buffer_bytes(self._layout, self._world_size)
        if self._gathered is None or self._gathered.nbytes < nbytes:
            # Planned once for the largest batch, the buffer keeps its address (what a captured CUDA graph holds).
            self._gathered = empty(self._float_workspace_buffer, (nbytes,), "uint8")
        self._planned = True

    def _overrides(self, args, window_left, sm_scale, logits_soft_cap, q_scale, k_scale, v_scale, sinks, enable_pdl):
        if args:
            no_custom_args(args, "run")
        return (sm_scale, window_left, logits_soft_cap, q_scale, k_scale, v_scale, sinks, enable_pdl)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, sm_scale=None, logits_soft_cap=None,
            stream=None):
        """Context-parallel attention of q (all of the batch's queries, on every rank) over this rank's share of
        ``paged_kv_cache``, all-gathered and merged: out [total_qo, num_qo_heads, head_dim_vo] (and lse, log2,
        when return_lse), the same on every rank. Arguments as the single-GPU wrapper's run() (``enable_pdl`` too:
        None or True launches this rank's CUDA decode kernel as a programmatic dependent of the kernel before it);
        per-layer options a split cannot honour are refused. Needs a communicator."""
        if self._comm_handle == 0:
            raise invalid("run: this wrapper has no communicator (made with world_size= and rank=); pass "
                          "communicator= or call run_rank() on every rank and merge() the filled gathered_buffer")
        overrides = self._overrides(args, window_left, sm_scale, logits_soft_cap, q_scale, k_scale, v_scale, sinks,
                                    enable_pdl)
        kv_a, kv_b = paged_kv_cache if type(paged_kv_cache) is tuple else (paged_kv_cache, None)
        if out is None or (lse is None and return_lse):
            out, lse = outputs(q, out, lse, (q.shape[0], self._num_qo_heads, self._head_dim_vo), self._o_dtype_name,
                               return_lse)
        if _torch.tracing():
            _context_parallel_run(self._handle, q, kv_a, kv_b, out, lse, stream, *overrides)
        else:
            self._run_context_parallel(q, kv_a, kv_b, out, lse, stream, *overrides)
        return (out, lse) if return_lse else out

    def run_rank(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, window_left=None,
                 sinks=None, sm_scale=None, logits_soft_cap=None, enable_pdl=None, stream=None):
        """This rank's part alone: its share into its slot of gathered_buffer (no communication). Fill the other
        slots (simulated ranks sharing one buffer, or the caller's own all-gather), then merge()."""
        overrides = self._overrides(args, window_left, sm_scale, logits_soft_cap, q_scale, k_scale, v_scale, sinks,
                                    enable_pdl)
        kv_a, kv_b = paged_kv_cache if type(paged_kv_cache) is tuple else (paged_kv_cache, None)
        self._call(q, kv_a, kv_b, None, None, stream, overrides, 0)

    def merge(self, *, out=None, lse=None, return_lse=False, stream=None):
        """Merges the states of all ranks in gathered_buffer into out (dtype of the plan's o_data_type) and lse."""
        if self._layout is None:
            raise invalid("merge: called before plan(); call plan() first")
        return merge_gathered_states(self._layout, self._gathered, self._world_size, out=out, lse=lse,
                                     return_lse=return_lse, o_data_type=self._o_dtype_name, stream=stream)

    def _call(self, q, kv_a, kv_b, out, lse, stream, overrides, communicator):
        if stream is None:
            stream = current_stream(q, self._device_index) if self._on_cuda else 0
        if self._layout is None:
            raise invalid("run: called before plan(); call plan() first")
        self._impl.run_context_parallel(q, kv_a, kv_b, out, lse, stream, *overrides, self._layout, self._partition,
                                        self._gathered, self._rank, self._world_size, communicator)

    def _run_context_parallel(self, q, kv_a, kv_b, out, lse, stream, *overrides):
        self._call(q, kv_a, kv_b, out, lse, stream, overrides, self._comm_handle)


# Only while torch.compile traces (eager calls and CUDA-graph capture call _run_context_parallel directly).
@operator("context_parallel_run", mutates_args=("out", "lse"))
def _context_parallel_run(handle: int, q: Tensor, kv_a: Tensor, kv_b: Optional[Tensor], out: Tensor,
                          lse: Optional[Tensor], stream: Optional[int], sm_scale: Optional[float],
                          window_left: Optional[int], logits_soft_cap: Optional[float], q_scale: Optional[float],
                          k_scale: Optional[float], v_scale: Optional[float], sinks: Optional[Tensor],
                          enable_pdl: Optional[bool]) -> None:
    _torch.wrapper(handle)._run_context_parallel(q, kv_a, kv_b, out, lse, stream, sm_scale, window_left,
                                                 logits_soft_cap, q_scale, k_scale, v_scale, sinks, enable_pdl)


class ContextParallelBatchDecodeWithPagedKVCacheWrapper(_ContextParallel, BatchDecodeWithPagedKVCacheWrapper):
    """Batch decode with the paged KV cache split over ranks: BatchDecodeWithPagedKVCacheWrapper's plan() (given the
    whole batch's page table, on every rank) and run(), plus run_rank() and merge().

    attnforge additions (keyword-only): ``communicator`` (NcclCommunicator or an int ncclComm_t on the workspace's
    GPU; world_size and rank come from it), or ``world_size`` and ``rank`` without one; ``partition``
    ("round_robin_pages" or "contiguous"); ``gathered_buffer`` (uint8, at least gathered_buffer_bytes(layout,
    world_size) bytes on the workspace's device; default: allocated by plan() beside the workspace and reallocated
    only when a plan needs more). Decode with q_len_per_req > 1 is causal and refused.
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, *, communicator=None,
                 world_size=None, rank=None, partition="round_robin_pages", gathered_buffer=None):
        BatchDecodeWithPagedKVCacheWrapper.__init__(self, float_workspace_buffer, kv_layout, use_cuda_graph)
        self._init_context_parallel(communicator, world_size, rank, partition, gathered_buffer)


class ContextParallelBatchPrefillWithPagedKVCacheWrapper(_ContextParallel, BatchPrefillWithPagedKVCacheWrapper):
    """Batch prefill / append with the paged KV cache split over ranks: BatchPrefillWithPagedKVCacheWrapper's plan()
    (the whole batch's page table, on every rank; causal=False, no custom mask) and run(), plus run_rank() and
    merge(). Keyword-only additions as ContextParallelBatchDecodeWithPagedKVCacheWrapper's."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, *, communicator=None,
                 world_size=None, rank=None, partition="round_robin_pages", gathered_buffer=None):
        BatchPrefillWithPagedKVCacheWrapper.__init__(self, float_workspace_buffer, kv_layout, use_cuda_graph)
        self._init_context_parallel(communicator, world_size, rank, partition, gathered_buffer)


__all__ = ["NcclCommunicator", "nccl_unique_id", "partition_pages", "merge_gathered_states", "gathered_buffer_bytes",
           "RankStateLayout", "KVPartition", "ContextParallelBatchDecodeWithPagedKVCacheWrapper",
           "ContextParallelBatchPrefillWithPagedKVCacheWrapper"]
