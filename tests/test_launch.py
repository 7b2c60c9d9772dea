"""A launcher leaves no orphans: distributed.run_child, and distributed.launch, main_tensor_parallel.py
--ranks N and main_disaggregation.py, which start torchrun through it, end the command with every
process it started when the launcher gets SIGTERM, SIGINT (Ctrl+C) or SIGHUP, and then end the way that
signal ends a process. torchrun starts each worker in a session of its own, so ending torchrun's
process group alone would leave the workers running. The processes are found in /proc (Linux)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lib import distributed

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes in /proc (Linux)")

# A process of the tree: it writes its pid into DIR (a file named NAME.PID) and sleeps; "ignore" makes
# it ignore SIGTERM (only SIGKILL ends it); "spawn" starts one more such process, in a session of its own.
SLEEPER = """
import os, signal, subprocess, sys, time
from pathlib import Path
directory, name, *flags = sys.argv[1:]
if "ignore" in flags:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "spawn" in flags:
    subprocess.Popen([sys.executable, __file__, directory, name + "-child", "ignore"], start_new_session=True)
Path(directory, f"{name}.{os.getpid()}").write_text("")
time.sleep(600)
"""


def stat(pid):
    """(parent pid, start time, state) of a process, None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(pid):
    """{pid: start time} of every process below `pid`."""
    table = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := stat(p.name))}
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start, _) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def running(processes):
    """The processes of {pid: start time} still running (the same process, not a zombie)."""
    return [pid for pid, start in processes.items() if (s := stat(pid)) and s[1] == start and s[2] != "Z"]


def wait_until(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s} s")
        time.sleep(0.2)


def stop_and_check(launcher, tree, sig):
    """Send `sig` to the launcher alone (as `kill` does; a Ctrl+C reaches it alone too, its child being
    in a session of its own), then: the launcher ends as that signal ends a process, and no process of
    the tree it had started (`tree`: {pid: start time}) is left. Whatever is left is killed after."""
    try:
        launcher.send_signal(sig)
        launcher.wait(timeout=180)
        wait_until(lambda: not running(tree), 60, f"processes {running(tree)} of the launcher's tree did not end")
        assert launcher.returncode == -sig  # killed by that signal: 128 + sig in a shell
    finally:
        for pid in running(tree):  # only where the test failed: leave no orphans behind
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def start(cmd, tmp_path):
    log = open(tmp_path / "launcher.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=default_stop_signals)


def default_stop_signals():
    """The launcher's SIGINT and SIGHUP as a terminal's would be: pytest started as a background job (`&`)
    or under nohup passes them on ignored, and run_child rightly leaves an ignored signal alone."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def launcher_code(call):
    return f"import sys; sys.path.insert(0, {str(ROOT)!r}); from lib import distributed; {call}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_launch_ends_torchrun_and_its_workers(tmp_path, sig):
    """distributed.launch (torchrun, 2 workers that sleep) stopped by a signal: nothing survives it."""
    stop_and_check(*launch_two(tmp_path, SLEEPER, "worker"), sig)


def launch_two(tmp_path, code, name):
    """distributed.launch of 2 workers running `code` (each writes DIR/NAME.PID when it is ready) from a
    launcher process; once both are ready: (launcher, {pid: start time} of its tree)."""
    worker = tmp_path / "launched.py"  # not NAME.*: the ready files are counted by that pattern
    worker.write_text(code)
    launcher = start([sys.executable, "-c", launcher_code(
        f"distributed.launch({str(worker)!r}, [{str(tmp_path)!r}, {name!r}], nproc=2, timeout_s=None, "
        "capture=False)")], tmp_path)
    tree = {}

    def both_workers_ready():
        tree.update(descendants(launcher.pid))
        return len(list(tmp_path.glob(f"{name}.*"))) == 2 or launcher.poll() is not None
    try:
        wait_until(both_workers_ready, 180, "torchrun's 2 workers did not start")
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-2000:]
        tree.update(descendants(launcher.pid))
        assert len(tree) >= 3  # torchrun and its 2 workers
    except BaseException:  # leave no orphans behind a failed start
        for pid in running(tree):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
        raise
    return launcher, tree


# A rank that joins the group of 2 (distributed.init: its watch starts there), then sleeps as SLEEPER does.
RANK_SLEEPER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from lib import distributed
distributed.init("cpu")
Path(sys.argv[1], f"{{sys.argv[2]}}.{{os.getpid()}}").write_text("")
time.sleep(600)
"""


def test_a_killed_launch_leaves_neither_torchrun_nor_its_workers(tmp_path):
    """distributed.launch's caller killed by SIGKILL while its 2 ranks sleep in the group: torchrun gets
    the parent-death signal, each rank sees its launcher gone (distributed.watch_launcher) and exits."""
    stop_and_check(*launch_two(tmp_path, RANK_SLEEPER.format(root=str(ROOT)), "rank"), signal.SIGKILL)


def test_a_rank_started_by_hand_is_not_watched_and_a_watched_rank_outlives_no_launcher(tmp_path, monkeypatch):
    """watch_launcher: no thread for a rank started without torchrun or launch (its shell may end under
    nohup on purpose); a rank whose LAUNCHER_PID names a process that has ended exits at once, with a line."""
    for name in (distributed.LAUNCHER_PID, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    code = ("import sys, time; sys.path.insert(0, {root!r}); from lib import distributed; "
            "distributed.watch_launcher(); time.sleep(30); print('still here')").format(root=str(ROOT))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watched = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, distributed.LAUNCHER_PID: str(gone.pid), "RANK": "1", "WORLD_SIZE": "2"})
    assert watched.returncode == 1 and "still here" not in watched.stdout
    assert f"rank 1: its launcher (pid {gone.pid}) is gone" in watched.stderr
    unwatched = subprocess.run([sys.executable, "-c", code.replace("30", "1")], capture_output=True, text=True,
                               timeout=120)
    assert unwatched.returncode == 0 and "still here" in unwatched.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_run_child_ends_the_child_and_every_process_it_started(tmp_path, sig):
    """run_child's child starts a grandchild in a session of its own that ignores SIGTERM: both end
    (the grandchild by SIGKILL after the grace period), and the launcher ends as the signal ends it."""
    child = tmp_path / "sleeper.py"
    child.write_text(SLEEPER)
    launcher = start([sys.executable, "-c", launcher_code(
        f"distributed.run_child([sys.executable, {str(child)!r}, {str(tmp_path)!r}, 'child', 'spawn'], "
        "grace_s=2)")], tmp_path)
    wait_until(lambda: len(list(tmp_path.glob("child*.*"))) == 2 or launcher.poll() is not None, 180,
               "the child and its grandchild did not start")
    assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-2000:]
    tree = descendants(launcher.pid)
    assert len(tree) == 2
    stop_and_check(launcher, tree, sig)


