"""A stand-in for mpi4py that cannot be imported.

``tests/run.sh`` puts this folder first on ``PYTHONPATH`` for the elastic stage
(``tests/test_elastic_no_mpi.py``, ``test_elastic.py``, ``test_diloco.py``,
``test_tcp.py``): the elastic layer, its TCP transport and the DiLoCo app must
work where mpi4py is not installed, and any ``import mpi4py`` or
``from mpi4py import MPI`` on their path fails the stage loudly.
"""
raise ImportError("mpi4py blocked for this test (tests/no_mpi: the elastic layer must run without MPI)")
