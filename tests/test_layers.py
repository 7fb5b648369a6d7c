"""The architecture's rules, checked on the installed package (docs/architecture.md).

* layers import downward only, sibling modules import without cycles, and
  the collectives import no MPI (``mpi4py``, ``commlib.transports.mpi``)
  (import-linter's contracts in ``.importlinter``);
* only the transports call MPI to communicate: no module outside
  ``commlib.transports`` makes a point-to-point, collective, persistent-request,
  communicator-creation or ULFM call on an mpi4py object.
"""
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("core", "transports", "datatypes", "collectives", "apps")

# mpi4py's communication methods (capitalized: the buffer interface; commlib's
# own API is lower case), and its lower-case pickle-based ones called on a
# communicator object
_CAPITAL = ("Send", "Recv", "Isend", "Irecv", "Sendrecv", "Sendrecv_replace", "Ssend", "Bsend", "Rsend",
            "Issend", "Send_init", "Recv_init", "Start", "Startall", "Wait", "Waitall", "Waitany", "Waitsome",
            "Test", "Testall", "Testany", "Bcast", "Allreduce", "Reduce", "Allgather", "Allgatherv", "Gather",
            "Gatherv", "Scatter", "Scatterv", "Alltoall", "Alltoallv", "Reduce_scatter", "Reduce_scatter_block",
            "Barrier", "Ibarrier", "Iallreduce", "Agree", "Iagree", "Revoke", "Shrink", "Ack_failed", "Probe",
            "Iprobe", "Mprobe", "Improbe", "Split_type", "Create_cart", "Create_group", "Abort")
CAPITAL_CALL = re.compile(r"\.(" + "|".join(_CAPITAL) + r")\(")
# Dup / Split are collective on a communicator (an MPI.Datatype's Dup is not)
COMM_CREATE = re.compile(r"(comm|COMM_WORLD|COMM_SELF|cart)\.(Dup|Idup|Split)\(")
PICKLE_CALL = re.compile(r"(mpi_comm|COMM_WORLD|COMM_SELF|\.comm)\.(send|recv|isend|irecv|sendrecv|bcast|"
                         r"allreduce|allgather|gather|scatter|alltoall|reduce|barrier)\(")


def _layer_dirs():
    import commlib

    out = {"commlib": commlib.__path__[0]}
    for layer in LAYERS:
        out[layer] = importlib.import_module(f"commlib.{layer}").__path__[0]
    return out


def _sources():
    seen = set()
    for name, folder in _layer_dirs().items():
        for base, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    p = os.path.realpath(os.path.join(base, f))
                    if p not in seen:
                        seen.add(p)
                        yield name, p


def test_only_transports_communicate():
    transports = os.path.realpath(_layer_dirs()["transports"])
    offenders = []
    for _, path in _sources():
        if path.startswith(transports + os.sep):
            continue
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                code = line.split("#", 1)[0]
                if CAPITAL_CALL.search(code) or PICKLE_CALL.search(code) or COMM_CREATE.search(code):
                    offenders.append(f"{path}:{i}: {line.strip()}")
    assert not offenders, "communication outside commlib.transports:\n" + "\n".join(offenders)


def test_grep_catches_a_bypass(tmp_path):
    """The patterns above find the calls they exist for (the test can fail)."""
    for line in ("self.mpi_comm.Allreduce(MPI.IN_PLACE, v, MPI.MIN)", "tp.comm.Revoke()",
                 "MPI.Prequest.Startall(reqs)", "comm.mpi_comm.bcast(ok, root=0)", "cart.Send(x, dest=0)",
                 "self.mpi_comm.Dup()", "MPI.COMM_WORLD.Split(0, 1)"):
        assert CAPITAL_CALL.search(line) or PICKLE_CALL.search(line) or COMM_CREATE.search(line), line
    for line in ("comm.allreduce(x)", "tp.native_barrier()", "self.transport.startall(reqs)", "h = h.Dup()",
                 "comm.dup()"):
        assert not (CAPITAL_CALL.search(line) or PICKLE_CALL.search(line) or COMM_CREATE.search(line)), line


def test_no_path_extension_hack():
    import commlib

    with open(os.path.join(commlib.__path__[0], "__init__.py"), encoding="utf-8") as fh:
        assert "__path__.append" not in fh.read()


@pytest.mark.skipif(shutil.which("lint-imports", path=os.path.dirname(sys.executable)) is None,
                    reason="import-linter not installed (pip install '.[test]')")
def test_import_contracts():
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "lint_layers.sh")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


TORCH_IMPORT = re.compile(r"^\s*(import torch\b|from torch\b)")


def test_torch_only_in_the_framework_layer_and_apps():
    """torch is an extra: only ``commlib.nn`` and the apps that run torch models import it
    (``import commlib``, the collectives and the transports never load it)."""
    nn = os.path.realpath(os.path.join(_layer_dirs()["commlib"], "nn"))
    apps = os.path.realpath(_layer_dirs()["apps"])
    offenders = []
    for _, path in _sources():
        if path.startswith(nn + os.sep) or path.startswith(apps + os.sep):
            continue
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if TORCH_IMPORT.search(line):
                    offenders.append(f"{path}:{i}: {line.strip()}")
    assert not offenders, "torch imported outside commlib.nn and the apps:\n" + "\n".join(offenders)
    assert TORCH_IMPORT.search("    import torch  # noqa") and TORCH_IMPORT.search("from torch.nn import F")
    assert not TORCH_IMPORT.search("import torchvision") and not TORCH_IMPORT.search("# torch is imported")


