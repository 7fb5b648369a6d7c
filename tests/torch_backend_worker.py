"""One torchrun worker of tests/test_torch_backend_torchrun.py: joins the
``"commlib"`` group through torch's env:// rendezvous (no MPI: the group runs on
commlib's TCP transport) and runs every check of tests/torch_backend_checks.py,
printing ``ok NAME`` per check and ``transport NAME`` once.

    torchrun --nproc-per-node N tests/torch_backend_worker.py SEED
"""
from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib.nn  # noqa: E402,F401 - registers the backend
import torch_backend_checks as checks  # noqa: E402

torch.set_num_threads(1)
seed = int(sys.argv[1])
dist.init_process_group("commlib", timeout=datetime.timedelta(seconds=60))
comm = commlib.nn.communicator_of()
print(f"rank {dist.get_rank()} transport {type(comm).__name__} mpi4py loaded: {'mpi4py.MPI' in sys.modules}",
      flush=True)
for check in checks.ALL:
    check(seed)
    print(f"rank {dist.get_rank()} ok {check.__name__}", flush=True)
dist.destroy_process_group()
