import numpy as np
import commlib
from commlib.collectives import HaloExchange

comm = commlib.init()                                   # over MPI.COMM_WORLD
right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
a, b = np.arange(8.0), np.empty(8)
comm.sendrecv(a, right, b, left)                        # round the ring, no deadlock
rreq = comm.irecv(b, source=left, tag=3)                # requests: wait(timeout=None), test()
sreq = comm.isend(a, dest=right, tag=3)
comm.waitall([sreq, rreq])

# Cartesian grids and halo exchange (faces, edges and corners; overlap with start/wait)
cart = comm.cart_create(dims=None, periods=(True, False), ndims=2)  # dims by MPI.Compute_dims
halo = HaloExchange(cart, local_shape=(64, 64), width=1, corners=True)
u = halo.allocate(fill=cart.rank)                       # shape (66, 66): 1 ghost cell each side
req = halo.start(u)                                     # all faces packed in one kernel call
...                                                     # update the interior meanwhile
req.wait()                                              # ghost cells filled

# MPI derived datatypes, packed by commlib (byte-identical to MPI_Pack), host or GPU
from commlib import datatypes as dt
col = dt.Resized(dt.Vector(64, 1, 66, np.float64), 0, 8)     # one column, MPI's idiom
packed = dt.pack(u, col, count=2)                            # two adjacent columns
w = np.empty_like(u)
comm.sendrecv(u, right, w, left, sendtype=col, sendcount=2,  # non-contiguous send and receive;
              recvtype=col, recvcount=2)                     # the model picks MPI's engine or commlib's

# Collectives over the transport contract; bit-identical results on every rank
x = np.random.default_rng(comm.rank).random(1 << 20).astype(np.float32)
comm.allreduce(x, op="sum", algorithm="auto")           # in place; ring / recursive_doubling / "mpi"
comm.bcast(x, root=0); comm.allgather(x[:8]); comm.alltoall(np.zeros(comm.size * 4))

# Sequence-parallel attention (ring: contiguous / striped / zigzag, or Ulysses)
# q: (batch, seq, heads, head_dim); k, v: (batch, seq, kv_heads, head_dim), the global arrays
rng = np.random.default_rng(0)                          # the same global arrays on every rank
q, k, v = rng.standard_normal((1, 256, 4, 32)), *rng.standard_normal((2, 1, 256, 2, 32))
q_local, pos = commlib.shard_sequence(q, comm, "zigzag")     # this rank's chunks r and 2P-1-r
k_local, _ = commlib.shard_sequence(k, comm, "zigzag"); v_local, _ = commlib.shard_sequence(v, comm, "zigzag")
out, lse = commlib.ring_attention(q_local, k_local, v_local, comm, causal=True, layout="zigzag",
                                  seq_len=q.shape[1])   # the shards are padded where 2P does not divide it
dout = np.ones_like(out)                                # the loss's gradient with respect to out
dq, dk, dv = commlib.ring_attention_backward(q_local, k_local, v_local, out, lse, dout, comm,
                                             causal=True, layout="zigzag", seq_len=q.shape[1])
if comm.rank == 0:
    print(f"tour done on {comm.size} ranks: out {out.shape}, dq {dq.shape}")
