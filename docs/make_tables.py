"""The performance page's tables, made from the benchmarks' JSON.

Two commands:

    python -P docs/make_tables.py run [AREA ...]   # run each area's benchmark, save docs/results/AREA.json
    python -P docs/make_tables.py tables           # write docs/results/AREA.md from those files
    python -P docs/make_tables.py check            # exit 1 if a table differs from its JSON

``run`` wraps the benchmark's own ``--json`` output with the command line, the
date (UTC) and the machine (CPU model, cores, Python, MPI library, load average
at the start), so every figure on the page says where it came from. ``tables``
writes one Markdown table per area; the performance page includes them.
Only ``run`` starts MPI jobs; ``tables`` and ``check`` read files.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
MPIEXEC = "mpiexec --allow-run-as-root --oversubscribe"
FT = ("mpiexec --allow-run-as-root --oversubscribe --with-ft ulfm --mca btl tcp,self "
      "--mca btl_tcp_flags send,inplace,need-ack,need-csum --prtemca state_base_error_non_zero_exit 0")

#: area -> the command that measures it ({json}: the file it writes; {plot}: its PNG, where it makes one)
AREAS = {
    "allreduce": f"{MPIEXEC} -n 2 python -P benchmarks/bench_allreduce.py --min-bytes 8 --max-bytes 16777216 "
                 "--variants auto,ring --trials 3 --json {json} --plot {plot}",
    "small": f"{MPIEXEC} -n 2 python -P benchmarks/bench_small.py --iters 2000 --trials 3 --json {{json}}",
    "halo": f"{MPIEXEC} -n 2 python -P benchmarks/bench_halo.py --json {{json}}",
    "halo3d": f"{MPIEXEC} -n 2 python -P benchmarks/bench_halo3d.py --sizes 16 32 64 --json {{json}} --plot {{plot}}",
    "pack": "python -P benchmarks/bench_pack.py --quick --dims 1 2 --no-progress --json {json} --plot {plot}",
    "pingpong": f"{MPIEXEC} -n 2 python -P benchmarks/bench_typed_pingpong.py --sizes 256 4096 65536 "
                "--blocks 8 512 --repeat 2000 --no-progress --json {json} --plot {plot}",
    "heat": f"{MPIEXEC} -n 2 python -P benchmarks/bench_heat.py --trials 7 --time-block --profile "
            "--json {json} --plot {plot}",
    "heat_1": f"{MPIEXEC} -n 1 python -P benchmarks/bench_heat.py --trials 5 --time-block "
              "--json {json} --plot {plot}",
    "heat_4": f"{MPIEXEC} -n 4 python -P benchmarks/bench_heat.py --trials 7 --time-block "
              "--json {json} --plot {plot}",
    "attention": f"{MPIEXEC} -n 2 python -P benchmarks/bench_attention.py --seq 4096 --json {{json}}",
    "window": f"{MPIEXEC} -n 2 python -P benchmarks/bench_window.py --seq 8192 --window 512 --json {{json}}",
    "ft_recovery": "python -P benchmarks/bench_ft.py recovery --runs 10 --json {json}",
    "ft_overhead": f"{FT} -n 2 python -P benchmarks/bench_ft.py overhead --trials 9 --min-bytes 1048576 "
                   "--max-bytes 16777216 --json {json}",
    "elastic": "python -P benchmarks/bench_elastic.py --sections allreduce,kill,sync --peers 2 --max-bytes 4194304 "
               "--kill-trials 4 --sync-bytes 33554432 --sync-trials 2 --json {json}",
    "torch_backend": f"{MPIEXEC} -n 2 python -P benchmarks/bench_torch_backend.py --json {{json}} --plot {{plot}}",
    # needs torchft (pip install torchft) in the Python on PATH
    "recovery_torchft": "python -P benchmarks/bench_recovery_torchft.py --runs 5 --seed 11 --json {json}",
    # the rest need torch; each launches its own MPI jobs (the ULFM line where it kills ranks)
    "torch_attention": "python -P benchmarks/bench_attention.py --backend torch --sections single,ranks2,bidir,error "
                       "--seq-lens-2 4096,8192 --json {json} --plot {plot}",
    "lm_ft_overhead": "python -P benchmarks/bench_lm_ft.py overhead --reps 5 --json {json}",
    "lm_ft_soak": "python -P benchmarks/bench_lm_ft.py soak --plans 30 --seed 38 --json {json}",
    "ddp_soak": "python -P benchmarks/soak_torch_ddp.py --runs 30 --seed 7 --json {json}",
}


def _machine():
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from mpi4py import MPI  # noqa: PLC0415
        mpi = MPI.Get_library_version().split("\n")[0].strip("\x00 ").split(",")[0]
    except Exception:  # noqa: BLE001 - the page says "unknown" rather than failing
        mpi = "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "mpi": mpi,
            "load_1min": round(os.getloadavg()[0], 1)}


def run(areas):
    """Run each area's benchmark and save its JSON, wrapped with command, date and machine."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    status = 0
    for area in areas:
        with tempfile.TemporaryDirectory() as tmp:
            out, plot = Path(tmp) / "out.json", Path(tmp) / "out.png"
            cmd = AREAS[area].format(json=out, plot=plot)
            machine = _machine()
            date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
            print(f"== {area}: {cmd}", flush=True)
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            rc = subprocess.run(shlex.split(cmd), cwd=ROOT, env=env, check=False).returncode
            if rc != 0 or not out.exists():
                why = f"exit {rc}" if rc else "no JSON written"
                print(f"!! {area} failed ({why}); docs/results/{area}.json left as it was", flush=True)
                status = 1
                continue
            record = {"area": area, "command": AREAS[area].format(json=f"{area}.json", plot=f"{area}.png"),
                      "date": date, "machine": machine, "result": json.loads(out.read_text())}
            (RESULTS / f"{area}.json").write_text(json.dumps(record, indent=1) + "\n")
            if plot.exists():
                (RESULTS / f"{area}.png").write_bytes(plot.read_bytes())
    return status