@pytest.mark.parametrize("script, flags", [
    ("main_tensor_parallel.py", ["--ranks", "2", "--batch-size", "2", "--prompt-len", "8", "--n-tokens", "2"]),
    ("main_disaggregation.py", ["--n-requests", "8"]),
])
def test_a_script_that_started_torchrun_itself_and_gets_sigterm_leaves_no_process(real_data, tmp_path, script,
                                                                                   flags):
    """`python main_tensor_parallel.py --ranks 2` and `python main_disaggregation.py` (torchrun started by
    the script) stopped by SIGTERM while their 2 workers run: no process of theirs is left."""
    launcher = start([sys.executable, ROOT / script, "--untrained", *flags, "--repeats", "1000"], tmp_path)
    stop_and_check(launcher, script_workers_started(launcher, script, tmp_path), signal.SIGTERM)


@pytest.mark.parametrize("script, flags", [
    ("main_expert_parallel.py", ["--batch-sizes", "2", "--n-tokens", "8", "--repeats", "1000"]),
    ("main_pipeline_parallel.py", ["--batch-size", "2", "--micro-batches", "1", "2", "--n-tokens", "8",
                                   "--repeats", "1000"]),
])
def test_a_script_whose_launcher_is_killed_leaves_no_process(real_data, tmp_path, script, flags):
    """`timeout -s KILL 25 python main_expert_parallel.py --untrained`: SIGKILL runs no handler of the
    launcher's, yet torchrun (the kernel's parent-death signal) and its 2 workers (each watches its
    launcher) end within seconds instead of running on under PID 1."""
    launcher = start([sys.executable, ROOT / script, "--untrained", *flags], tmp_path)
    stop_and_check(launcher, script_workers_started(launcher, script, tmp_path), signal.SIGKILL)


