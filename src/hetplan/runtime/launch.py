"""``hetplan run``: launch torchrun with the plan's processes per node.

Single machine: ``--standalone`` with ``nproc_per_node = dp · pp · tp``. Several machines:
pass torchrun's rendezvous options after ``--`` (``--nnodes 4 --rdzv-endpoint host:29500
--rdzv-id job1``) on every node; processes per node then come from the plan's cluster (its
devices per node), or ``--nproc-per-node`` in the extra options.

Ctrl-C: torchrun runs in the same process group, receives the signal and stops every rank.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from hetplan.errors import SpecError
from hetplan.ir.plan import Plan

__all__ = ["torchrun_command", "launch", "relay_stderr"]


def torchrun_command(
    plan: Plan,
    plan_path: str | Path,
    *,
    model: str | None = None,
    module: str | None = None,
    steps: int = 10,
    report: str | Path | None = None,
    timeout_s: float = 120.0,
    torchrun_args: Sequence[str] = (),
    script: str | Path | None = None,
) -> list[str]:
    """The command line that runs ``plan`` (see module docstring). With ``script`` the
    user's training script runs instead of the synthetic-data worker; it gets
    ``--plan PATH --steps N``."""
    if plan.layout is None:
        raise SpecError(f"{plan_path}: the plan has no layout; compile it with `hetplan plan`")
    if script is not None and not Path(script).is_file():
        raise SpecError(f"training script {str(script)!r} does not exist")
    if script is None and bool(model) == bool(module):
        raise SpecError("give exactly one of --model NAME or --module pkg.mod:factory "
                        "(or --script train.py)")
    extra = list(torchrun_args)
    multi_node = any(a.startswith(("--nnodes", "--rdzv")) for a in extra)
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not any(a.startswith("--nproc") for a in extra):
        world = plan.layout.num_ranks
        per_node = world
        spec = plan.cluster.spec
        if multi_node:
            if spec is None or spec.devices_per_node is None:
                raise SpecError(
                    "multi-node run: the plan's cluster does not give one device count per "
                    "node; pass --nproc-per-node after --"
                )
            per_node = spec.devices_per_node
        cmd += ["--nproc-per-node", str(per_node)]
    if not multi_node:
        cmd += ["--standalone", "--nnodes", "1"]
    cmd += extra
    if script is not None:
        return cmd + [str(script), "--plan", str(plan_path), "--steps", str(steps)]
    cmd += ["-m", "hetplan.runtime.worker", "--plan", str(plan_path), "--steps", str(steps),
            "--timeout", str(timeout_s)]
    cmd += ["--model", model] if model else ["--module", str(module)]
    if report:
        cmd += ["--report", str(report)]
    return cmd


#: the exception line that ends the launcher's own traceback when a rank fails
_AGENT_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def relay_stderr(lines: Iterable[str], out: TextIO, keep_agent_traceback: bool = False) -> None:
    """Copy torchrun's stderr (its own and the ranks') to ``out``, without the launcher's
    Python traceback when a rank fails: the ranks print their errors, torchrun prints a
    summary box naming the failed ranks, and its ``Traceback … ChildFailedError`` says
    nothing more. Any other traceback (a user script's) is copied whole."""
    held: list[str] = []
    for line in lines:
        if held:
            held.append(line)
            if line.startswith(_AGENT_ERROR) and not keep_agent_traceback:
                held = []  # the launcher's traceback: dropped
            elif line.strip() and not line.startswith((" ", "\t", "Traceback")):
                out.writelines(held)  # another exception line: the traceback stays
                held = []
            continue
        if line.startswith("Traceback (most recent call last)"):
            held = [line]
            continue
        out.write(line)
        out.flush()
    out.writelines(held)
    out.flush()


def launch(cmd: list[str], *, keep_agent_traceback: bool = False) -> int:
    """Run the torchrun command, relaying its stderr (:func:`relay_stderr`); its exit code
    (non-zero when any rank failed; 130 after Ctrl-C, which torchrun passes to the ranks)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    try:
        relay_stderr(proc.stderr, sys.stderr, keep_agent_traceback)
        return proc.wait()
    except KeyboardInterrupt:
        try:  # torchrun got the same SIGINT: let it stop the ranks, draining its output
            _, err = proc.communicate(timeout=60)
            sys.stderr.write(err or "")
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        return 130
