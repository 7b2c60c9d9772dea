"""What the docs and the code say about torchrun and gloo, shown with the pinned torch (2 gloo processes):

- lib/disaggregation.py's decode worker receives in a thread, because gloo's `irecv` reports completion
  only when waited on: `is_completed()` stays False after the data has arrived;
- docs/distributed.md: the ranks outside a timed variant wait in a gloo barrier, which does not spin
  (the waiting process uses next to no CPU, so it does not slow the ranks being timed);
- docs/distributed.md: the scripts' flag is --ranks, because torchrun's parser reads the script's flags
  too and refuses --nproc as an ambiguous abbreviation of its --nproc-per-node.
If one of these tests fails after an upgrade of torch, the statement it names has become wrong: update it."""
import json

import pytest

from lib import distributed
from lib.errors import GPTliteError

WORKER = """
import json, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    dist.send(torch.arange(4.0), dst=0)
    dist.barrier()  # the tensor is sent
    time.sleep(2.0)  # rank 0 waits in the next barrier meanwhile
    dist.barrier()
else:
    buf = torch.zeros(4)
    work = dist.irecv(buf, src=1)
    dist.barrier()  # rank 1 has sent it
    time.sleep(0.5)
    arrived, completed_before_wait = buf.tolist(), work.is_completed()
    work.wait()
    cpu, wall = time.process_time(), time.time()
    dist.barrier()  # about 2 s: rank 1 sleeps
    cpu, wall = time.process_time() - cpu, time.time() - wall  # process_time: every thread of this process
    json.dump(dict(arrived=arrived, completed_before_wait=completed_before_wait,
                   completed_after_wait=work.is_completed(), barrier_cpu_s=cpu, barrier_wall_s=wall),
              open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def gloo_facts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gloo")
    (folder / "worker.py").write_text(WORKER)
    out = folder / "facts.json"
    distributed.launch(folder / "worker.py", [out], nproc=2, timeout_s=300)
    return json.loads(out.read_text())


def test_gloos_irecv_reports_completion_only_when_waited_on(gloo_facts):
    assert gloo_facts["arrived"] == [0.0, 1.0, 2.0, 3.0]  # the data is in the buffer ...
    assert gloo_facts["completed_before_wait"] is False  # ... and the request does not say so
    assert gloo_facts["completed_after_wait"] is True


def test_a_rank_waiting_in_a_gloo_barrier_does_not_spin(gloo_facts):
    """CPU time, not wall time: a spinning wait would use about one core for its ~2 s; sleeping uses none."""
    assert gloo_facts["barrier_wall_s"] > 1.0  # it did wait
    assert gloo_facts["barrier_cpu_s"] < 0.25 * gloo_facts["barrier_wall_s"]


def test_torchrun_refuses_nproc_as_an_abbreviation_of_its_own_flag(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("")
    result = distributed.launch(script, ["--nproc", "2"], nproc=1, timeout_s=300)
    assert result.returncode != 0
    assert "ambiguous option: --nproc could match --nproc-per-node" in result.stderr


def test_a_bad_launch_is_not_mistaken_for_a_good_one(tmp_path):
    """The launch helper's own check: a failing worker is a nonzero exit, not a silent success."""
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)")
    assert distributed.launch(script, [], nproc=1, timeout_s=300).returncode != 0
    with pytest.raises(GPTliteError, match="exited with code"):
        distributed.relaunch(script, [], 1)
