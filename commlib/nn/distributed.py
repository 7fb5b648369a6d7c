"""commlib as a ``torch.distributed`` backend: ``init_process_group("commlib")``.

Importing :mod:`commlib.nn` registers the backend ``"commlib"``
(``torch.distributed.Backend.register_backend``, CPU and CUDA tensors): a
Python :class:`torch.distributed.ProcessGroup` whose every collective is one
call of commlib's collective engine (the same algorithms, argument agreement
and recovery as :class:`commlib.Communicator`), so torch's own
``DistributedDataParallel``, FSDP2's ``fully_shard``, ``DeviceMesh``, the
functional collectives and the object collectives run over it unchanged.

Three ways in:

* under ``mpiexec`` or ``srun`` (an MPI job, nothing else set):
  :func:`init_process_group` takes rank and size from MPI
  (``commlib.nn.init_process_group()``, or pass your own communicator:
  ``init_process_group(commlib.init(fault_tolerant=True))``);
* ``torch.distributed.init_process_group("commlib", ...)`` with any of torch's
  init methods (``env://`` as ``torchrun`` sets it, ``tcp://``, ``file://``,
  ``store=``): inside an MPI job whose size and rank match, the group runs on
  MPI; otherwise (``torchrun``) on commlib's TCP transport
  (:class:`commlib.tcp_comm.TCPCommunicator`), the members finding each other
  through torch's store;
* ``dist.new_group(ranks)`` and ``init_device_mesh("cpu", (dp, cp))`` make
  sub-groups: ``MPI_Comm_create_group`` of the members under MPI, a TCP group
  of their own under torchrun.

Semantics:

* dtypes float16, bfloat16, float32, float64, int8/16/32/64, uint8, bool;
  ``ReduceOp`` SUM, AVG (floating types), PRODUCT, MIN, MAX, BAND, BOR, BXOR
  (integers and bool), PREMUL_SUM (the factor applied to each rank's input,
  then SUM).
* Bad calls: ranks that pass different sizes, dtypes or ops, or call
  different collectives, get :class:`commlib.InvalidArgument` (a
  ``RuntimeError`` and ``ValueError``) on every rank, naming the rank and the
  call, before any payload byte moves; the process is not aborted.
* ``timeout``: given to ``init_process_group``, the deadline of every call
  (seconds; commlib's meaning: the whole call), past which it raises
  :class:`commlib.CommTimeout`.  torch's default (30 minutes, when you give
  none) leaves calls unbounded on a communicator that is not fault tolerant
  (MPI's semantics) and bounded by the communicator's own ``timeout`` on a
  fault-tolerant one.
* ``async_op=True`` returns a ``Work`` run by the group's worker thread
  (calls complete in the order they were made; the thread releases the GIL
  while it waits on the network, so DDP's bucket all-reduces overlap the
  backward pass); ``async_op=False`` runs the call in the caller's thread
  when the worker is idle.  A rank bound to a single core (``mpiexec``'s
  default binding at 1-2 ranks a node), or one whose share of the node's
  cores all go to torch's intra-op threads, has no core for that thread: it
  would share a core with the backward pass it is meant to overlap, and
  MPI's busy-polling wait takes turns with it.  There the asynchronous calls
  made inside a backward pass (DDP's and FSDP's gradient buckets) run in the
  calling thread and return a completed ``Work`` (a DDP step of 4.2 M
  parameters at 2 ranks on 2 cores: 1.41-1.51x gloo's steps/s, against
  1.19-1.42x through the thread; ``benchmarks/bench_torch_backend.py``).
  Calls outside a backward pass keep the thread, so an ``isend`` / ``recv``
  the other rank makes before its collective cannot deadlock against it.
  ``COMMLIB_TORCH_ASYNC=thread`` keeps every asynchronous call on the
  thread, ``inline`` runs those of a backward pass in the calling thread
  whatever the cores.  ``wait()`` raises the call's error;
  ``get_future()`` completes with the output tensors.
* Tensors that are not contiguous are copied to a contiguous buffer and the
  result copied back (the right answer, one copy more); CUDA tensors are
  staged through host memory (the result copied back on the tensor's device).
* Fault tolerance: on a communicator from ``commlib.init(fault_tolerant=True)``
  under ULFM, a rank that dies inside a call makes the survivors shrink the
  communicator and raise :class:`commlib.ProcessFailed` (``recovered=True``);
  the process group, whose rank and size torch fixed, is then stale:
  :func:`reinit_process_group` (what :class:`commlib.ResilientRunner`'s
  re-shard callback calls) destroys it and makes a new one over the shrunk
  communicator.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import threading
import weakref
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (AllToAllOptions, AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, BarrierOptions, BroadcastOptions, GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions)

from commlib.core.config import config
from commlib.core.errors import CommTimeout, InvalidArgument, ProcessFailed

from .torch_works import (FAST_DTYPES, FAST_OPS, NUMPY_DTYPES, HostTensor, P2PWaiter, Worker, bits_view, done,
                          needs_scaling, numpy_view, p2p_tag, reduce_op, split_sizes)

__all__ = ["ProcessGroupCommlib", "init_process_group", "reinit_process_group", "communicator_of", "BACKEND"]

#: the backend's name in ``torch.distributed``
BACKEND = "commlib"


#: torch's default process-group timeout: given by torch when the user gave none
_TORCH_DEFAULT = datetime.timedelta(minutes=30)

#: the algorithm a rank that refuses its own arguments names in the engine's first round
_REFUSED = "(refused: see the error on that rank)"

# the communicator the next default group is made over (init_process_group hands it to the creator)
_NEXT = threading.local()


#: the running backward pass's id (-1 outside one); torch has no public name for it
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _inline_backward(comm) -> bool:
    """Whether asynchronous calls made inside a backward pass run in the calling
    thread: ``COMMLIB_TORCH_ASYNC`` is ``inline``, or ``auto`` and this rank has
    no core for the worker thread beside torch's intra-op threads (see the
    module docstring).

    A rank's cores: its CPU affinity when the launcher bound it (fewer CPUs
    than the machine's), else the node's CPUs shared by the ranks on the node
    (the launcher's local size, else ``comm``'s ranks on this node).

    Raises:
        InvalidArgument: ``COMMLIB_TORCH_ASYNC`` is not ``auto``, ``inline`` or ``thread``.
    """
    mode = config.torch_async
    if mode not in ("auto", "inline", "thread"):
        raise InvalidArgument(f"COMMLIB_TORCH_ASYNC={mode!r}: expected auto, inline or thread", rank=comm.rank,
                              op="init_process_group")
    if mode != "auto":
        return mode == "inline"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus >= (os.cpu_count() or 1):  # not bound: the node's CPUs, shared
        cpus /= _local_ranks(comm)
    return cpus < torch.get_num_threads() + 1


def _local_ranks(comm) -> int:
    """Processes of this job on this node: the launcher's local size
    (``torchrun``, Open MPI, MPICH), else ``comm``'s ranks on this node."""
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, len(getattr(getattr(comm, "transport", None), "node_peers", ()) or ()))