# ---------------------------------------------------------------- formatting

def _size(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _x(v):
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.2f}x"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


FORMATTERS = {}


def formatter(area):
    def deco(fn):
        FORMATTERS[area] = fn
        return fn
    return deco


def _us(seconds):
    return f"{seconds * 1e6:.1f}"


@formatter("allreduce")
def _allreduce(r):
    variants = [k for k in ("auto", "ring", "recursive_doubling") if k in r["rows"][0]]
    head = ["bytes", "MPI.Allreduce µs"] + [f"`{v}` µs (MPI time / commlib time)" for v in variants]
    rows = []
    for row in r["rows"]:
        cells = [_size(row["bytes"]), f"{row['MPI.Allreduce']['time_us']:.1f}"]
        cells += [f"{row[v]['time_us']:.1f} ({_x(row[v].get('ratio_vs_mpi'))})" for v in variants]
        rows.append(cells)
    return (f"{r['ranks']} ranks, {r['mpi'].split(',')[0]}; one call's time, best of the trials; above 1 x is faster "
            f"than MPI.\n\n" + _table(head, rows))


@formatter("pack")
def _pack(r):
    head = ["block", "strided dims", "commlib pack GB/s", "MPI_Pack GB/s", "memcpy GB/s",
            "pack / MPI_Pack", "unpack / MPI_Unpack"]
    rows = [[_size(x["block"]), x["dims"], f"{x['gbps']['pack_commlib']:.2f}", f"{x['gbps']['pack_mpi']:.2f}",
             f"{x['gbps']['memcpy']:.2f}", _x(x["pack_vs_mpi"]), _x(x["unpack_vs_mpi"])] for x in r["rows"]]
    s = r["summary"]
    return (f"{_size(r['total'])} packed per shape, host arrays. Geometric mean, pack against "
            f"`MPI.Datatype.Pack`: {_x(s['pack_vs_mpi_geomean'])} over every shape, "
            f"{_x(s['pack_vs_mpi_geomean_ge64B'])} for blocks of 64 B and more.\n\n" + _table(head, rows))


@formatter("pingpong")
def _pingpong(r):
    head = ["message", "block", "mpi4py `Send`/`Recv` µs", "commlib `auto` µs", "mpi4py time / commlib time",
            "model's pick", "fastest"]
    rows = [[_size(x["bytes"]), _size(x["block"]), _us(x["seconds"]["mpi4py"]), _us(x["seconds"]["auto"]),
             _x(x["seconds"]["mpi4py"] / x["seconds"]["auto"]), x["model_pick"], x["fastest"]] for x in r["rows"]]
    return (f"One-way time of a non-contiguous message (a vector of blocks), both sides with the same "
            f"datatype. The strategy model picked the fastest strategy in "
            f"{r['model_accuracy']:.0%} of the cases.\n\n" + _table(head, rows))


