"""How many pytest workers `make test` starts: one per core this process may run on, at most
one per 3 GiB of the memory it may use (a worker peaked at 0.85 GiB on the heaviest files, and
its two-process tests start processes as large). In a container, its memory limit counts."""
import os


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one)."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


def workers(per_worker_gib: float = 3.0, limit_file: str = "/sys/fs/cgroup/memory.max") -> int:
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # cgroup v2: bytes, or "max" where there is no limit
        with open(limit_file) as f:
            memory = min(memory, int(f.read()))
    except (OSError, ValueError):
        pass
    return max(1, min(cores(), int(memory / 2**30 // per_worker_gib)))


if __name__ == "__main__":
    print(workers())
