"""Suite-wide fixtures: every test leaves no process behind."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import settings

pytest_plugins = ["ci_skips"]  # under CI a skip fails (tests/ci_skips.py)

# CI runs the property tests with a fixed seed, so a run is reproducible; locally they explore new inputs.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A multi-peer test runs several trainers (and their averager processes) on a machine of a few cores: one
# intra-op thread each avoids oversubscribing them, and the tests' tiny models gain nothing from more.
# Set before torch is first imported (here and in every process the tests start, which inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every process this test run starts inherits this tag, so that processes orphaned when a test killed
# their parent (a peer's DHT, averager and p2pd after SIGKILL) are still found and reaped.
TAG = "P2P_DILOCO_TEST_RUN"
os.environ[TAG] = uuid.uuid4().hex


def _ours(proc: psutil.Process, exclude: set[int]) -> bool:
    try:
        # torch's shared-memory manager is started once for the whole run (hivemind shares tensors
        # through it); killing it would abort the next shared tensor freed in this process.
        if proc.pid in exclude or proc.name() == "torch_shm_manager":
            return False
        return proc.environ().get(TAG) == os.environ[TAG]
    except psutil.Error:
        return False


def _tagged(exclude: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if _ours(p, exclude)]


@pytest.fixture(autouse=True)
def reap_children():
    """Kill any process a test started and left running (peers, DHT daemons, p2pd), orphans included."""
    me = psutil.Process()
    keep = {me.pid} | {p.pid for p in me.parents()} | {p.pid for p in me.children(recursive=True)}
    yield
    _stop(_tagged(keep))
    _fresh_mpfuture_locks(me)


def _stop(procs: list[psutil.Process]) -> None:
    """SIGTERM, 5 s, then SIGKILL."""
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


INTEGRATION = Path(__file__).parent / "integration"
"""Every test in this folder starts real processes (peers, DHT nodes, daemons, namespaces)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so that `-m processes` sees the mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every multi-process test ``processes`` (the flake gate's selection): those in tests/integration and
    those marked ``slow``. A ``long`` test is a ``slow`` one (scripts/test.sh runs it one at a time, like the
    other slow ones): a test marked long and not slow is refused, so that no selection runs a long scenario on
    both cores by mistake."""
    for item in items:
        if item.get_closest_marker("slow") or INTEGRATION in Path(str(item.path)).parents:
            item.add_marker("processes")
    wrong = [item.nodeid for item in items if item.get_closest_marker("long") and not item.get_closest_marker("slow")]
    if wrong:
        raise pytest.UsageError(f"tests marked long must be marked slow too: {', '.join(wrong)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Reap, once more at the end, every process this run started that is still running.

    ``reap_children`` runs around a test; a module-scoped fixture whose set-up failed never reached its test,
    so the processes it started outlived the run: a timed-out CLI-errors driver left a training peer behind
    that used a core for over an hour, through later test runs and benchmarks. The xdist controller is left
    out: its workers carry its tag, and each worker reaps its own here."""
    if getattr(session.config, "workerinput", None) is None and getattr(session.config.option, "numprocesses", None):
        return
    me = psutil.Process()
    _stop(_tagged({me.pid} | {p.pid for p in me.parents()}))


def _fresh_mpfuture_locks(me: psutil.Process) -> None:
    """Give this test process fresh hivemind MPFuture locks once no process forked from it is left.

    Every process forked from this one shares its MPFuture locks (multiprocessing semaphores). A child killed
    while it sends a result (the reaper above, a test's own SIGKILL, hivemind's "terminating it the hard way")
    never releases the lock, and every hivemind process started later in this process then hangs on its first
    result: seen as four DHT starts in a row timing out in one xdist worker of a CI run. With no child left,
    nothing else shares the old locks, so replacing them costs nothing; a module-scoped fixture's processes
    (children still running) keep theirs."""
    from hivemind.utils.mpfuture import MPFuture

    if MPFuture._active_pid != os.getpid():
        return  # no MPFuture backend in this process: no locks were shared
    try:
        alive = [c for c in me.children(recursive=False)
                 if c.name() != "torch_shm_manager" and c.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return  # a child changed while we looked: leave the locks, the next test looks again
    if not alive:
        MPFuture.reset_backend()
