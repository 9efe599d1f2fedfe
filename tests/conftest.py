"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""
import importlib.metadata
import logging
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tests.spawn import LEGACY  # noqa: E402

# The suite's programs are tiny and compiled once or twice each: most of its time was XLA:CPU's
# LLVM optimising machine code that then ran for milliseconds. Level 0 changes no HLO pass, only
# the code generated from it (tests/test_dense.py, cold cache: 194 s -> 89 s on two cores); a
# flag of the caller's wins, and test_make_train.py trains with XLA's default, as a user does.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# JAX 0.10's XLA:CPU still has its older fusion code generator, which compiles these programs in
# about half the time (tests/test_dense.py, cold cache: 77 s -> 39 s on two cores) and runs them
# as fast; it expands a scatter (the embedding's gradient) into a loop (tests/spawn.py
# `scatter_loops`). Later jaxlibs dropped it (0.11.2 and 0.12 refuse the flag).
if importlib.metadata.version("jaxlib").startswith("0.10.") and LEGACY.split("=")[0] not in _flags:
    _flags += " " + LEGACY
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With libtpu installed, the ahead-of-time TPU compiles of two xdist workers would contend for
# libtpu's one-process lockfile; they only compile, so both may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Every program the suite compiles, small ones too, goes to the trainers' disk cache
# (common/multislice.py; the trainers alone keep only those over a second): many tests, and
# the processes they start, compile the same tiny programs. Inherited by those processes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get(
    "JAX_TRAINERS_CACHE", os.path.expanduser("~/.cache/jax_trainers")), "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The slowest files first: xdist's two workers then end on short tests, rather than one running
# a long trajectory while the other waits (test_make_train.py is ~6 min, test_unchanged.py ~3.5).
SLOW_FIRST = ("test_make_train.py", "test_unchanged.py", "test_multiprocess.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files whole


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test file, JAX's compiled programs are let go. Each one XLA:CPU keeps holds
    its code in memory mappings of its own (5,600 after test_dense.py alone, 630 once released),
    Linux allows 65,530 a process (vm.max_map_count), and a worker that kept ~1000 tests'
    programs segfaulted loading the next one inside XLA (tests/test_dense.py's chunked-loss
    test, at ~90% of the suite, in CI and here); released per file, the suite passes. Within a
    file they stay cached."""
    if nextitem is None or nextitem.path != item.path:
        import gc
        import jax
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def _processes_end_with_their_test():
    yield
    from tests.spawn import kill_spawned

    kill_spawned()


@pytest.fixture(scope="session")
def gcs_server():
    """A fake GCS bucket served from this process (tests/fake_gcs.py), and this process and
    its children pointed at it; yields the server. Skips where gcsfs is missing.

    One per test process: gcsfs keeps its client (and the server's address) for the life of
    the process, so tests share the bucket and use folders of their own.
    """
    pytest.importorskip("gcsfs", reason="pip install -e '.[test]' (gcsfs: gs:// run directories)")
    # gcsfs asks Google's auth for the bucket's type on every path and, finding no
    # credentials (the fake needs none), warns each time before doing the right thing.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    from tests.fake_gcs import FakeGCS

    server = FakeGCS(buckets=["runs-bucket"]).start()
    names = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(STORAGE_EMULATOR_HOST=server.url, TENSORSTORE_GCS_HTTP_URL=server.url,
                      GOOGLE_AUTH_TOKEN_FOR_TESTING="fake")
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="session")
def gcs(gcs_server):
    """The fake bucket's URL (see gcs_server)."""
    return "gs://runs-bucket"