# ------------------------------------------------------------------ the group
class ProcessGroupCommlib(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a commlib communicator.

    Made by ``torch.distributed.init_process_group("commlib")`` /
    ``new_group`` (or :func:`init_process_group`); users rarely construct it.

    Args:
        comm: a :class:`commlib.Communicator` (MPI) or
            :class:`commlib.tcp_comm.TCPCommunicator` (TCP); its rank and size
            are the group's.
        timeout: the deadline of every call in seconds, or None (the
            communicator's default: unbounded, or its fault-tolerant timeout).

    Attributes:
        comm: the communicator (``comm.mpi_comm`` for mpi4py code on MPI).
    """

    def __init__(self, comm, timeout: float | None = None):
        inline = _inline_backward(comm)  # refuses a bad COMMLIB_TORCH_ASYNC before anything is made
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.timeout = timeout
        self._done = done([])  # what a synchronous call returns (torch only waits on it)
        self._worker = Worker(f"commlib-torch-{comm.rank}")
        self._inline_backward = inline
        self._p2p = P2PWaiter()
        _GROUPS.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        """The backend's name (a method, as on torch's own groups)."""
        return BACKEND

    # torch names a group through its backends; a Python group keeps the name itself
    _name = _desc = None

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:
        if self._name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc if self._desc is not None else "undefined"

    def __repr__(self) -> str:
        return f"<ProcessGroupCommlib rank={self.rank()} size={self.size()} over {self.comm!r}>"

    # -- running a call ----------------------------------------------------
    def _run(self, fn, result, opts) -> dist.Work:
        """Run ``fn()`` (which fills the output tensors) now in this thread when the
        call is synchronous and the worker idle, else on the worker; the work's
        future completes with ``result``.

        A process failure or timeout (on the worker or here) breaks the group:
        every later call raises that error at once, before anything moves, until
        :func:`reinit_process_group` replaces the group."""
        if self._broken is not None:
            raise self._broken
        if not getattr(opts, "asyncOp", True) and self._worker.idle():
            with self._worker.running:
                try:
                    fn()
                except (ProcessFailed, CommTimeout) as exc:
                    self._broken = exc
                    raise
            return done(result)
        if self._inline_backward and self._worker.idle() and _graph_task_id() >= 0:
            with self._worker.running:  # asynchronous, inside a backward pass, one core: here (module docstring)
                return self._worker.run_here(fn, result, self._failed)
        def guarded():  # a call queued behind the one that failed does not run on the shrunk communicator
            if self._broken is not None:
                raise self._broken
            fn()
        return self._worker.submit(guarded, result, self._failed)

    #: the failure that broke the group (see :meth:`_run`)
    _broken = None

    def _failed(self, exc) -> None:
        if isinstance(exc, (ProcessFailed, CommTimeout)):
            self._broken = exc

    @contextlib.contextmanager
    def _refusing(self, kind: str, root: int = 0):
        """Checks of this rank's arguments inside: an :class:`InvalidArgument` they
        raise still takes this rank through the engine's first round of ``kind``
        (with an algorithm no rank accepts), so that every other rank raises
        :class:`InvalidArgument` naming this one, before any payload moves,
        instead of waiting for it; this rank raises its own error."""
        try:
            yield
        except InvalidArgument:
            comm, z = self.comm, np.zeros(max(1, self.comm.size), np.uint8)
            call = {"allreduce": lambda: comm.allreduce(z[:1], algorithm=_REFUSED, timeout=self.timeout),
                    "bcast": lambda: comm.bcast(z[:1], root=root, algorithm=_REFUSED, timeout=self.timeout),
                    "allgather": lambda: comm.allgather(z[:1], algorithm=_REFUSED, timeout=self.timeout),
                    "reduce_scatter": lambda: comm.reduce_scatter(z, algorithm=_REFUSED, timeout=self.timeout)}
            try:
                call[kind]()
            except InvalidArgument:
                pass
            raise

    def _host(self, t, op, load=True) -> HostTensor:
        return HostTensor(t, self.comm.rank, op, load)

    # -- all-reduce ----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = AllreduceOptions() if opts is None else opts
        if len(tensors) == 1 and not opts.asyncOp and self._broken is None and self._worker.idle():
            # the hot path (dist.all_reduce of one CPU tensor, synchronous): no closure, no future
            t = tensors[0]
            name = FAST_OPS.get(getattr(opts.reduceOp, "op", None))
            if name is not None and t.device.type == "cpu" and t.dtype in FAST_DTYPES and t.is_contiguous():
                comm = self.comm
                with self._worker.running:
                    try:
                        comm.allreduce(t.detach().numpy().reshape(-1), op=name, timeout=self.timeout)
                    except (ProcessFailed, CommTimeout) as exc:
                        self._broken = exc
                        raise
                return self._done
        return self._allreduce(list(tensors), opts, "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = AllreduceCoalescedOptions() if opts is None else opts
        return self._allreduce(list(tensors), opts, "all_reduce_coalesced")

    def _allreduce(self, tensors, opts, opname):
        comm, timeout = self.comm, self.timeout
        op = opts.reduceOp

        def fn():
            for t in tensors:
                with self._refusing("allreduce"):
                    name, factor = reduce_op(op, t.dtype, comm.rank, opname)
                    h = self._host(t, opname)
                if factor is not None:
                    h.h.mul_(factor)
                comm.allreduce(h.array, op=name, timeout=timeout)
                h.back()
        return self._run(fn, tensors, opts)

    # -- broadcast -------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = BroadcastOptions() if opts is None else opts
        tensors, comm, timeout, root = list(tensors), self.comm, self.timeout, opts.rootRank

        def fn():
            for t in tensors:
                with self._refusing("bcast", root):
                    h = self._host(t, "broadcast")
                comm.bcast(h.array, root=root, timeout=timeout)
                h.back()
        return self._run(fn, tensors, opts)

    # -- all-gather ------------------------------------------------------------
    def allgather(self, output_lists, inputs, opts=None):
        opts = AllgatherOptions() if opts is None else opts
        comm, timeout = self.comm, self.timeout
        output_lists, inputs = [list(o) for o in output_lists], list(inputs)

        def fn():
            for outs, t in zip(output_lists, inputs):
                with self._refusing("allgather"):
                    self._check_list(outs, t, "all_gather")
                    h = self._host(t, "all_gather")
                gathered = comm.allgather(h.array, timeout=timeout)
                with torch.no_grad():
                    for r, o in enumerate(outs):
                        o.copy_(torch.from_numpy(bits_view(gathered[r])).view(t.dtype).view(o.shape))
        return self._run(fn, output_lists, opts)

    allgather_coalesced = allgather

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's name
        opts = AllgatherOptions() if opts is None else opts
        return self._gather_into([output], [input], opts, "all_gather_into_tensor")

    def all_gather_single(self, output, input, opts=None):  # noqa: A002
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = AllgatherOptions() if opts is None else opts
        return self._gather_into(list(outputs), list(inputs), opts, "all_gather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _gather_into(self, outputs, inputs, opts, opname):
        comm, timeout = self.comm, self.timeout

        def fn():
            for o, t in zip(outputs, inputs):
                with self._refusing("allgather"):
                    if o.numel() != t.numel() * comm.size or o.dtype != t.dtype:
                        raise InvalidArgument(f"output of {o.numel()} {o.dtype} for {comm.size} ranks of "
                                              f"{t.numel()} {t.dtype}", rank=comm.rank, op=opname)
                    h, ho = self._host(t, opname), self._host(o, opname, load=False)
                comm.allgather(h.array, ho.array, timeout=timeout)
                ho.back()
        return self._run(fn, outputs, opts)

    def _check_list(self, outs, t, opname):
        if len(outs) != self.comm.size or any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
            raise InvalidArgument(f"needs {self.comm.size} output tensors of {t.numel()} {t.dtype}, got "
                                  f"{[(o.numel(), str(o.dtype)) for o in outs]}", rank=self.comm.rank, op=opname)

    # -- reduce-scatter --------------------------------------------------------
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = ReduceScatterOptions() if opts is None else opts
        outputs, input_lists = list(outputs), [list(i) for i in input_lists]

        def flat():
            for o, ins in zip(outputs, input_lists):
                self._check_list(ins, o, "reduce_scatter")
        return self._reduce_scatter(outputs, input_lists, opts, "reduce_scatter", flat)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        opts = ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter(list(outputs), list(inputs), opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatter(self, outputs, inputs, opts, opname, check=None):
        comm, timeout, op = self.comm, self.timeout, opts.reduceOp

        def fn():
            if check is not None:
                with self._refusing("reduce_scatter"):
                    check()
            for o, t in zip(outputs, inputs):
                with self._refusing("reduce_scatter"):
                    h, name, factor, ho = self._scatter_args(o, t, op, opname)
                if factor is not None:
                    h.h.mul_(factor)
                comm.reduce_scatter(h.array, ho.array, op=name, timeout=timeout)
                ho.back()
        return self._run(fn, outputs, opts)

    def _scatter_args(self, o, t, op, opname):
        """(input stand-in, op name, PREMUL_SUM factor, output stand-in) of one reduce-scatter."""
        comm = self.comm
        if isinstance(t, list):  # reduce_scatter's list: one tensor per rank, concatenated
            h = HostTensor(torch.cat([x.detach().to("cpu").reshape(-1) for x in t]), comm.rank, opname)
        else:
            if t.numel() != o.numel() * comm.size or o.dtype != t.dtype:
                raise InvalidArgument(f"input of {t.numel()} {t.dtype} for {comm.size} ranks' outputs of "
                                      f"{o.numel()} {o.dtype}", rank=comm.rank, op=opname)
            h = self._host(t, opname)
            if h.h is t and needs_scaling(op):  # the engine only reads the input, but PREMUL_SUM scales it
                h = HostTensor(t.clone(), comm.rank, opname)
        name, factor = reduce_op(op, o.dtype, comm.rank, opname)
        return h, name, factor, self._host(o, opname, load=False)

    # -- all-to-all ------------------------------------------------------------
    def alltoall(self, outputs, inputs, opts=None):
        opts = AllToAllOptions() if opts is None else opts
        outputs, inputs = list(outputs), list(inputs)

        def fn():
            self._alltoallv([x.detach().to("cpu").reshape(-1) for x in inputs], outputs, "all_to_all")
        return self._run(fn, outputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        opts = AllToAllOptions() if opts is None else opts
        comm = self.comm

        def fn():
            n, problem = comm.size, None
            try:
                ins = split_sizes(input, input_split_sizes, n, comm.rank, "all_to_all_single", "input")
                outs = split_sizes(output, output_split_sizes, n, comm.rank, "all_to_all_single", "output")
            except InvalidArgument as exc:  # refused in the count agreement, so the other ranks raise too
                ins, outs, problem = [], [], exc.detail
            self._alltoallv([x.detach().to("cpu").reshape(-1) for x in ins], outs, "all_to_all_single", problem)
        return self._run(fn, [output], opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def _alltoallv(self, ins, outs, opname, problem=None):
        """All-to-all of ``ins[j]`` (to rank j) into ``outs[i]`` (from rank i), any sizes.

        The ranks first agree on every send and receive count (one all-gather
        of ``2 * size`` integers), so counts that do not match raise
        :class:`InvalidArgument` on every rank before any payload moves; the
        blocks then travel padded to the largest in one all-to-all."""
        comm, n, timeout = self.comm, self.comm.size, self.timeout
        if problem is None and (len(ins) != n or len(outs) != n):
            problem = f"needs {n} input and output tensors, got {len(ins)} and {len(outs)}"
        if problem is None and len({x.dtype for x in ins} | {o.dtype for o in outs}) != 1:
            problem = f"mixed dtypes {sorted({str(x.dtype) for x in [*ins, *outs]})}"
        dtype = outs[0].dtype if outs else torch.float32
        if problem is None and dtype not in NUMPY_DTYPES:
            problem = f"dtype {dtype} is not supported"
        counts = np.array([x.numel() for x in ins] + [o.numel() for o in outs], np.int64) \
            if problem is None else np.full(2 * n, -1, np.int64)
        table = comm.allgather(counts, timeout=timeout).reshape(n, 2, n)  # [rank, send/recv, peer]
        bad = [r for r in range(n) if table[r, 0, 0] < 0]
        if problem is not None:
            raise InvalidArgument(problem, rank=comm.rank, op=opname)
        if bad:
            raise InvalidArgument(f"rank(s) {bad} passed bad arguments", rank=comm.rank, op=opname)
        wrong = [(i, j) for i in range(n) for j in range(n) if table[i, 0, j] != table[j, 1, i]]
        if wrong:
            i, j = wrong[0]
            raise InvalidArgument(f"rank {i} sends {table[i, 0, j]} elements to rank {j}, which expects "
                                  f"{table[j, 1, i]} ({len(wrong)} pair(s) differ)", rank=comm.rank, op=opname)
        m = int(table[:, 0, :].max()) if n else 0
        send = torch.zeros((n, max(m, 1)), dtype=dtype)
        for j, x in enumerate(ins):
            send[j, :x.numel()] = x
        recv = torch.empty_like(send)
        comm.alltoall(numpy_view(send).reshape(-1), numpy_view(recv).reshape(-1), timeout=timeout)
        with torch.no_grad():
            for i, o in enumerate(outs):
                o.copy_(recv[i, :o.numel()].view(o.shape))

    # -- rooted collectives ----------------------------------------------------
    def reduce(self, tensors, opts=None):
        opts = ReduceOptions() if opts is None else opts
        tensors, comm, timeout, root, op = list(tensors), self.comm, self.timeout, opts.rootRank, opts.reduceOp

        def fn():
            for t in tensors:
                with self._refusing("allreduce"):
                    name, factor = reduce_op(op, t.dtype, comm.rank, "reduce")
                    h = HostTensor(t.detach().to("cpu").clone(), comm.rank, "reduce")
                if factor is not None:
                    h.h.mul_(factor)
                comm.allreduce(h.array, op=name, timeout=timeout)  # every rank agrees; the root keeps it
                if comm.rank == root:
                    with torch.no_grad():
                        t.copy_(h.h)
        return self._run(fn, tensors, opts)

    def gather(self, output_lists, inputs, opts=None):
        opts = GatherOptions() if opts is None else opts
        output_lists, inputs = [list(o) for o in output_lists], list(inputs)
        comm, timeout, root = self.comm, self.timeout, opts.rootRank

        def fn():
            for i, t in enumerate(inputs):
                outs = output_lists[i] if output_lists else []
                with self._refusing("allgather"):
                    if comm.rank == root:
                        self._check_list(outs, t, "gather")
                    h = self._host(t, "gather")
                gathered = comm.allgather(h.array, timeout=timeout)
                if comm.rank == root:
                    with torch.no_grad():
                        for r, o in enumerate(outs):
                            o.copy_(torch.from_numpy(bits_view(gathered[r])).view(t.dtype).view(o.shape))
        return self._run(fn, output_lists, opts)

    def scatter(self, outputs, input_lists, opts=None):
        opts = ScatterOptions() if opts is None else opts
        outputs, input_lists = list(outputs), [list(i) for i in input_lists]
        comm, timeout, root = self.comm, self.timeout, opts.rootRank

        def fn():
            for k, o in enumerate(outputs):
                with self._refusing("bcast", root):
                    if comm.rank == root:
                        ins = input_lists[k]
                        self._check_list(ins, o, "scatter")
                        full = torch.cat([x.detach().to("cpu").reshape(-1) for x in ins])
                    else:
                        full = torch.empty(o.numel() * comm.size, dtype=o.dtype)
                    h = HostTensor(full, comm.rank, "scatter")
                comm.bcast(h.array, root=root, timeout=timeout)
                with torch.no_grad():
                    o.copy_(full[comm.rank * o.numel():(comm.rank + 1) * o.numel()].view(o.shape))
        return self._run(fn, outputs, opts)

    def barrier(self, opts=None):
        opts = BarrierOptions() if opts is None else opts
        comm, timeout = self.comm, self.timeout
        return self._run(lambda: comm.barrier(timeout=timeout), [], opts)

    # -- point to point --------------------------------------------------------
    def send(self, tensors, dst: int, tag: int):
        t = tensors[0]
        h = self._host(t, "send")
        if self._broken is not None:
            raise self._broken
        req = self.comm.transport.isend(h.array, dst, p2p_tag(tag))
        return self._p2p.add(req, list(tensors))

    def recv(self, tensors, src: int, tag: int):
        t = tensors[0]
        h = self._host(t, "recv", load=False)
        if self._broken is not None:
            raise self._broken
        req = self.comm.transport.irecv(h.array, src, p2p_tag(tag))
        return self._p2p.add(req, list(tensors), h.back)

    # -- life ----------------------------------------------------------------
    def shutdown(self) -> None:
        """End the group's threads (the communicator stays the caller's)."""
        self._worker.stop()
        self._p2p.stop()


# ------------------------------------------------------------------ creation
def _timeout_seconds(timeout) -> float | None:
    if timeout is None or timeout == _TORCH_DEFAULT:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _mpi_launched() -> bool:
    """True in a process started by an MPI launcher (mpiexec, srun with PMI/PMIx)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK",
                                         "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD"))