@formatter("ft_recovery")
def _ft_recovery(r):
    k, d = r["kill_to_result_s"], r["detect_to_result_s"]
    head = ["ranks", "jobs", "kill to result, median ms", "p90 ms", "max ms", "detection to result, median ms"]
    rows = [[r["ranks"], r["runs"], f"{k['median'] * 1e3:.0f}", f"{k['p90'] * 1e3:.0f}", f"{k['max'] * 1e3:.0f}",
             f"{d['median'] * 1e3:.0f}"]]
    return ("A rank is killed at a random point of a 1 MiB ring all-reduce under ULFM; the time from "
            "the kill to the survivors' verified result.\n\n" + _table(head, rows))


@formatter("small")
def _small(r):
    head = ["call", "bytes", "MPI µs", "commlib µs", "MPI time / commlib time"]
    rows = [[f"`{x['call']}`", _size(x["bytes"]) if x.get("bytes") is not None else "–", _us(x["mpi_s"]),
             _us(x["commlib_s"]), _x(x["ratio"])] for x in r["rows"]]
    return (f"Small calls at {r['ranks']} ranks against mpi4py's own (`Allreduce`, `Bcast`, `Barrier`), "
            "the argument agreement on; best of the trials.\n\n" + _table(head, rows))


@formatter("halo")
def _halo(r):
    head = ["local block", "process grid", "commlib µs", "mpi4py µs", "mpi4py time / commlib time", "same result"]
    rows = [["×".join(map(str, x["local_shape"])), "×".join(map(str, x["dims"])), _us(x["commlib_s"]),
             _us(x["mpi4py_s"]), _x(x["speedup"]), "yes" if x["results_equal"] else "**no**"] for x in r["rows"]]
    return (f"One halo exchange (width {r['width']}, {r['fields']} field, faces, edges and corners) against "
            "the plain mpi4py way: `Sendrecv` of `numpy.ascontiguousarray` faces.\n\n" + _table(head, rows))


@formatter("halo3d")
def _halo3d(r):
    head = ["local cube", "neighbours", "halo bytes", "commlib µs", "MPI subarray types µs", "MPI time / commlib time"]
    rows = [[f"{x['local']}³", x["neighbours"], _size(x["halo_bytes"]), _us(x["commlib_s"]),
             _us(x["mpi4py_subarray_s"]), _x(x["speedup"])] for x in r["rows"]]
    return (f"A 26-neighbour exchange of radius {r['radius']} on {r['fields']} fields at {r['ranks']} ranks "
            "against the same exchange with MPI subarray datatypes (TEMPI's benchmark).\n\n" + _table(head, rows))


@formatter("attention")
def _attention(r):
    head = ["layout", "time s", "critical-path work / contiguous", "measured time / contiguous", "parallel efficiency"]
    base = r["layouts"]["contiguous"]
    rows = []
    for name, x in r["layouts"].items():
        rows.append([name, f"{x['time_s']:.3f}", _x(base["critical_path_work"] / x["critical_path_work"]),
                     _x(base["time_s"] / x["time_s"]), f"{r['parallel_efficiency'][name]:.2f}"])
    rows.append(["ulysses", f"{r['ulysses_time_s']:.3f}", "–", _x(base["time_s"] / r["ulysses_time_s"]),
                 f"{r['parallel_efficiency']['ulysses']:.2f}"])
    m = r["memory"]
    return (f"Causal ring attention (numpy), sequence {r['seq']}, {r['heads']} heads of {r['head_dim']}, "
            f"{r['dtype']}, {'forward and backward' if r['backward'] else 'forward'}, {r['ranks']} ranks; "
            f"one rank alone takes {r['single_rank_time_s']:.3f} s. Peak memory per rank is "
            f"{m['per_rank_vs_single']:.2f} of one rank's (ideal {m['ideal_per_rank_vs_single']:.2f}).\n\n"
            + _table(head, rows))


