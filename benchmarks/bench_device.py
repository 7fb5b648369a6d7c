"""GPU benchmark of commlib on CuPy arrays, each figure beside a baseline
measured in the same run (issue 11, point 7).

Groups (``--cases``; all by default):

* ``pack``: ``Packer(Subarray(...), field).pack()`` (commlib's device kernels)
  of 3-D halo faces (float64, width 3) of 256^3 and 512^3 fields (x-face
  ``f[:3]``: one contiguous run; y-face ``f[:, :3]``: runs of 3 rows; z-face
  ``f[:, :, :3]``: runs of 24 B) and of column blocks of an 8192x8192 float64
  array (blocks of 8 B .. 16 KiB per row), against ``cupy.ascontiguousarray``
  of the same view and against a device memcpy of the packed byte count.
  Also a per-call host-cost row: one ``Packer.pack()`` of a 1.5 MiB face,
  host clock with a device synchronize, against an empty CuPy ``RawKernel``
  launch timed the same way (microseconds).
* ``unpack``: the same cases, ``Packer.unpack(packed)`` against CuPy's
  ``view[...] = packed.reshape(view.shape)`` and against memcpy.
* ``halo``: ``HaloExchange(cart, (n, n, n), width=3, corners=False)`` on CuPy
  fields, 2 ranks split along the last axis (Cartesian dims (1, 1, 2), that
  axis periodic, so every rank sends and receives two z-faces), n = 64 and
  256, against CuPy + mpi4py (per face: ``cupy.ascontiguousarray(face).get()``,
  ``MPI.Sendrecv``, ``ghost[...] = cupy.asarray(recvbuf)``).  Needs 2 ranks.
* ``heat``: ``commlib.apps.heat.solve(..., backend="cuda")`` on 1 rank at
  256^3 and 384^3, GLUPS against the memory roofline (device-to-device copy
  bandwidth of the solver's padded field, bytes read + written, measured in
  this run; roofline GLUPS = bandwidth / 16 B) and against a plain CuPy slice
  expression FTCS step (``cupy_slice_step`` from commlib.apps when it exists,
  else this file's own); ``backend="cupy"`` too when the solver has it.
* ``allreduce``: ``comm.allreduce(sendbuf, recvbuf)`` on CuPy float32 buffers
  of 1, 16 and 64 MiB against ``a.get()`` + ``MPI.COMM_WORLD.Allreduce`` +
  ``b.set()``.  Needs 2 ranks.

Ratios are baseline time / commlib time (> 1: commlib faster), except the
heat rows (commlib GLUPS / roofline GLUPS, commlib GLUPS / CuPy GLUPS).
GB/s in the pack and unpack rows counts packed bytes per second.  Device
work (pack, unpack, heat, copies) is timed with CUDA events after warm-up,
median of ``--repeat`` trials; reads rotate over enough distinct faces or
blocks that each trial touches at least twice the L2 cache (>= 2 x 50 MB),
so the figures are DRAM figures.  Halo and allreduce are timed by host clock
(device synchronized), median of trials, max over ranks.  Every case checks
its result against the baseline's (MISMATCH when they differ); a case that
raises prints ``ERROR: <message>`` and the run goes on.

Targets: pack/unpack >= 1.0x CuPy on every case, >= 0.7x memcpy where >= 8 MiB
are packed in blocks >= 256 B; halo >= 1.5x; heat 384^3 >= 50% of roofline
and >= 3x CuPy slice.  Each printed PASS or MISS.

Needs CuPy and a GPU (exits with status 2 otherwise); ``NUMBA_ENABLE_CUDASIM``
must be unset.  Run from the repository root::

    python -P benchmarks/bench_device.py --json device.json --plot device.png
    mpiexec -n 2 python -P benchmarks/bench_device.py --json device2.json --plot device2.png
    mpiexec -n 2 python -P benchmarks/bench_device.py --cases halo allreduce --quick

Under ``mpiexec -n 2`` the single-GPU groups (pack, unpack, heat) run on rank 0
while rank 1 waits; on 1 rank the halo and allreduce rows say they need 2.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

GROUPS = ("pack", "unpack", "halo", "heat", "allreduce")
L2_FLOOR = 50 * 10**6  # bytes; the H100's L2 (read from the device when larger)
MiB = 1 << 20
W = 3  # halo width (cells)


# ---------------------------------------------------------------- helpers
def one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


class Table:
    """Rows of (group, case, quantity, value, target, status, detail); printed
    on rank 0 as they come, kept for the JSON and the plot."""

    def __init__(self, printing: bool):
        self.rows: list[dict] = []
        self.printing = printing
        self._header_done = False

    def header(self):
        if self.printing and not self._header_done:
            print(f"{'group':<9} {'case':<24} {'quantity':<22} {'value':>9} {'target':>8} {'result':<8} detail")
            print("-" * 120)
            self._header_done = True

    def add(self, group, case, quantity, value=None, target=None, op=">=", detail="", status=None, unit="x"):
        if status is None:
            if value is None or not math.isfinite(value):
                status = "ERROR"
            elif target is None:
                status = "-"
            else:
                status = "PASS" if value >= target else "MISS"
        row = {"group": group, "case": case, "quantity": quantity, "value": value, "unit": unit,
               "target": target, "status": status, "detail": detail}
        self.rows.append(row)
        if self.printing:
            self.header()
            v = "" if value is None else (f"{value:8.2f}{unit}" if unit == "x" else f"{value:.4g}{unit}")
            t = "" if target is None else f"{op}{target:g}{unit if unit == 'x' else ''}"
            print(f"{group:<9} {case:<24} {quantity:<22} {v:>9} {t:>8} {status:<8} {detail}", flush=True)
        return row

    def error(self, group, case, exc_or_msg):
        msg = exc_or_msg if isinstance(exc_or_msg, str) else one_line(exc_or_msg)
        return self.add(group, case, "ERROR", None, status="ERROR", detail=f"ERROR: {msg}", unit="")

    def note(self, group, case, text):
        return self.add(group, case, "note", None, status="-", detail=text, unit="")


class Bench:
    def __init__(self, args, cp, MPI, commlib, comm, table):
        self.args, self.cp, self.MPI, self.commlib, self.comm, self.t = args, cp, MPI, commlib, comm, table
        self.rank, self.size = comm.rank, comm.size
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.l2 = max(int(props.get("l2CacheSize", 0)), L2_FLOOR)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.rot_bytes = 2 * self.l2  # bytes read per trial, at least
        self.records: list[dict] = []

    # -- timing
    def sync(self):
        self.cp.cuda.Device().synchronize()

    def gpu_time(self, fns, repeat=None, warmup=None):
        """Median seconds per call of the callables ``fns`` (called in turn, one
        trial = one pass over all of them), by CUDA events around the trial;
        the device is synchronized before the stop event, so work on any
        stream (numba's included) counts."""
        cp = self.cp
        repeat = repeat or self.args.repeat
        warmup = self.args.warmup if warmup is None else warmup
        for _ in range(warmup):
            for f in fns:
                f()
        self.sync()
        times = []
        for _ in range(repeat):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for f in fns:
                f()
            self.sync()
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / len(fns))
        return statistics.median(times)

    def host_time_sync(self, fn, repeat):
        """Median host-clock seconds of ``fn(); device synchronize``."""
        for _ in range(max(3, self.args.warmup)):
            fn()
            self.sync()
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def mpi_time(self, fn, repeat, number=1):
        """Median over trials of the host-clock seconds per call (device
        synchronized at the end of each trial), max over ranks."""
        mpi = self.comm.mpi_comm
        for _ in range(max(2, self.args.warmup)):
            fn()
        self.sync()
        ts = []
        for _ in range(repeat):
            mpi.Barrier()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            self.sync()
            ts.append((time.perf_counter() - t0) / number)
        return mpi.allreduce(statistics.median(ts), op=self.MPI.MAX)

    def rotations(self, nbytes, positions):
        """How many distinct regions to rotate over so a trial reads >= 2 x L2."""
        return max(1, min(positions, -(-self.rot_bytes // max(nbytes, 1))))

    # -- pack / unpack cases
    def cases(self):
        """``(name, array shape, [(Subarray, view index), ...] to rotate over, block bytes)``.

        Positions are spaced so no two share a 32-B sector (the unit DRAM is
        read in), and there are enough of them that one trial touches >= 2 x L2
        (touched bytes: blocks x block length rounded up to 32 B)."""
        from commlib.datatypes import Subarray

        def touched(nblocks, block):
            return nblocks * (-(-block // 32) * 32)

        out = []
        for n in (256, 512):
            shape = (n, n, n)
            face = W * n * n * 8
            for axis, label in ((0, "x"), (1, "y"), (2, "z")):
                step = W if axis < 2 else 4  # z: every face in its own 32-B sector of each row
                starts = list(range(0, n - W + 1, step))
                block = face if axis == 0 else (W * n * 8 if axis == 1 else W * 8)
                r = self.rotations(touched(face // block, block), len(starts))
                regs = []
                for k in starts[:r]:
                    sub = [n, n, n]
                    sub[axis] = W
                    st = [0, 0, 0]
                    st[axis] = k
                    idx = tuple(slice(s0, s0 + c) for s0, c in zip(st, sub))
                    regs.append((Subarray(shape, sub, st, "float64"), idx))
                out.append((f"{n}^3 {label}-face", shape, regs, block))
        rows_ = 8192
        for w in (1, 8, 32, 256, 2048):
            shape = (rows_, rows_)
            step = max(w, 4)
            starts = list(range(0, rows_ - w + 1, step))
            r = self.rotations(touched(rows_, w * 8), len(starts))
            regs = [(Subarray(shape, (rows_, w), (0, c), "float64"), (slice(None), slice(c, c + w)))
                    for c in starts[:r]]
            out.append((f"8192^2 cols {_bytes(w * 8)}", shape, regs, w * 8))
        return out

    def run_pack(self, op):
        cp = self.cp
        from commlib.datatypes import Packer

        group = op
        arrays: dict = {}
        for name, shape, regs, block in self.cases():
            try:
                a = arrays.get(shape)
                if a is None:
                    arrays.clear()
                    cp.get_default_memory_pool().free_all_blocks()
                    a = arrays[shape] = cp.random.random(shape, dtype=cp.float64)
                nb = regs[0][0].size
                r = len(regs)
                out = cp.empty(nb, cp.uint8)
                # memcpy baseline: rotate over enough contiguous chunks of nb bytes to read >= 2 x L2
                rm = self.rotations(nb, 1 << 30)
                src = cp.empty(rm * nb, cp.uint8)
                src[:] = 1
                chunks = [src[i * nb:(i + 1) * nb] for i in range(rm)]
                views = [a[idx] for _, idx in regs]
                if op == "pack":
                    packers = [Packer(t, a, out=out) for t, _ in regs]
                    # correctness: the packed bytes equal cupy.ascontiguousarray's
                    got = cp.asarray(packers[-1].pack())
                    want = cp.ascontiguousarray(views[-1]).view(cp.uint8).reshape(-1)
                    ok = bool(cp.array_equal(got, want))
                    t_ours = self.gpu_time([p.pack for p in packers])
                    # ascontiguousarray returns a contiguous view itself (the x-faces): copy those
                    t_cupy = self.gpu_time([(lambda v=v: cp.ascontiguousarray(v)) if not v.flags.c_contiguous
                                            else v.copy for v in views])
                    base_name = "cupy.ascontiguousarray (view.copy() when already contiguous)"
                else:
                    # packed sources for every position: rotated reads of packed bytes
                    packed = cp.random.random(r * nb // 8, dtype=cp.float64).view(cp.uint8)
                    pk = [packed[i * nb:(i + 1) * nb] for i in range(r)]
                    packers = [Packer(t, a, out=out) for t, _ in regs]
                    packers[0].unpack(pk[0])
                    ok = bool(cp.array_equal(views[0], pk[0].view(cp.float64).reshape(views[0].shape)))
                    t_ours = self.gpu_time([(lambda p=p, s=s: p.unpack(s)) for p, s in zip(packers, pk)])

                    def cupy_unpack(v, s):
                        v[...] = s.view(cp.float64).reshape(v.shape)

                    t_cupy = self.gpu_time([(lambda v=v, s=s: cupy_unpack(v, s)) for v, s in zip(views, pk)])
                    base_name = "view[...] = packed"
                # the device memcpy: cudaMemcpyAsync device-to-device of the packed byte count
                # (the least host overhead per call of any copy; below a few MiB the
                # launch, not the bandwidth, bounds it, so small-case ratios above 1 are
                # launch-time ratios and carry no target)
                t_copy = self.gpu_time([(lambda c=c: cp.cuda.runtime.memcpyAsync(
                    out.data.ptr, c.data.ptr, nb, 3, cp.cuda.get_current_stream().ptr)) for c in chunks])
                gb = lambda t: nb / t / 1e9  # noqa: E731
                check = "bytes equal" if ok else "MISMATCH"
                detail = (f"{_bytes(nb)} packed, blocks {_bytes(block)}, {r} rotations; GB/s of packed bytes: "
                          f"commlib {gb(t_ours):.0f}, cupy {gb(t_cupy):.0f}, memcpy {gb(t_copy):.0f}; {check}")
                rec = {"group": group, "case": name, "packed_bytes": nb, "block_bytes": block, "rotations": r,
                       "seconds": {"commlib": t_ours, "cupy": t_cupy, "memcpy": t_copy}, "baseline": base_name,
                       "gbps_packed": {"commlib": gb(t_ours), "cupy": gb(t_cupy), "memcpy": gb(t_copy)},
                       "check": ok}
                self.records.append(rec)
                st = None if ok else "MISMATCH"
                self.t.add(group, name, "x cupy", t_cupy / t_ours, 1.0, detail=detail, status=st)
                mem_target = 0.7 if (nb >= 8 * MiB and block >= 256) else None
                self.t.add(group, name, "x memcpy", t_copy / t_ours, mem_target,
                           detail="" if mem_target else "(target only from 8 MiB packed, blocks >= 256 B)",
                           status=st)
                packers = views = src = chunks = out = None  # free the device memory before the next case
            except Exception as exc:  # noqa: BLE001 - report and go on
                self.t.error(group, name, exc)
        arrays.clear()
        cp.get_default_memory_pool().free_all_blocks()

    def run_host_cost(self):
        cp = self.cp
        from commlib.datatypes import Packer, Subarray

        group = "pack"
        try:
            k = cp.RawKernel(r'extern "C" __global__ void commlib_bench_empty() {}', "commlib_bench_empty")
            t_empty = self.host_time_sync(lambda: k((1,), (1,), ()), self.args.repeat * 10)
        except Exception as exc:  # noqa: BLE001
            self.t.error(group, "per-call host cost", exc)
            return
        n = 256
        a = cp.random.random((n, n, n), dtype=cp.float64)
        for label, sub in (("z", (n, n, W)), ("x", (W, n, n))):
            name = f"per-call {label}-face 1.5MiB"
            try:
                t = Subarray((n, n, n), sub, (0, 0, 0), "float64")
                p = Packer(t, a)
                ok = bool(cp.array_equal(cp.asarray(p.pack()),
                                         cp.ascontiguousarray(a[tuple(slice(0, s) for s in sub)]).view(cp.uint8).ravel()))
                t_pack = self.host_time_sync(p.pack, self.args.repeat * 10)
                self.records.append({"group": group, "case": name, "seconds": {"commlib": t_pack, "empty_kernel": t_empty},
                                     "check": ok})
                self.t.add(group, name, "us per call", t_pack * 1e6, None, unit="us",
                           detail=f"Packer.pack() + synchronize, host clock; empty RawKernel launch + synchronize "
                                  f"{t_empty * 1e6:.1f} us; commlib overhead {1e6 * (t_pack - t_empty):.1f} us"
                                  f"{'' if ok else '; MISMATCH'}", status=None if ok else "MISMATCH")
            except Exception as exc:  # noqa: BLE001
                self.t.error(group, name, exc)

    # -- halo
    def run_halo(self):
        cp, MPI = self.cp, self.MPI
        group = "halo"
        if self.size != 2:
            self.t.note(group, "64^3, 256^3 per rank", f"skipped: needs 2 ranks (mpiexec -n 2), this run has {self.size}")
            return
        from commlib.collectives import HaloExchange

        cart = None
        try:
            cart = self.comm.cart_create(dims=[1, 1, 2], periods=[False, False, True])
        except Exception as exc:  # noqa: BLE001
            self.t.error(group, "cart_create", exc)
            return
        mpi = cart.mpi_comm
        for n in (64, 256):
            name = f"{n}^3 per rank, w=3"
            halo = None
            try:
                err = None
                try:
                    halo = HaloExchange(cart, (n, n, n), width=W, corners=False, dtype="float64")
                except Exception as exc:  # noqa: BLE001
                    err = one_line(exc)
                errs = mpi.allgather(err)
                if any(errs):
                    raise RuntimeError(next(e for e in errs if e))
                shape = tuple(n + 2 * W for _ in range(3))
                cp.random.seed(1234 + cart.rank)
                f1 = cp.random.random(shape, dtype=cp.float64)
                f2 = f1.copy()
                inner = (slice(W, W + n), slice(W, W + n))
                msgs = []  # (dest, source, send face index, ghost index, recv host buffer)
                for off in (-1, 1):
                    dest = cart.neighbor((0, 0, off))
                    source = cart.neighbor((0, 0, -off))
                    s0 = W if off < 0 else n          # my interior face on the `off` side
                    g0 = n + W if off < 0 else 0      # my ghost on the `-off` side
                    msgs.append((dest, source, inner + (slice(s0, s0 + W),), inner + (slice(g0, g0 + W),),
                                 np_empty((n, n, W)), 100 + off))

                def baseline(f=f2):
                    for dest, source, sidx, gidx, rbuf, tag in msgs:
                        sbuf = cp.ascontiguousarray(f[sidx]).get()
                        mpi.Sendrecv(sbuf, dest, tag, rbuf, source, tag)
                        f[gidx] = cp.asarray(rbuf)

                halo.exchange(f1)
                baseline()
                self.sync()
                ok = bool(mpi.allreduce(bool(cp.array_equal(f1, f2)), op=MPI.LAND))
                reps = self.args.repeat
                number = 20 if n <= 64 else 5
                t_ours = self.mpi_time(lambda: halo.exchange(f1), reps, number)
                t_base = self.mpi_time(baseline, reps, number)
                face = n * n * W * 8
                rec = {"group": group, "case": name, "face_bytes": face, "messages_per_rank": 2,
                       "seconds": {"commlib": t_ours, "cupy_mpi4py": t_base}, "check": ok,
                       "cuda_aware": bool(getattr(self.comm, "cuda_aware", False))}
                self.records.append(rec)
                self.t.add(group, name, "x cupy+mpi4py", t_base / t_ours, 1.5, status=None if ok else "MISMATCH",
                           detail=f"2 ranks, 2 z-faces of {_bytes(face)} each way; commlib {t_ours * 1e3:.3f} ms, "
                                  f"cupy+mpi4py {t_base * 1e3:.3f} ms; {'ghosts equal' if ok else 'MISMATCH'}")
            except Exception as exc:  # noqa: BLE001
                self.t.error(group, name, exc)
            finally:
                if halo is not None:
                    try:
                        halo.free()
                    except Exception:  # noqa: BLE001
                        pass
        try:
            cart.free()
        except Exception:  # noqa: BLE001
            pass

    # -- allreduce
    def run_allreduce(self):
        cp, MPI = self.cp, self.MPI
        group = "allreduce"
        if self.size != 2:
            self.t.note(group, "1, 16, 64 MiB float32", f"skipped: needs 2 ranks (mpiexec -n 2), this run has {self.size}")
            return
        import numpy as np

        mpi = MPI.COMM_WORLD
        for mib in (1, 16, 64):
            name = f"{mib} MiB float32"
            try:
                n = mib * MiB // 4
                cp.random.seed(99 + self.rank)
                a = cp.random.random(n, dtype=cp.float32)
                b = cp.empty_like(a)
                b2 = cp.empty_like(a)
                h_out = np.empty(n, np.float32)

                def ours():
                    self.comm.allreduce(a, b)

                def base():
                    h = a.get()
                    mpi.Allreduce(h, h_out, op=MPI.SUM)
                    b2.set(h_out)

                ours()
                base()
                self.sync()
                ok = bool(mpi.allreduce(bool(cp.allclose(b, b2, rtol=1e-6, atol=0)), op=MPI.LAND))
                number = 10 if mib == 1 else 3
                t_ours = self.mpi_time(ours, self.args.repeat, number)
                t_base = self.mpi_time(base, self.args.repeat, number)
                self.records.append({"group": group, "case": name, "bytes": n * 4,
                                     "seconds": {"commlib": t_ours, "get_Allreduce_set": t_base}, "check": ok})
                self.t.add(group, name, "x get+Allreduce+set", t_base / t_ours, None,
                           status=None if ok else "MISMATCH",
                           detail=f"commlib {t_ours * 1e3:.3f} ms, baseline {t_base * 1e3:.3f} ms; "
                                  f"{'results allclose' if ok else 'MISMATCH'}")
                a = b = b2 = None
            except Exception as exc:  # noqa: BLE001
                self.t.error(group, name, exc)

    # -- heat
    def run_heat(self):
        cp, MPI = self.cp, self.MPI
        group = "heat"
        import numpy as np

        try:
            from commlib.apps import heat
        except Exception as exc:  # noqa: BLE001
            self.t.error(group, "import commlib.apps.heat", exc)
            return
        selfcomm = self.commlib.init(MPI.COMM_SELF)
        slice_step, slice_src = find_slice_step(heat)
        backends = [b for b in ("cuda", "cupy") if b in getattr(heat, "BACKENDS", ("cuda",))]

        # correctness of the baseline and of the solver, on a small grid
        try:
            g, steps = [24, 20, 16], 5
            _, dt, steps, c = heat.time_step(g, 1.0, 0.5, steps)
            u0 = np.zeros([n + 2 for n in g])
            u0[1:-1, 1:-1, 1:-1] = heat.exact_solution(g, (0, 0, 0), tuple(g), 0.0, 1.0)
            u, un = cp.asarray(u0), cp.asarray(u0)
            for _ in range(steps):
                slice_step(u, un, c)
                u, un = un, u
            mine = cp.asnumpy(u[1:-1, 1:-1, 1:-1])
            for be in backends:
                _, local = heat.solve(selfcomm, g, steps=steps, backend=be)
                ok = np.allclose(local, mine, rtol=1e-12, atol=1e-14)
                self.t.add(group, f"check 24x20x16 {be}", "max |diff|", float(np.max(np.abs(local - mine))), None,
                           unit="", status=None if ok else "MISMATCH",
                           detail=f"solve(backend={be!r}) vs the CuPy slice step ({slice_src}), 5 steps: "
                                  f"{'allclose' if ok else 'MISMATCH'}")
        except Exception as exc:  # noqa: BLE001
            self.t.error(group, "check 24x20x16", exc)

        for n in (256, 384):
            name = f"{n}^3 1 rank"
            grid = [n, n, n]
            try:
                padded = (n + 2,) * 3
                x = cp.ones(padded, cp.float64)
                y = cp.zeros_like(x)
                t_el = self.gpu_time([lambda: y.__setitem__(Ellipsis, x), lambda: x.__setitem__(Ellipsis, y)])
                t_mc = self.gpu_time([lambda: cp.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, x.nbytes, 3,
                                                                           cp.cuda.get_current_stream().ptr)])
                bw = 2 * x.nbytes / min(t_el, t_mc)  # bytes read + written per second
                x = y = None
                cp.get_default_memory_pool().free_all_blocks()
                roof = bw / 16 / 1e9  # GLUPS
                self.t.add(group, name, "roofline GLUPS", roof, None, unit="",
                           detail=f"D2D copy of {_bytes(8 * (n + 2) ** 3)} arrays: {bw / 1e9:.0f} GB/s (read + "
                                  "written) / 16 B per update")
            except Exception as exc:  # noqa: BLE001
                self.t.error(group, name, exc)
                continue
            # CuPy slice baseline
            g_slice = None
            try:
                _, _, steps, c = heat.time_step(grid, 1.0, 0.5, self.args.heat_steps)
                u = cp.zeros(padded, cp.float64)
                u[1:-1, 1:-1, 1:-1] = cp.asarray(heat.exact_solution(grid, (0, 0, 0), tuple(grid), 0.0, 1.0))
                un = u.copy()
                pair = [u, un]

                def one():
                    slice_step(pair[0], pair[1], c)
                    pair.reverse()

                t_step = self.gpu_time([one] * 10, repeat=max(3, self.args.heat_steps // 10), warmup=2)
                g_slice = n ** 3 / t_step / 1e9
                u = un = pair = None
                cp.get_default_memory_pool().free_all_blocks()
                self.t.add(group, name, "cupy-slice GLUPS", g_slice, None, unit="",
                           detail=f"{slice_src}, CUDA events, median")
            except Exception as exc:  # noqa: BLE001
                self.t.error(group, name + " cupy-slice", exc)
            for be in backends:
                try:
                    heat.solve(selfcomm, [min(n, 64)] * 3, steps=2, backend=be)  # JIT warm-up
                    res, _ = heat.solve(selfcomm, grid, steps=self.args.heat_steps, backend=be)
                    glups = float(getattr(res, "glups", res.mlups / 1e3))
                    ok = bool(res.rel_l2_error < 1e-2)
                    st = None if ok else "MISMATCH"
                    self.records.append({"group": group, "case": name, "backend": be, "glups": glups,
                                         "roofline_glups": roof, "copy_bandwidth_Bps": bw,
                                         "cupy_slice_glups": g_slice, "steps": res.steps,
                                         "rel_l2_error": res.rel_l2_error, "check": ok})
                    tgt = n == 384 and be == "cuda"
                    self.t.add(group, name, f"{be} GLUPS", glups, None, unit="", status=st,
                               detail=f"solve(backend={be!r}), {res.steps} steps, wall {res.wall_s:.4f} s; "
                                      f"rel L2 error {res.rel_l2_error:.2e} {'ok' if ok else 'MISMATCH'}")
                    self.t.add(group, name, f"{be} / roofline", glups / roof, 0.5 if tgt else None, status=st)
                    if g_slice:
                        self.t.add(group, name, f"{be} x cupy-slice", glups / g_slice, 3.0 if tgt else None,
                                   status=st)
                except Exception as exc:  # noqa: BLE001
                    self.t.error(group, f"{name} {be}", exc)
            cp.get_default_memory_pool().free_all_blocks()


def np_empty(shape):
    import numpy as np

    return np.empty(shape, np.float64)


def _bytes(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def own_slice_step(u, un, c):
    """One FTCS step as a plain CuPy slice expression (3-D, ghost width 1):
    ``un = u + sum_i c_i (u[i-1] - 2u + u[i+1])`` on the interior, the same
    association as commlib's kernels."""
    c0, c1, c2 = (float(x) for x in c)
    ctr = u[1:-1, 1:-1, 1:-1]
    un[1:-1, 1:-1, 1:-1] = ctr + ((c0 * (u[:-2, 1:-1, 1:-1] - 2.0 * ctr + u[2:, 1:-1, 1:-1])
                                   + c1 * (u[1:-1, :-2, 1:-1] - 2.0 * ctr + u[1:-1, 2:, 1:-1]))
                                  + c2 * (u[1:-1, 1:-1, :-2] - 2.0 * ctr + u[1:-1, 1:-1, 2:]))


def find_slice_step(heat):
    """``(cupy_slice_step, where)``: the solver's own when it has one, else this file's."""
    import importlib

    for modname in ("commlib.apps.heat", "commlib.apps._heat_cupy", "commlib.apps._heat_cuda"):
        try:
            mod = heat if modname == "commlib.apps.heat" else importlib.import_module(modname)
        except Exception:  # noqa: BLE001
            continue
        fn = getattr(mod, "cupy_slice_step", None)
        if callable(fn):
            return fn, f"{modname}.cupy_slice_step"
    return own_slice_step, "bench_device.own_slice_step"


# ---------------------------------------------------------------- output
def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r["unit"] == "x" and r["value"] is not None and math.isfinite(r["value"])]
    if not rs:
        return
    colors = {"pack": "tab:blue", "unpack": "tab:cyan", "halo": "tab:green", "heat": "tab:orange",
              "allreduce": "tab:purple"}
    fig, ax = plt.subplots(figsize=(max(8, 0.34 * len(rs) + 2), 6))
    xs = range(len(rs))
    ax.bar(xs, [r["value"] for r in rs], color=[colors.get(r["group"], "gray") for r in rs])
    for x, r in zip(xs, rs):
        if r["target"] is not None:
            ax.hlines(r["target"], x - 0.45, x + 0.45, colors="red", linewidth=2)
        if r["status"] in ("MISS", "MISMATCH"):
            ax.text(x, r["value"], r["status"][0], ha="center", va="bottom", fontsize=7, color="red")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['group']}: {r['case']} {r['quantity']}" for r in rs], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("ratio (baseline time / commlib time; heat: GLUPS ratios)")
    ax.set_title(title + "  (red bars: targets)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser():
    doc = __doc__
    p = argparse.ArgumentParser(prog="bench_device.py", description=doc.split("\n\n")[0],
                                epilog=doc.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=GROUPS, default=list(GROUPS), metavar="GROUP",
                   help=f"groups to run, any of {', '.join(GROUPS)} (default: all)")
    p.add_argument("--repeat", type=int, default=21, help="timed trials per measurement; the median is kept (21)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes before timing (3)")
    p.add_argument("--heat-steps", type=int, default=100, help="time steps per heat run (100)")
    p.add_argument("--quick", action="store_true", help="short run: 5 trials, 1 warm-up, 20 heat steps")
    p.add_argument("--json", metavar="PATH", help="write every row and the raw timings as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of the ratios with the targets (PNG)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeat, args.warmup, args.heat_steps = 5, 1, 20
    from commlib.core.config import config

    if config.cuda_simulator:
        print("bench_device: needs CuPy and a GPU, and NUMBA_ENABLE_CUDASIM unset (it is set: commlib's "
              "kernels would run in the simulator)", file=sys.stderr)
        return 2
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # noqa: BLE001
        print(f"bench_device: needs CuPy and a GPU ({one_line(exc)})", file=sys.stderr)
        return 2

    from mpi4py import MPI

    import commlib

    comm = commlib.init()
    rank, size = comm.rank, comm.size
    ndev = cp.cuda.runtime.getDeviceCount()
    if ndev > 1:  # one GPU per rank where there are several; numba's kernels on the same one
        from numba import cuda

        cp.cuda.Device(rank % ndev).use()
        cuda.select_device(rank % ndev)
    table = Table(printing=rank == 0)
    b = Bench(args, cp, MPI, commlib, comm, table)
    if rank == 0:
        print(f"# bench_device: {b.device_name}, CuPy {cp.__version__}, commlib {getattr(commlib, '__version__', '?')}, "
              f"{size} rank(s), MPI CUDA-aware: {getattr(comm, 'cuda_aware', '?')}; L2 {b.l2 / 1e6:.0f} MB, "
              f"reads rotate over >= {b.rot_bytes / 1e6:.0f} MB per trial; median of {args.repeat} trials")
        print("# ratio = baseline time / commlib time (> 1: commlib faster); GB/s = packed bytes per second")
    t0 = time.perf_counter()
    for g in GROUPS:
        if g not in args.cases:
            continue
        if g in ("halo", "allreduce"):
            try:
                getattr(b, f"run_{g}")()
            except Exception as exc:  # noqa: BLE001
                table.error(g, "(group)", exc)
            continue
        if rank == 0:  # one GPU: the single-rank groups run on rank 0 alone
            try:
                if g == "pack":
                    b.run_pack("pack")
                    b.run_host_cost()
                elif g == "unpack":
                    b.run_pack("unpack")
                else:
                    b.run_heat()
            except Exception as exc:  # noqa: BLE001
                table.error(g, "(group)", exc)
        comm.mpi_comm.Barrier()
    if rank == 0:
        rows = table.rows
        n_t = [r for r in rows if r["target"] is not None]
        n_pass = sum(r["status"] == "PASS" for r in n_t)
        bad = [r for r in rows if r["status"] in ("ERROR", "MISMATCH")]
        print("-" * 120)
        print(f"# targets: {n_pass} PASS, {sum(r['status'] == 'MISS' for r in n_t)} MISS of {len(n_t)}; "
              f"{len(bad)} ERROR/MISMATCH row(s); {time.perf_counter() - t0:.0f} s")
        title = f"commlib on {b.device_name}, {size} rank(s)"
        if args.json:
            rec = {"benchmark": "bench_device", "device": b.device_name, "cupy": cp.__version__,
                   "commlib": getattr(commlib, "__version__", None),
                   "mpi": MPI.Get_library_version().splitlines()[0], "ranks": size,
                   "cuda_aware": bool(getattr(comm, "cuda_aware", False)), "l2_bytes": b.l2,
                   "repeat": args.repeat, "heat_steps": args.heat_steps, "cases": args.cases,
                   "rows": rows, "measurements": b.records}
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(rec, fh, indent=2, default=str)
        if args.plot:
            try:
                plot(table.rows, args.plot, title)
            except Exception as exc:  # noqa: BLE001
                print(f"plot: ERROR: {one_line(exc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