_WORLD = None  # the MPI world communicator the backend made (one per process)


def _mpi_world():
    global _WORLD
    if _WORLD is None:
        from commlib.communicator import init  # noqa: PLC0415 - loads MPI only for an MPI job

        _WORLD = init()
    return _WORLD


def _create(dist_opts, backend_opts):
    """torch's creator of a ``"commlib"`` process group (the extended API)."""
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    timeout = _timeout_seconds(dist_opts.timeout)
    members = list(dist_opts.global_ranks_in_group or [])
    comm = getattr(_NEXT, "comm", None)
    if comm is not None and not members:  # the default group over the communicator init_process_group got
        _NEXT.comm = None
    elif not members:  # the default group, made by torch's own init_process_group
        comm = _default_comm(store, rank, size, timeout)
    else:
        default = dist.distributed_c10d._get_default_group()
        if timeout is None and isinstance(default, ProcessGroupCommlib):
            timeout = default.timeout  # a sub-group given no timeout of its own keeps the job's
        comm = _sub_comm(store, rank, size, members, dist_opts.group_id, timeout)
    if (comm.rank, comm.size) != (rank, size):
        raise InvalidArgument(f"torch gave rank {rank} of {size} but the communicator is rank {comm.rank} of "
                              f"{comm.size}", rank=comm.rank, op="init_process_group")
    return ProcessGroupCommlib(comm, timeout)