@formatter("heat")
@formatter("heat_1")
@formatter("heat_4")
def _heat(r):
    head = ["grid", "steps", "commlib MLUPS", "hand-written mpi4py MLUPS", "copy roofline MLUPS",
            "commlib / hand-written", "commlib / roofline", "time in communication"]

    def span(s):
        return f"{_x(s['median'])} ({s['min']:.2f}-{s['max']:.2f})"

    rows = [["×".join(map(str, x["grid"])), x["steps"], f"{x['commlib_mlups']['median']:.0f}",
             f"{x['hand_mlups']['median']:.0f}", f"{x['roofline_mlups']['max']:.0f}",
             span(x["commlib_over_hand"]), f"{x['commlib_over_roofline']['median']:.2f}",
             f"{x['commlib_comm_fraction']:.0%}"] for x in r["rows"]]
    ceiling = all("update_in_cache_mlups" in x for x in r["rows"])
    if ceiling:  # the roofline model's other ceiling, the arithmetic's (benchmarks/bench_heat.py)
        head[5:5] = ["update in cache MLUPS"]
        head[8:8] = ["commlib / lower ceiling"]
        for row, x in zip(rows, r["rows"]):
            row[5:5] = [f"{x['update_in_cache_mlups']['max']:.0f}"]
            row[8:8] = [f"{x['commlib_over_lower_ceiling']['median']:.2f}"]
    n = r["ranks"]
    halo = {"shm": "through shared memory", "mpi": "by MPI messages"}.get(r["rows"][0].get("commlib_halo"))
    text = (f"The heat solver (numba backend) on {n} rank{'s' if n > 1 else ''} against the solver an mpi4py user "
            "writes (a Cartesian communicator, faces sent with `Sendrecv`, one numba kernel per step) and against "
            "the copy-bandwidth roofline of the same arrays (its best trial), in the same job; medians of paired "
            "trials, with their range."
            + (" *Update in cache* is the roofline model's other ceiling, the arithmetic's: commlib's own update "
               "on a block of the same row length whose fields stay in the nearer caches (its best trial); the "
               "*lower ceiling* is the lower of it and the copy roofline." if ceiling else "")
            + (f" commlib's ghost cells travel {halo}." if halo and n > 1 else "") + "\n\n" + _table(head, rows))
    if any("time_block2_mlups" in x for x in r["rows"]):
        uic = all("time_block2_over_update_in_cache" in x for x in r["rows"])
        rows = [["×".join(map(str, x["grid"])), f"{x['time_block2_mlups']['median']:.0f}",
                 span(x["time_block2_over_hand"]), f"{x['time_block2_over_roofline']['median']:.2f}"]
                + ([f"{x['time_block2_over_update_in_cache']['median']:.2f}"] if uic else [])
                for x in r["rows"]]
        head = ["grid", "commlib, time_block=2, MLUPS", "/ hand-written", "/ one-sweep roofline"]
        head += ["/ update in cache"] if uic else []
        text += ("\n\nTemporal blocking (`--time-block 2`: halos two cells wide exchanged every two steps, both "
                 "steps in one sweep over the block; the same field bit for bit), in the same trials. The one-sweep "
                 "roofline does not bound it; the arithmetic's ceiling (*update in cache*) does.\n\n"
                 + _table(head, rows))
    prof = [x for x in r["rows"] if "profile" in x]
    if prof:
        names = list(prof[0]["profile"]["us_per_step"])
        rows = [["×".join(map(str, x["grid"])), x["profile"]["halo"], str(x["profile"]["planes"][0])]
                + [f"{max(x['profile']['us_per_step'][n]):.1f}" for n in names]
                + [f"{max(x['profile']['total_us']):.1f}", f"{max(x['profile']['update_alone_us']):.1f}"]
                for x in prof]
        text += ("\n\nWhere a step's time goes (`--profile`: the solver's own block and loop with each phase "
                 "timed, µs per step, the slowest rank's; *update alone*: the whole block's update with no halo, "
                 "both ranks at once). The timers add a few µs per phase.\n\n"
                 + _table(["grid", "ghost cells", "planes per pass"] + names + ["step", "update alone"], rows))
    return text


@formatter("torch_backend")
def _torch_backend(r):
    head = ["bytes", "commlib µs", "gloo µs", "gloo time / commlib time"]
    rows = [[_size(x["bytes"]), f"{x['commlib']['time_us']:.0f}", f"{x['gloo']['time_us']:.0f}", _x(x["ratio"])]
            for x in r["rows"]]
    d = r["ddp"]
    return (f"`dist.all_reduce` on the `\"commlib\"` backend against gloo in one job ({r['launcher']}, "
            f"{r['ranks']} ranks, torch {r['torch']}). A DDP step ({d['layers']} layers of {d['width']}, "
            f"batch {d['batch_per_rank']} per rank): {d['commlib']['steps_per_s']:.1f} steps/s on commlib, "
            f"{d['gloo']['steps_per_s']:.1f} on gloo ({_x(d['ratio'])}), the same parameters "
            f"(largest difference {d['max_param_diff']:g}).\n\n" + _table(head, rows))


