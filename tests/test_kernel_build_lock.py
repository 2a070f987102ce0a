"""The kernel build never waits for ever on a lock left by a build that was killed half-way."""
import subprocess
import sys
import threading
import time

from zoo.moe.kernels import _only_builder


def test_a_stale_torch_lock_is_removed_by_the_only_builder(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with _only_builder(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_second_builder_waits_for_the_first(tmp_path):
    entered = []

    def second():
        with _only_builder(tmp_path):
            entered.append(time.perf_counter())

    with _only_builder(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        assert not entered  # blocked while the first one builds
        released = time.perf_counter()
    thread.join(timeout=30)
    assert entered and entered[0] >= released


def test_a_killed_builder_holds_nothing(tmp_path):
    # the holder imports only the lock's own code (fcntl), as a builder in another process would hold it
    code = ("import fcntl, sys, time\nf = open(sys.argv[1] + '/.zoo-builder.lock', 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
            "open(sys.argv[1] + '/lock', 'w').close()\nprint('in', flush=True)\ntime.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "in"
    holder.kill()
    holder.wait()
    done = threading.Event()
    threading.Thread(target=lambda: (_only_builder(tmp_path).__enter__(), done.set()), daemon=True).start()
    assert done.wait(timeout=10), "the lock of a dead builder was not released"
    assert not (tmp_path / "lock").exists()