def _default_comm(store, rank, size, timeout):
    if _mpi_launched():
        world = _mpi_world()
        if world.size == size:
            return world
    from commlib.tcp_comm import TCPCommunicator  # noqa: PLC0415 - torchrun: no MPI

    return TCPCommunicator.from_store(store, rank, size, timeout=timeout)


def _sub_comm(store, rank, size, members, group_id, timeout):
    default = dist.distributed_c10d._get_default_group()
    parent = default.comm if isinstance(default, ProcessGroupCommlib) else None
    if parent is not None and hasattr(parent, "create_group"):
        return parent.create_group(members, tag=zlib.crc32(str(group_id).encode()) & 0x7FFF)
    from commlib.tcp_comm import TCPCommunicator  # noqa: PLC0415

    return TCPCommunicator.from_store(store, rank, size, timeout=timeout)


def communicator_of(group=None):
    """The commlib communicator under a ``"commlib"`` process group (default: the default group).

    Raises:
        InvalidArgument: the group is not a ``"commlib"`` one.
    """
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroupCommlib):
        raise InvalidArgument(f"{pg!r} is not a commlib process group", op="communicator_of")
    return pg.comm


def init_process_group(comm=None, *, timeout: float | datetime.timedelta | None = None) -> ProcessGroupCommlib:
    """Start ``torch.distributed`` on commlib under an MPI launch (``mpiexec``, ``srun``).

    Rank and size come from the communicator; no ``MASTER_ADDR``, store or
    environment variable is needed: rank 0 serves torch's ``TCPStore`` on a
    free port and tells the others over the communicator (the commlib group
    never uses the store; torch does, for groups of other backends made
    beside it and for its own barriers).

    Args:
        comm: the :class:`commlib.Communicator` to run over (default:
            ``commlib.init()`` over ``MPI.COMM_WORLD``); e.g.
            ``commlib.init(fault_tolerant=True)`` for a group that survives a
            dead rank under ULFM.
        timeout: the deadline of every call, seconds (or a ``timedelta``);
            None: the communicator's own (unbounded, or its fault-tolerant
            ``timeout``).

    Returns:
        The default process group (``torch.distributed.group.WORLD``).

    Raises:
        InvalidArgument: torch.distributed is already initialized.
    """
    if dist.is_initialized():
        raise InvalidArgument("torch.distributed is already initialized (destroy_process_group() first)",
                              op="init_process_group")
    comm = _mpi_world() if comm is None else comm
    seconds = _timeout_seconds(timeout)
    store = _store_over(comm, seconds)
    _NEXT.comm = comm
    try:
        dist.init_process_group(BACKEND, store=store, rank=comm.rank, world_size=comm.size,
                                timeout=datetime.timedelta(seconds=seconds) if seconds is not None else None)
    finally:
        _NEXT.comm = None
    return dist.distributed_c10d._get_default_group()