@formatter("elastic")
def _elastic(r):
    out = []
    for peers, a in sorted(r.get("allreduce", {}).items()):
        base = [k for k in ("openmpi_tcp", "gloo", "python_sockets") if k in a["rows"][0]]
        head = ["bytes", "commlib.elastic µs"] + [f"{k} µs (its time / commlib's)" for k in base]
        rows = [[_size(x["bytes"]), f"{x['commlib.elastic']['time_us']:.0f}"]
                + [f"{x[k]['time_us']:.0f} ({_x(x.get('ratio_vs_' + k))})" for k in base] for x in a["rows"]]
        out.append(f"All-reduce (float32 sum) at {peers} peers on loopback, authenticated, against Open MPI's "
                   "`Allreduce` over its TCP transport, torch's gloo and the same ring over plain Python sockets; "
                   "best of the trials.\n\n" + _table(head, rows))
    if "kill" in r:
        k = r["kill"]
        out.append(f"A peer SIGKILLed while {k['peers']} peers all-reduce 64 KiB in a loop: the next all-reduce over "
                   f"the survivors completes {k['median_s'] * 1e3:.0f} ms after the kill (median of {k['trials']}; "
                   f"max {k['max_s'] * 1e3:.0f} ms).")
    if "sync" in r:
        y = r["sync"]
        line = (f"A joiner's state sync of {_size(y['bytes'])} ({y['tensors']} tensors, {y['donors']} donors, "
                f"{y['fetch_connections']} connections): {y['median_sync_s']:.3f} s (median of {len(y['trials'])}), "
                f"verified bit for bit; the same bytes over plain loopback sockets take "
                f"{y['bytes'] / y['median_bandwidth_Bps']:.3f} s.")
        d = y.get("donor_death")
        if d:
            line += (f" With its donor SIGKILLed {d['killed_after_first_byte_s']:.1f} s after the first byte "
                     f"(donors throttled), the joiner finishes from the other donor in {d['sync_s']:.2f} s, verified.")
        out.append(line)
    return "\n\n".join(out)


@formatter("window")
def _window(r):
    head = ["attention", "forward + backward s", "bytes received per rank", "full ring time / this time"]
    base = r["time_s"]["full_zigzag"]
    rows = []
    for name, label in (("window", f"window ({r['window']} tokens back)"), ("full_zigzag", "full causal ring, zigzag"),
                        ("full_contiguous", "full causal ring, contiguous")):
        recv = max(b[1] for b in r["bytes_sent_received_per_rank"][name])
        rows.append([label, f"{r['time_s'][name]:.3f}", _size(recv), _x(base / r["time_s"][name])])
    return (f"Sliding-window causal attention (torch, CPU) at {r['ranks']} ranks, {r['seq']} tokens, "
            f"{r['heads']} heads of {r['head_dim']}, {r['dtype']}: the window's halo exchange moves only the K/V rows "
            "inside the window, against the full causal ring.\n\n" + _table(head, rows))


@formatter("ft_overhead")
def _ft_overhead(r):
    variants = list(r["rows"][0]["ft_over_plain"])
    head = ["bytes"] + [f"`{v}`: fault-tolerant / plain time (floor)" for v in variants] + ["agree µs", "memcpy µs"]
    rows = [[_size(x["bytes"])] + [f"{x['ft_over_plain'][v]:.2f} ({x['floor'][v]:.2f})" for v in variants]
            + [f"{x['agree_us']:.1f}", f"{x['memcpy_us']:.1f}"] for x in r["rows"]]
    return (f"What fault tolerance costs with no failure ({r['mode']}, {r['ranks']} ranks): the same all-reduce on a "
            "fault-tolerant communicator and on a plain one, median of paired trials; below 1 is noise. The floor is "
            "what the mode must add: one `MPIX_Comm_agree`, plus a copy of the input in place "
            "(`recvbuf=None`).\n\n" + _table(head, rows))


