"""Sphinx configuration of commlib's documentation site (see docs/README.md).

Build from the repository root, against the installed package:

    pip install ".[docs]"            # or the test extra, which includes it
    python -P -m sphinx -W --keep-going -b html docs docs/_build/html

``-P`` keeps the checkout's ``commlib/`` folder off ``sys.path``: autodoc
imports the installed ``commlib``, whose subpackages setup.py assembles from
the top-level folders.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() not in (HERE.parent, HERE)]

project = "commlib"
author = "the commlib developers"
copyright = "the commlib developers"  # noqa: A001 - Sphinx's name
release = version = importlib.import_module("commlib").__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# README.md is the docs' own README (how to build); results/*.md are included by performance.md
exclude_patterns = ["_build", "README.md", "results/*.md",
                    "upstream-ompi-tcp-fin-wedge.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "commlib"
html_static_path = ["_static"]
html_css_files = ["commlib.css"]
copybutton_prompt_text = r"\$ "
copybutton_prompt_is_regexp = True

# -- autodoc -------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}  # bases: _bases below
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_preprocess_types = False

# Every cross-reference must resolve (-W turns a broken one into an error). The site is
# built without network access, so there are no intersphinx inventories for numpy, torch,
# mpi4py or the standard library: references to their types are left unresolved on
# purpose, by the patterns below, and nothing else is.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:class", r"c10d::.*"),  # torch's C++ Work type, in the signatures torch's stubs give
    (r"py:.*", r"(np|numpy|torch|datetime|mpi4py|MPI|cupy|numba|dist|concurrent|collections|typing|"
               r"threading|socket|ssl|os|pathlib|enum|abc|contextlib|types|array|io|argparse)\..*"),
    (r"py:(class|obj|data)", r"(int|float|str|bytes|bytearray|bool|object|tuple|list|dict|set|"
                             r"frozenset|callable|Callable|Any|Optional|Union|Sequence|Iterable|"
                             r"Iterator|Mapping|None|memoryview|type|slice|complex|TypeVar|Path|Future|"
                             r"Exception|BaseException|ValueError|RuntimeError|TimeoutError|"
                             r"ConnectionError|OSError|TypeError|KeyError|NotImplementedError|"
                             r"BufferError|PermissionError|ArithmeticError|Literal|Self)"),
]

# -- every public name has a docstring ------------------------------------------------------
#: the packages whose ``__all__`` the API reference covers, each name documented
PUBLIC = ["commlib", "commlib.nn", "commlib.elastic", "commlib.collectives", "commlib.datatypes"]


def undocumented(modules=PUBLIC):
    """``[(module, name), ...]``: public names without a docstring (data: without a ``#:`` comment)."""
    missing = []
    for modname in modules:
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj) or callable(obj):
                doc = inspect.getdoc(obj)
                if inspect.isclass(obj) and doc and any(doc == inspect.getdoc(b) for b in obj.__mro__[1:]):
                    doc = None  # inherited from a base class: not its own
                if not (doc and doc.strip()):
                    missing.append((modname, name))
                continue
            # data: a "#:" comment where it is defined (or re-exported)
            if not _data_doc(mod, name):
                missing.append((modname, name))
    return missing


def _data_doc(mod, name):
    """The ``#:`` comment of a module-level constant, where it is defined or re-exported ([] if none)."""
    for src in [mod.__name__, *_defining_modules(mod, name)]:
        try:
            docs = ModuleAnalyzer.for_module(src).find_attr_docs()
        except Exception:  # noqa: BLE001 - no source: look further
            continue
        for key, lines in docs.items():
            if key[1] == name and "".join(lines).strip():
                return [line for line in lines if line is not None]
    return []


class PublicData(SphinxDirective):
    """``.. public-data:: MODULE``: the constants of ``MODULE.__all__``, with their ``#:`` comments.

    autodoc documents a re-exported constant only where its comment is (the defining module);
    this lists each under the name users import it by.
    """

    required_arguments = 1

    def run(self):
        mod = importlib.import_module(self.arguments[0])
        out = []
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj) or callable(obj):
                continue
            value = repr(obj) if isinstance(obj, (int, float, str, bool, tuple)) else type(obj).__name__
            out += [f".. py:data:: {name}", f"   :module: {mod.__name__}", f"   :value: {value}", ""]
            out += [f"   {line}" for line in _data_doc(mod, name)] + [""]
        return self.parse_text_to_nodes("\n".join(out))


