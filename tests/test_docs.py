"""The documentation site: its guides run as written, its tables match their JSON, and it builds.

Guides (``docs/*.md``, ``docs/guides/*.md``) mark each code block that runs with an HTML comment on
the line before the fence, which Markdown does not show:

    <!-- run: mpiexec -n 2 python -->      the block, saved as a file, run under this command
    <!-- run: python -->                   on one process
    <!-- no-run: why -->                   a fragment or a cluster command, shown and not run

Every ``python`` block carries one of them. ``mpiexec`` gets ``--allow-run-as-root
--oversubscribe`` added here (a root shell, 2 cores); a block needing torch is skipped where
torch is not installed. Each block is bounded in time (``TIMEOUT``).

The site itself builds with warnings as errors (``-W``: a broken cross-reference, a public name
without a docstring, a malformed page), and every link between its pages and to its images
resolves (``docs/check_links.py`` over the built HTML).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TIMEOUT = 90
MARK = re.compile(r"<!--\s*(run|no-run):?\s*(.*?)\s*-->\s*\n```(\w*)[^\n]*\n(.*?)\n```", re.S)
FENCE = re.compile(r"^```python", re.M)


def _excluded():
    """The Markdown files docs/conf.py leaves out of the site (its ``exclude_patterns``)."""
    tree = ast.parse((DOCS / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "exclude_patterns" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def pages():
    """The site's Markdown pages."""
    skip = _excluded()
    return sorted(p for p in [*DOCS.glob("*.md"), *DOCS.glob("guides/*.md")]
                  if str(p.relative_to(DOCS)) not in skip)


def blocks():
    """``[(page, index, command, code)]`` of the blocks marked to run."""
    out = []
    for page in pages():
        text = page.read_text()
        for i, m in enumerate(m for m in MARK.finditer(text) if m.group(1) == "run"):
            out.append((page, i, m.group(2), m.group(4)))
    return out


def test_every_python_block_is_marked():
    unmarked = []
    for page in pages():
        text = page.read_text()
        marked = {m.start(3) - 3 for m in MARK.finditer(text)}  # the fence's position
        for f in FENCE.finditer(text):
            if f.start() not in marked:
                line = text.count("\n", 0, f.start()) + 1
                unmarked.append(f"{page.relative_to(ROOT)}:{line}")
    assert not unmarked, f"python blocks without a <!-- run: ... --> or <!-- no-run: ... --> line: {unmarked}"


@pytest.mark.parametrize("page,index,command,code", blocks(),
                         ids=[f"{p.stem}-{i}" for p, i, _, _ in blocks()])
def test_guide_block_runs(page, index, command, code, tmp_path):
    if ("torch" in code) and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    if ("sklearn" in code or "diloco" in code) and importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed")
    src = tmp_path / f"{page.stem}_{index}.py"
    src.write_text(code + "\n")
    argv = command.split()
    assert argv and argv[-1] == "python" or "python" in argv, f"{page.name}: a run command names python: {command!r}"
    if argv[0] == "mpiexec":
        argv[1:1] = ["--allow-run-as-root", "--oversubscribe"]
    argv = [sys.executable if a == "python" else a for a in argv]
    at = argv.index(sys.executable) + 1
    argv[at:at] = ["-P"]
    argv.append(str(src))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl=os.environ.get("OMPI_MCA_btl", "^ofi"))
    if "--with-ft" in argv:
        env.pop("OMPI_MCA_btl")  # the launch line names its BTLs
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{page.name} block {index} ({command}) did not finish in {TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{page.name} block {index} ({command}) exited {p.returncode}:\n{out[-4000:]}"
    print(f"{page.name} block {index}: {time.monotonic() - t0:.1f} s")


def test_tables_match_their_json():
    p = subprocess.run([sys.executable, "-P", str(DOCS / "make_tables.py"), "check"], capture_output=True, text=True,
                       cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


def test_site_builds_without_warnings_and_its_links_resolve(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("furo")
    out = tmp_path / "html"
    p = subprocess.run([sys.executable, "-P", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(DOCS), str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert p.returncode == 0, f"the site's build failed:\n{(p.stdout + p.stderr)[-6000:]}"
    p = subprocess.run([sys.executable, "-P", str(DOCS / "check_links.py"), str(out)], capture_output=True, text=True,
                       cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    # every exported name is on a page of the API reference (the inventory of documented objects)
    from sphinx.util.inventory import InventoryFile  # noqa: PLC0415 - sphinx is optional above
    with open(out / "objects.inv", "rb") as fh:
        inv = InventoryFile.load(fh, "", lambda base, uri: uri)
    documented = {name for objs in (inv.data if hasattr(inv, "data") else inv).values() for name in objs}
    missing = []
    for modname in ("commlib", "commlib.nn", "commlib.elastic", "commlib.collectives", "commlib.datatypes"):
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            same = [f"{m}.{name}" for m in ("commlib", modname) if getattr(importlib.import_module(m), name, None)
                    is getattr(mod, name)]
            if not any(n in documented for n in same):
                missing.append(f"{modname}.{name}")
    assert not missing, f"exported but not in the API reference: {missing}"