@formatter("recovery_torchft")
def _recovery_torchft(r):
    head = ["", "recovery median s", "min s", "max s", "runs finished", "runs with the right parameters"]
    rows = []
    for side in ("commlib", "torchft"):
        if side in r:
            m = r[side]["summary"]
            runs = len(r[side]["runs"])
            rows.append([side, f"{m['median_s']:.3f}", f"{m['min_s']:.3f}", f"{m['max_s']:.3f}",
                         f"{r[side]['finished']}/{runs}", f"{r[side]['right']}/{runs}"])
    ratio = r.get("ratio_torchft_over_commlib")
    return (f"A DDP job of {r['workers']} workers losing one (SIGKILL at step {r['kill_step']}, {r['phase']}; the same "
            "victims on both sides): commlib's `ResilientRunner` under ULFM against torchft (a lighthouse, one "
            "`Manager` per worker, gloo). Recovery is the kill to the end of the survivors' first step on the "
            "shrunk group; the right parameters are those of a one-process run."
            + (f" torchft's median over commlib's: {ratio:.1f}x." if ratio else "") + _torchft_settings(r)
            + "\n\n" + _table(head, rows))


def _torchft_settings(r):
    t = r.get("torchft_settings") or {}
    lh, pg = t.get("lighthouse", {}), t.get("process_group", {})
    if not lh or not pg:
        return ""
    return (f" torchft's timeouts, which set its floor (a survivor learns of the death when gloo's all-reduce "
            f"times out, the quorum when the lighthouse's join timeout ends): gloo {pg.get('timeout_s')} s, "
            f"lighthouse join {lh.get('join_timeout_ms')} ms, heartbeat {lh.get('heartbeat_timeout_ms')} ms.")


def _ms(seconds):
    v = seconds * 1e3
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _median_max(xs):
    """'median / max' in ms of the numbers in ``xs`` (None and NaN left out), '–' for none."""
    xs = sorted(x for x in xs if isinstance(x, (int, float)) and math.isfinite(x))
    if not xs:
        return "–"
    return f"{_ms(statistics.median(xs))} / {_ms(xs[-1])}"


def _span(xs):
    """'2.00x', or '1.90x to 2.00x' where the values differ."""
    lo, hi = _x(min(xs)), _x(max(xs))
    return lo if lo == hi else f"{lo} to {hi}"


def _by_phase(rows, phase_of, order):
    """[(phase, rows)] in ``order`` (phases not in it last), then ('all', rows)."""
    seen = list(dict.fromkeys(phase_of(x) for x in rows))
    phases = [p for p in order if p in seen] + [p for p in seen if p not in order]
    return [(p, [x for x in rows if phase_of(x) == p]) for p in phases] + [("all", rows)]