def _defining_modules(mod, name):
    """Submodules of ``mod`` that bind ``name`` at top level (where a constant's "#:" lives)."""
    out = []
    prefix = mod.__name__ + "."
    for modname, m in list(sys.modules.items()):
        if m is not None and modname.startswith(prefix.split(".")[0]) and name in vars(m):
            out.append(modname)
    return out


def _check_public_docs(app):
    log = logging.getLogger("commlib.docs")
    for modname, name in undocumented():
        log.warning("public name %s.%s has no docstring", modname, name)




# -- references to internal paths -----------------------------------------------------------
# Docstrings name objects where they are defined (``commlib.nn.ring.ring_attention``); the
# reference shows them where they are exported (``commlib.nn.ring_attention``). A reference
# to an object that exists but is not part of the public API (``commlib.core.seconds.Deadline``)
# is shown as code, without a link. A reference to nothing (a renamed or removed object) is
# left to Sphinx, which warns: under -W the build fails.

def _lookup(path):
    """The object a dotted path names (module, then attributes), or raise LookupError."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module: try a shorter prefix
            continue
        for j, attr in enumerate(parts[i:]):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                # an instance attribute a class declares (dataclass field, annotation, slot)
                last = j == len(parts[i:]) - 1
                if last and inspect.isclass(obj) and _declares(obj, attr):
                    return _InstanceAttribute(obj, attr)
                raise LookupError(path) from None
        return obj
    raise LookupError(path)


def _declares(cls, attr):
    """Whether ``cls`` declares instance attribute ``attr`` (annotation, slot, ``self.attr =``)."""
    for k in cls.__mro__:
        if attr in getattr(k, "__annotations__", {}) or attr in getattr(k, "__slots__", ()):
            return True
        try:
            src = inspect.getsource(k)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\b\s*[=,:]", src):
            return True
    return False


class _InstanceAttribute:
    """An attribute a class declares but holds only on instances (never public by itself)."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name


def _candidates(target, module, klass):
    target = target.lstrip("~.")
    out = [target]
    if module:
        if klass:
            out.append(f"{module}.{klass}.{target}")
        out.append(f"{module}.{target}")
        parent = module.rsplit(".", 1)[0]
        out.append(f"{parent}.{target}")
    # a name relative to some module of commlib's (``Layout.local_seq_len``, ``group.ElasticGroup``)
    out += [f"{name}.{target}" for name in sorted(sys.modules) if name.startswith("commlib.")]
    return out


def _public_index(env):
    """{id(object): (objtype, documented name)} for every object the site documents."""
    index = {}
    for name, entry in env.domaindata["py"]["objects"].items():
        if getattr(entry, "aliased", False):
            continue
        try:
            obj = _lookup(name)
        except LookupError:
            continue
        index.setdefault(id(obj), (entry.objtype, name))
    return index


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    from sphinx.util.nodes import make_refnode  # noqa: PLC0415

    target = node["reftarget"]
    for cand in _candidates(target, node.get("py:module"), node.get("py:class")):
        if not cand.startswith("commlib"):
            continue
        try:
            obj = _lookup(cand)
        except LookupError:
            continue
        if not hasattr(env, "_commlib_public"):
            env._commlib_public = _public_index(env)
        hit = env._commlib_public.get(id(obj))
        if hit is not None and not isinstance(obj, (int, float, str, bool, tuple)):
            objtype, name = hit
            entry = env.domaindata["py"]["objects"][name]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)
        return contnode  # exists, not public: shown as written, no link
    return None


def _nn_init(app, env, docnames):
    if hasattr(env, "_commlib_public"):
        del env._commlib_public


def _bases(app, what, name, obj, options, lines):
    """A "Bases:" line for a class with a base other than ``object`` (none for the others)."""
    if what not in ("class", "exception") or not inspect.isclass(obj):
        return
    bases = [b for b in obj.__bases__ if b is not object]
    if bases:
        refs = [f"``{b.__qualname__}``" if b.__module__ == "builtins" else f":class:`~{b.__module__}.{b.__qualname__}`"
                for b in bases]
        lines[:0] = ["Bases: " + ", ".join(refs), ""]


def setup(app):
    app.add_directive("public-data", PublicData)
    app.connect("autodoc-process-docstring", _bases)
    app.connect("builder-inited", _check_public_docs)
    app.connect("env-before-read-docs", _nn_init)
    app.connect("missing-reference", _missing_reference)