def _store_over(comm, seconds):
    """A ``TCPStore`` served by rank 0 of ``comm``, its address broadcast over ``comm``.

    The commlib group never uses it; torch does for groups of other backends
    made beside it (``new_group(backend="gloo")``) and for its own barriers."""
    if comm.size == 1:
        return dist.HashStore()
    wait = datetime.timedelta(seconds=seconds if seconds is not None else 300)
    addr = np.zeros(264, np.uint8)  # [port (8 bytes), host name (up to 256 bytes)]
    server = None
    if comm.rank == 0:
        name = socket.gethostname()
        server = dist.TCPStore(name, 0, comm.size, is_master=True, timeout=wait, wait_for_workers=False)
        host = name.encode()[:256]
        addr[:8] = np.frombuffer(int(server.port).to_bytes(8, "little"), np.uint8)
        addr[8:8 + len(host)] = np.frombuffer(host, np.uint8)
    comm.bcast(addr, root=0)
    if server is not None:
        return server
    port = int.from_bytes(addr[:8].tobytes(), "little")
    host = addr[8:].tobytes().rstrip(b"\0").decode()
    return dist.TCPStore(host, port, comm.size, is_master=False, timeout=wait)


def reinit_process_group(comm=None, *, timeout=None) -> ProcessGroupCommlib:
    """Replace the default process group by one over ``comm`` (default: the
    current group's communicator, e.g. after it shrank past a dead rank).

    torch fixes a group's rank and size when it is made; after a fault-tolerant
    communicator shrank, call this on every survivor (and rebuild what holds
    the old group, such as a ``DistributedDataParallel`` wrapper) before the
    next call.  Starts the group when there is none yet (as :func:`init_process_group`).
    """
    if comm is None:
        comm = communicator_of()
    if not dist.is_initialized():
        return init_process_group(comm, timeout=timeout)
    if timeout is None:
        pg = dist.distributed_c10d._get_default_group()
        timeout = getattr(pg, "timeout", None)
    dist.destroy_process_group()
    return init_process_group(comm, timeout=timeout)


#: live groups, whose threads are ended before the interpreter shuts down (a daemon
#: thread still inside torch's C++ code then aborts the process)
_GROUPS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for pg in list(_GROUPS):
        pg.shutdown()


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


_register()