@formatter("torch_attention")
def _torch_attention(r):
    out = []
    single, ranks2 = r.get("single") or [], r.get("ranks2") or []
    if single or ranks2:
        cases = {}  # (setup, tokens, dtype, mask) -> {mode: row}
        for x in single:
            threads = f"{x['threads']} thread{'s' if x['threads'] > 1 else ''}"
            setup = f"1 rank, {threads}; SDPA {threads}"
            cases.setdefault((setup, x["seq"], x["dtype"], "causal" if x["causal"] else "full"), {})[x["mode"]] = \
                (x["sdpa_s"], x["ring_s"], x["ratio"])
        for x in ranks2:
            setup = "2 ranks, 1 thread each (zigzag); SDPA 2 threads"
            cases.setdefault((setup, x["seq"], x["dtype"], "causal"), {})[x["mode"]] = \
                (x["sdpa_2threads_s"], x["ring_2ranks_s"], x["ratio"])
        rows = [[setup, seq, dtype, mask]
                + [f"{_ms(m[mode][0])} / {_ms(m[mode][1])} ({_x(m[mode][2])})" if mode in m else "–"
                   for mode in ("fwd", "fwdbwd")] for (setup, seq, dtype, mask), m in cases.items()]
        head = ["setup", "tokens", "dtype", "mask", "forward: SDPA / ring ms (SDPA time / ring time)",
                "forward + backward: SDPA / ring ms (SDPA time / ring time)"]
        out.append(f"`commlib.nn.ring_attention` against torch's `scaled_dot_product_attention` (SDPA) on the same "
                   f"tensors (torch {r['torch']}, {r['device']}, batch {r['batch']}, {r['heads']} heads of "
                   f"{r['head_dim']}, {r['kv_heads']} K/V heads); best of {r['trials']} timed calls after "
                   f"{r['warmup']} warm-up, the two alternated. On 2 ranks, the slowest rank's time against one "
                   "SDPA process with as many threads as the ring has ranks."
                   + (" A dash: not run (half-precision backward on CPU above `--half-bwd-max-seq` tokens)."
                      if any(len(m) < 2 for m in cases.values()) else "") + "\n\n" + _table(head, rows))
    bidir = r.get("bidir") or []
    if bidir:
        cases = {}
        for x in bidir:
            link = "loopback" if x["link"] == "loopback" else f"emulated, {x['link_gbps']:g} GB/s a direction"
            key = (link, f"{x['seq']} ({x['seq_local']})", x["dtype"], _size(x["expected_kv_bytes_per_step"]))
            cases.setdefault(key, {})[x["mode"]] = x
        rows = [list(key) + [f"{_ms(m[mode]['uni']['critical_path_s'])} / {_ms(m[mode]['bidir']['critical_path_s'])} "
                             f"({_x(m[mode]['critical_path_ratio'])})" if mode in m else "–"
                             for mode in ("fwd", "fwdbwd")] for key, m in cases.items()]
        head = ["link", "tokens (per rank)", "dtype", "K/V a rank sends a step",
                "forward: one-way / two-way ms (ratio)", "forward + backward: one-way / two-way ms (ratio)"]
        fewer = [x["bytes_per_link_per_step_ratio"] for x in bidir if x.get("bytes_per_link_per_step_ratio")]
        out.append(f"The two-way ring (`bidirectional=True`) against the one-way ring at {bidir[0]['ranks']} ranks, "
                   "one thread each, not causal, contiguous layout, as many K/V heads as query heads: the critical "
                   "path (the sum over the ring's steps of the slowest rank's step time), best of the trials. "
                   "Loopback is this machine's shared memory; the emulated link is a full-duplex link of a given "
                   "bandwidth in front of every pair of ranks, where communication outweighs compute."
                   + (f" Counted from the messages sent, the two-way ring puts {_span(fewer)} fewer bytes on a "
                      "link in a step." if fewer else "")
                   + "\n\n" + _table(head, rows))
    error = r.get("error") or []
    if error:
        grads = ("out", "dq", "dk", "dv")
        rows = [[x["ranks"], x["layout"], "causal" if x["causal"] else "full"]
                + [f"{x[g]['ring']:.2e} ({_x(x[g]['ratio'])})" for g in grads] for x in error]
        head = ["ranks", "layout", "mask"] + [f"`{g}` error (ring's / SDPA's)" for g in grads]
        out.append(f"bfloat16 error against the rank count: ring attention forward and backward on "
                   f"{error[0]['seq']} tokens ({error[0]['device']}), gathered and compared with float64 SDPA on the "
                   "whole sequence, the same bfloat16 inputs: the relative error ‖x − x₆₄‖ / ‖x₆₄‖ of the output and "
                   "the three gradients, and in brackets its ratio to bfloat16 SDPA's own error (1x: the same "
                   "error).\n\n" + _table(head, rows))
    return "\n\n".join(out)


@formatter("lm_ft_overhead")
def _lm_ft_overhead(r):
    c = r["config"]
    head = ["job pair", "plain tokens/s", "fault-tolerant tokens/s", "fault-tolerant / plain", "load"]
    rows = [[x["rep"] + 1, f"{x['plain_tokens_per_s']:.0f}", f"{x['ft_tokens_per_s']:.0f}", f"{x['ratio']:.2f}",
             f"{x['load']:.1f}"] for x in r["rows"]]
    return (f"What `--fault-tolerant` costs with no failure: the LM training app "
            f"(`python -m commlib.apps.lm {' '.join(c['model'])}`, {c['np']} ranks, the ULFM launch line) with and "
            "without it, in alternating jobs; tokens/s from the slowest rank's median step. Median of "
            f"fault-tolerant / plain over {len(r['rows'])} pairs: {r['median_ratio']:.2f} (1: no cost).\n\n"
            + _table(head, rows))


def _lm_good(x):
    return (x["recovered"] and x.get("extra") == 0 and x.get("failures") == 1 and x.get("losses_ok", True)
            and bool(x.get("identical")))


