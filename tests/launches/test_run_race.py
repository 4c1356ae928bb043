"""Two `finetune train` into one run directory, in both orders, at two gaps (issue 25 item 1).

The lock (finetune.rundir.lock) is taken before preflight looks at the directory and held across
--overwrite's swap, so exactly one of the two launches and the other is refused naming the winner's PID.
Each side is a real process running finetune.run.start's prepare() and start_run() (what `finetune train`
runs) with a real torchrun launch of a stand-in runner module, which waits for the test to let it finish:
the two runs always overlap, however slowly this machine starts them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SIDE = r'''
import os, sys
from pathlib import Path
from finetune.recipe import load_recipe
from finetune.run.launch.supervision import LaunchError
from finetune.run.start import prepare, start_run

out, overwrite, fakes = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
loaded = load_recipe(Path(sys.argv[4]), ["training.max_steps=3"])
prepared = prepare(loaded, out, overwrite=overwrite, module="race_runner")
if not prepared.preflight.ok:
    prepared.release()
    print("REFUSED " + " | ".join(prepared.preflight.errors + prepared.preflight.run_dir_errors), flush=True)
    sys.exit(1)
prepared.plan.env["PYTHONPATH"] = fakes + os.pathsep + os.environ.get("PYTHONPATH", "")
try:
    outcome = start_run(prepared)
except LaunchError as exc:
    print(f"REFUSED {exc}", flush=True)
    sys.exit(1)
print(f"RAN {outcome.returncode}", flush=True)
sys.exit(outcome.returncode)
'''

RUNNER = r'''
import os, sys, time
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
with open(os.path.join(run_dir, "trained.txt"), "a") as handle:
    handle.write(f"{os.environ['FINETUNE_RUN_OWNER']} {os.environ.get('RANK')}\n")
release = os.environ["RACE_RELEASE"]
deadline = time.monotonic() + 120
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
'''


def _side(tmp_path: Path, out: Path, overwrite: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RACE_RELEASE": str(tmp_path / "release"),
           "FINETUNE_PROGRESS": "0"}
    return subprocess.Popen([sys.executable, "-c", SIDE, str(out), "1" if overwrite else "0", str(tmp_path / "fakes"),
                             str(REPO / "recipes/tiny/lora_zero3.yaml")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# Each order at one gap (every side is a process importing the launch path: ~6 CPU-s a round on 2 cores).
@pytest.mark.parametrize("first_overwrites,gap", [(False, 0.0), (True, 0.3)],
                         ids=["plain-then-overwrite", "overwrite-then-plain-0.3s-later"])
def test_two_runs_into_one_directory_one_is_refused_naming_the_other(tmp_path, first_overwrites, gap):
    (tmp_path / "fakes").mkdir()
    (tmp_path / "fakes" / "race_runner.py").write_text(RUNNER)
    out = tmp_path / "run"
    first = _side(tmp_path, out, first_overwrites)
    time.sleep(gap)
    second = _side(tmp_path, out, not first_overwrites)
    sides = {first: None, second: None}
    # The refused side exits on its own; then the winner's ranks may finish.
    deadline = time.monotonic() + 240
    while all(p.poll() is None for p in sides) and time.monotonic() < deadline:
        time.sleep(0.1)
    (tmp_path / "release").write_text("")
    for proc in sides:
        sides[proc] = (proc.wait(timeout=240), proc.stdout.read())
    results = sorted(sides.items(), key=lambda item: item[1][0])
    (winner, (code_w, out_w)), (loser, (code_l, out_l)) = results
    assert code_w == 0 and "RAN 0" in out_w, (gap, out_w, out_l)
    assert code_l == 1 and f"is in use by a live run (PID {winner.pid} on" in out_l, (gap, out_w, out_l)
    assert "Traceback" not in out_l
    owners = {line.split()[0] for line in (out / "trained.txt").read_text().splitlines()}
    assert owners == {str(winner.pid)}, (gap, owners)  # only the winner trained there
    assert (out / "logs" / "launcher.log").is_file()
    assert not list(tmp_path.glob(f".{out.name}.*")), "no partial or old directory left beside the run"