# ------------------------------------------------- the Transport ABC is the contract
#: receivers that hold a transport in the package's code (a name, or an attribute of that name)
_TRANSPORT_NAMES = frozenset(("tp", "tr", "transport", "_transport", "coll", "user", "_coll_tp"))
#: read only by the ``mpi_comm`` interop properties (a user's mpi4py code gets the MPI.Comm)
_INTEROP = {"comm": "mpi_comm"}
#: the elastic peer builds its epoch's TCP transport and attaches the links it accepted or
#: dialed: the owner's set-up, as the communicator builds its MPI transport (file, attribute)
_OWNER = {("commlib/elastic/peer.py", "epoch"), ("commlib/elastic/peer.py", "attach")}
TOPOLOGY_CALL = re.compile(r"\.(Get_topo|Get_cart_rank|Get_coords|Shift|Compute_dims|Create_dims|Dims_create)\(")


def _contract_names():
    from commlib.transports.base import Transport

    class _Probe(Transport):  # the instance attributes the base sets (tags)
        rank = size = 0

        def isend(self, *a):  # pragma: no cover
            pass

        def irecv(self, *a):  # pragma: no cover
            pass

    return {n for n in dir(Transport) if not n.startswith("_")} | set(vars(_Probe()))


def _transport_uses(tree):
    """``(line, attribute, enclosing function)`` for each attribute read on a transport receiver."""
    import ast

    out = []

    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            f = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Attribute):
                v = child.value
                recv = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
                if recv in _TRANSPORT_NAMES:
                    out.append((child.lineno, child.attr, f))
            walk(child, f)

    walk(tree, None)
    return out


def _contract_offenders(sources, allowed):
    import ast

    offenders = []
    for path, text in sources:
        for line, attr, fn in _transport_uses(ast.parse(text)):
            if (attr.startswith("__") or attr in allowed or _INTEROP.get(attr) == fn
                    or any(path.endswith(f) and attr == a for f, a in _OWNER)):
                continue
            offenders.append(f"{path}:{line}: .{attr} (in {fn})")
    return offenders


def test_callers_use_only_the_transport_contract():
    """Above ``commlib.transports`` a transport is used only through what the
    ``Transport`` ABC declares (docs/architecture.md, "Where new things go"):
    no MPI- or TCP-only method, so a new transport works wherever the contract
    is met; grid queries go through the transport too, and no module reaches
    a transport module by a name string."""
    transports = os.path.realpath(_layer_dirs()["transports"])
    sources = []
    strings, topo = [], []
    for _, path in _sources():
        if path.startswith(transports + os.sep):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        sources.append((path, text))
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"[\"']commlib\.transports\.\w+[\"']", code):
                strings.append(f"{path}:{i}: {line.strip()}")
            if TOPOLOGY_CALL.search(code):
                topo.append(f"{path}:{i}: {line.strip()}")
    offenders = _contract_offenders(sources, _contract_names())
    assert not offenders, "transport methods outside the Transport contract:\n" + "\n".join(offenders)
    assert not strings, "a transport module reached by a name string:\n" + "\n".join(strings)
    assert not topo, "grid (topology) calls outside commlib.transports:\n" + "\n".join(topo)


def test_contract_scan_catches_a_leak():
    """The scan above finds an MPI-only call on a transport (the test can fail)."""
    code = ("def f(comm):\n    comm.transport.set_errors_return()\n    tp = comm.transport\n"
            "    tp.comm.Barrier()\n    tp.tcp_only_thing(3)\n    return tp.isend\n"
            "def mpi_comm(self):\n    return self.transport.comm\n")
    got = _contract_offenders([("x.py", code)], _contract_names())
    assert [g.split(": ")[1] for g in got] == [".comm (in f)", ".tcp_only_thing (in f)"], got
    assert TOPOLOGY_CALL.search("self.mpi_comm.Get_coords(3)") and not TOPOLOGY_CALL.search("tp.cart_shift(0, 1)")


#: the largest source file of the package, lines (issue 41: one concern a file)
MAX_LINES = 800


def _private_imports(path: str) -> list[str]:
    """``from M import _name`` of a private *name* of another module in ``path``
    (a private submodule of a package, ``from . import _host``, is allowed: its
    package is its scope)."""
    import ast

    tree = ast.parse(open(path).read(), path)
    out = []
    here = os.path.dirname(path)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            if node.level:
                pkg = here
                for _ in range(node.level - 1):
                    pkg = os.path.dirname(pkg)
                pkg = os.path.join(pkg, *(node.module or "").split(".")) if node.module else pkg
                if os.path.exists(os.path.join(pkg, name + ".py")) or os.path.isdir(os.path.join(pkg, name)):
                    continue  # a private submodule of that package
            else:
                try:
                    if importlib.util.find_spec(f"{node.module}.{name}") is not None:
                        continue  # a private submodule, named absolutely
                except (ImportError, ValueError):
                    pass
            out.append(f"{os.path.basename(path)}:{node.lineno}: from {'.' * node.level}{node.module or ''} "
                       f"import {name}")
    return out


def test_files_and_private_names():
    """No source file over MAX_LINES lines; no private name imported across modules."""
    long = [f"{p} ({n} lines)" for _, p in _sources() if (n := sum(1 for _ in open(p))) > MAX_LINES]
    assert not long, f"source files over {MAX_LINES} lines: {long}"
    private = [hit for _, p in _sources() for hit in _private_imports(p)]
    assert not private, f"private names imported across modules: {private}"


def test_private_import_scan_catches_one(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from commlib.typed_p2p import _MPITypes\nfrom . import _helper\n")
    (tmp_path / "_helper.py").write_text("")
    assert _private_imports(str(bad)) == ["m.py:1: from commlib.typed_p2p import _MPITypes"]
