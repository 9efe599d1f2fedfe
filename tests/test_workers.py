"""`make test`'s worker count (tests/workers.py)."""
import os

from tests.workers import cores, workers


def test_a_worker_per_core_within_the_memory(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")   # no container limit
    n = cores()
    monkeypatch.setattr(os, "sysconf", lambda k: {"SC_PHYS_PAGES": 2**20 * 64,  # 256 GiB
                                                  "SC_PAGE_SIZE": 4096}[k])
    assert workers(limit_file=str(limit)) == n
    limit.write_text(f"{7 * 2**30}\n")   # a container's 7 GiB: two workers at most
    assert workers(limit_file=str(limit)) == min(n, 2)
    limit.write_text(f"{2**30}\n")   # less than one worker's share: still one
    assert workers(limit_file=str(limit)) == 1
    assert workers(limit_file=str(tmp_path / "absent")) == n
