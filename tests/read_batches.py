"""Run by tests/test_scale.py under common.launch: each process builds its rows of a few
batches from a gs:// data folder and from the same folder on disk, and checks that they are
bitwise equal. Batches are a pure function of (seed, step), so the bucket changes nothing."""
import sys

from common import multislice

multislice.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from common.data import DataConfig, get_batch, load_dataset  # noqa: E402

remote, local, steps, batch_size, seq_len = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data", None))
r, l = load_dataset(DataConfig(path=remote)), load_dataset(DataConfig(path=local))
for step in range(steps):
    a, b = (get_batch(ds.train, seed=0, step=step, batch_size=batch_size, seq_len=seq_len,
                      sharding=sharding) for ds in (r, l))
    for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
        assert x.index == y.index and np.array_equal(np.asarray(x.data), np.asarray(y.data))
print(f"process {jax.process_index()}: {steps} batches equal", flush=True)
