"""Processes that die with the process they belong to, and one trainer per folder."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipelines.errors import OutputError
from pipelines.lifetime import FolderLock, alive, owner_beyond_shells

from .conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals and /proc are Linux's")


def _python(code: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_process_dies_with_the_one_it_watches_however_that_one_dies():
    for how in (signal.SIGKILL, signal.SIGTERM):
        watched = _python("import time; time.sleep(60)")
        watcher = _python(f"""
            import time
            from pipelines.lifetime import die_with
            die_with({watched.pid})
            print("watching", flush=True)
            time.sleep(60)
        """)
        assert watcher.stdout.readline().strip() == "watching"
        os.kill(watched.pid, how)
        watched.wait(timeout=10)
        assert _gone_within(watcher.pid, 5)
        assert watcher.wait(timeout=10) == -signal.SIGKILL


def test_watching_a_process_that_is_already_gone_kills_at_once():
    gone = _python("pass")
    gone.wait(timeout=30)
    watcher = _python(f"""
        import time
        from pipelines.lifetime import die_with
        die_with({gone.pid})
        print("still here", flush=True)
        time.sleep(60)
    """)
    assert watcher.wait(timeout=30) == -signal.SIGKILL
    assert "still here" not in watcher.stdout.read()


def test_a_launched_process_whose_launcher_is_already_gone_dies_at_once():
    """The launcher's pid is not this process's parent: it was handed on before the link was made."""
    child = subprocess.Popen([sys.executable, "-m", "pipelines.lifetime", "--die-with", "1", "json.tool", "--help"],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # pid 1 is not its parent
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert child.stdout.read() == ""


def test_a_launched_process_runs_its_module_with_its_arguments(tmp_path):
    (tmp_path / "in.json").write_text('{"a": [1, 2]}')
    done = subprocess.run([sys.executable, "-m", "pipelines.lifetime", "--die-with", str(os.getpid()), "json.tool",
                           "--compact", str(tmp_path / "in.json")], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"a":[1,2]}\n'


def test_a_launched_process_dies_with_its_launcher_while_its_module_is_still_importing(tmp_path):
    """A stage module imports torch first (seconds of CPU, more on a loaded machine): the link to the
    launcher is in place before that import, so a launcher killed then takes the process with it."""
    importing = tmp_path / "importing"
    (tmp_path / "slow_import.py").write_text(f"import time\nopen({str(importing)!r}, 'w').close()\ntime.sleep(60)\n")
    launcher = _python(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-m", "pipelines.lifetime", "--die-with", str(os.getpid()),
                                  "slow_import"], env={{**os.environ, "PYTHONPATH": {str(REPO)!r} + ":" + {str(tmp_path)!r}}})
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    child = int(launcher.stdout.readline())
    deadline = time.monotonic() + 30
    while not importing.exists():  # the child is in its module's import
        assert time.monotonic() < deadline and alive(child)
        time.sleep(0.05)
    launcher.kill()
    launcher.wait(timeout=10)
    assert _gone_within(child, 5)


def test_the_owner_of_a_command_is_found_beyond_the_shells_that_run_it():
    owner = _python("""
        import subprocess, sys
        subprocess.run(["sh", "-c", "sh -c 'sleep 30; true'; true"])
    """)
    deadline = time.monotonic() + 10
    sleeper = None
    while sleeper is None and time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", b"30"] and _ancestor(int(pid), owner.pid):
                sleeper = int(pid)
        time.sleep(0.05)
    try:
        assert sleeper is not None and owner_beyond_shells(sleeper) == owner.pid
    finally:
        owner.kill()
        owner.wait()
        if sleeper:
            os.kill(sleeper, signal.SIGKILL)


def _ancestor(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def test_a_second_trainer_on_the_same_folder_is_refused_until_the_first_dies(tmp_path):
    holder = _python(f"""
        import time
        from pipelines.lifetime import FolderLock
        FolderLock({str(tmp_path)!r}, job="job-a").acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(OutputError, match=rf"^{tmp_path}: another training run is using this folder \(pid "
                                          rf"{holder.pid} on .*\); wait for it to end or stop it"):
        FolderLock(tmp_path, job="job-b").acquire()
    started = time.monotonic()
    with pytest.raises(OutputError):  # the same job waits for a while first (an elastic restart)
        FolderLock(tmp_path, job="job-a", same_job_wait_s=0.5).acquire()
    assert time.monotonic() - started >= 0.5
    holder.kill()  # however the holder dies, the kernel releases its lock
    holder.wait()
    lock = FolderLock(tmp_path, job="job-b").acquire()
    lock.release()
    with FolderLock(tmp_path):
        pass