def script_workers_started(launcher, script, tmp_path):
    """Wait until torchrun's 2 workers of `script` run below the launcher; {pid: start time} of its tree."""
    tree = {}

    def workers_started():
        tree.update(descendants(launcher.pid))
        workers = [pid for pid in running(tree) if b"torch.distributed.run" not in cmdline(pid)
                   and script.encode() in cmdline(pid)]
        return len(workers) == 2 or launcher.poll() is not None
    wait_until(workers_started, 180, "torchrun's 2 workers did not start")
    assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-2000:]
    return tree


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ----------------------------------------------------------------------------------------------------
# run_child and end_process_tree in this process.

def test_run_child_returns_the_exit_status_and_the_captured_output():
    result = distributed.run_child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                                    "sys.exit(3)"], capture=True)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_run_child_writes_to_the_files_it_is_given_and_runs_in_cwd_with_env(tmp_path):
    with open(tmp_path / "out.txt", "w") as out:
        result = distributed.run_child([sys.executable, "-c", "import os; print(os.getcwd(), os.environ['X'])"],
                                       env={**os.environ, "X": "42"}, cwd=tmp_path, stdout=out)
    assert result.returncode == 0 and result.stdout is None
    assert (tmp_path / "out.txt").read_text().split() == [str(tmp_path), "42"]


def test_run_child_refuses_capture_and_a_file_together(tmp_path):
    with pytest.raises(ValueError, match="either capture"), open(tmp_path / "x", "w") as out:
        distributed.run_child([sys.executable, "-c", "pass"], capture=True, stdout=out)


def test_run_child_past_its_timeout_ends_the_child_and_raises_timeout_expired():
    with pytest.raises(subprocess.TimeoutExpired):
        distributed.run_child([sys.executable, "-c", "import time; time.sleep(600)"], timeout_s=1, grace_s=2)


def test_end_process_tree_ends_descendants_in_sessions_of_their_own_and_those_that_ignore_sigterm(tmp_path):
    child = tmp_path / "sleeper.py"
    child.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, child, tmp_path, "child", "spawn", "ignore"], start_new_session=True)
    tree = {}
    try:
        wait_until(lambda: len(list(tmp_path.glob("child*.*"))) == 2, 180, "the child and its grandchild did not start")
        tree = descendants(proc.pid)
        assert len(tree) == 1  # the grandchild, in a session of its own
        distributed.end_process_tree(proc, grace_s=1)  # both ignore SIGTERM: SIGKILL after 1 s
        assert proc.returncode == -signal.SIGKILL
        wait_until(lambda: not running(tree), 60, "the grandchild did not end")
    finally:
        for pid in running(tree):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_reproduce_ends_the_script_it_runs(tmp_path):
    """reproduce.py runs each script as a child: SIGTERM to it ends that script too, whatever it started."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "README.md").write_text("<!-- reproduce:s:table -->\n<!-- /reproduce:s:table -->\n"
                                        "<!-- reproduce:summary:table -->\n<!-- /reproduce:summary:table -->\n"
                                        "<!-- reproduce:checkpoints:table -->\n<!-- /reproduce:checkpoints:table -->\n"
                                        "<!-- reproduce:attention_summary:table -->\n"
                                        "<!-- /reproduce:attention_summary:table -->\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "attention_summary.md").write_text("<!-- reproduce:attention_summary:table -->\n"
                                                            "<!-- /reproduce:attention_summary:table -->\n")
    (tmp_path / "pids").mkdir()
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import reproduce; "
            f"from pathlib import Path; reproduce.ROOT = Path({str(tmp_path)!r}); "
            "reproduce.RUNS = [reproduce.Run('s', 'sleeper.py', 'README.md')]; reproduce.load_average = lambda: 0.0; "
            "sys.argv[1:] = []; reproduce.main([])")
    # the script is given `pids script spawn` as flags: reproduce passes --json PATH after them, ignored
    code = code.replace("'sleeper.py', 'README.md')", f"'sleeper.py', 'README.md', args=({str(tmp_path / 'pids')!r}, "
                                                      "'script', 'spawn'))")
    launcher = start([sys.executable, "-c", code], tmp_path)
    wait_until(lambda: len(list((tmp_path / "pids").iterdir())) == 2, 120, "the script and its child did not start")
    stop_and_check(launcher, descendants(launcher.pid) | {
        int(p.suffix[1:]): stat(int(p.suffix[1:]))[1] for p in (tmp_path / "pids").iterdir() if stat(int(p.suffix[1:]))},
        signal.SIGTERM)