@formatter("lm_ft_soak")
def _lm_ft_soak(r):
    c, s = r["config"], r["summary"]
    head = ["kill phase", "runs", "finished", "all good", "failure seen to redone step, median / max ms",
            "kill to redone step, median / max ms", "work lost, median / max ms"]
    rows = [[p, len(xs), sum(x["recovered"] for x in xs), sum(_lm_good(x) for x in xs),
             _median_max(x.get("recovery_s") for x in xs), _median_max(x.get("kill_to_redo_s") for x in xs),
             _median_max(x.get("lost_s") for x in xs)]
            for p, xs in _by_phase(r["rows"], lambda x: x["phase"],
                                   ("forward", "backward", "allreduce", "optimizer", "eval"))]
    return (f"The LM training app (`python -m commlib.apps.lm {' '.join(c['model'])} --fault-tolerant`, {c['np']} "
            "ranks, the ULFM launch line) with one rank SIGKILLed per run, the rank (rank 0 included), step and "
            f"phase drawn at random (seed {c['seed']}). All good: the run finished with that one failure, "
            "the survivors' parameters are identical, and every training and validation loss is within a "
            f"relative {c['rel']:g} of a one-process run; other ranks lost in all: {s['extra_fail_stops']}. Work lost "
            "is the failed attempt's time before the failure was seen.\n\n" + _table(head, rows))


@formatter("ddp_soak")
def _ddp_soak(r):
    jobs = r["jobs"]
    head = ["kill phase", "jobs", "finished", "right parameters", "recovery per survivor, median / max ms"]
    rows = [[p, len(xs), sum(bool(x["finished"]) for x in xs), sum(bool(x["right"]) for x in xs),
             _median_max(v for x in xs for v in (x.get("recovery_s") or []))]
            for p, xs in _by_phase(jobs, lambda x: x["plan"][2], ("start", "backward", "allreduce"))]
    hung = sum(bool(x.get("hang")) for x in jobs)
    return (f"Torch DDP on the `\"commlib\"` backend: the fault-tolerance guide's resilient training loop as "
            f"written, {r['ranks']} ranks under the ULFM launch line, one rank SIGKILLed per job at a random step "
            f"(rank 0 included; seed {r['seed']}), at the step's start, in the backward pass while DDP's bucket "
            f"all-reduces run, or before the loss all-reduce. Finished: the {r['ranks'] - 1} survivors completed "
            "every step; right: their parameters equal a one-process run's within 1e-10 times the largest. "
            "Recovery is from a survivor seeing the failure to its redone step's start (revoke, shrink, state "
            "restore, process-group and DDP rebuild)." + (f" Jobs that hung: {hung}." if hung else "")
            + "\n\n" + _table(head, rows))


def render(record):
    """The Markdown for one area: its table, then the command, machine and date."""
    body = FORMATTERS[record["area"]](record["result"])
    m = record["machine"]
    where = (f"{m['cores']}-core {m['cpu']}, Python {m['python']}, {m['mpi']}, "
             f"load {m['load_1min']} at the start; {record['date']}")
    text = f"{body}\n\nMeasured with `{record['command']}` on {where}.\n"
    if m["load_1min"] > m["cores"]:
        text += (f"\n:::{{warning}}\nThe machine was busy with other jobs (load {m['load_1min']} on {m['cores']} cores): "
                 "MPI's polling waits and the baseline's share the cores with them, so these figures are noisy, "
                 "small-message latencies most. Rerun on a quiet machine: "
                 f"`python -P docs/make_tables.py run {record['area']}`, then `tables`.\n:::\n")
    return text


def tables():
    """{area: markdown} for every docs/results/AREA.json."""
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("area") in FORMATTERS:
            out[record["area"]] = render(record)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "tables"
    if cmd == "run":
        bad = [a for a in argv if a not in AREAS]
        if bad:
            print(f"unknown area(s) {bad}; areas: {' '.join(AREAS)}", file=sys.stderr)
            return 2
        return run(argv or list(AREAS))
    if cmd in ("tables", "check"):
        stale = []
        for area, text in tables().items():
            path = RESULTS / f"{area}.md"
            if cmd == "check":
                if not path.exists() or path.read_text() != text:
                    stale.append(path.name)
            else:
                path.write_text(text)
        if stale:
            print(f"out of date: {' '.join(stale)}; run python -P docs/make_tables.py tables", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
