"""torchrun, started by ``hetplan run`` while the launcher is still checking the plan.

    python -m hetplan.runtime.torchrun_gate torch.distributed.run [torchrun's arguments]

The process imports torchrun (and with it torch: about 3 s of CPU) at once, then waits for
one line on its stdin. ``go`` runs torchrun's ``main`` with the arguments, exactly as
``python -m torch.distributed.run`` would; anything else (end of file: the launcher refused
the plan, or died) ends the process with code 0 before torchrun has parsed an argument,
printed a line or started a rank.

Why: the launcher's preflight (:func:`hetplan.runtime.launch.preflight`) imports torch and
captures the model on one core; torchrun's own torch import used to start only after it. On
a machine with a second core the two now overlap, and the ranks start about 3 s sooner. No
rank starts before the preflight has passed: the launcher writes ``go`` only then.
"""

from __future__ import annotations

import sys

#: The module this gate runs; its name stays on the command line, where tools (and the fault
#: tests) find torchrun's process.
TORCHRUN = "torch.distributed.run"


def main() -> None:
    if sys.argv[1:2] != [TORCHRUN]:
        print(f"usage: python -m hetplan.runtime.torchrun_gate {TORCHRUN} [torchrun's "
              "arguments]; started by `hetplan run`, which writes 'go' on stdin",
              file=sys.stderr)
        raise SystemExit(2)
    import torch.distributed.run as torchrun  # the seconds this gate exists to overlap

    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)  # refused before any rank could start
    sys.argv = [torchrun.__file__ or TORCHRUN, *sys.argv[2:]]
    torchrun.main()


if __name__ == "__main__":
    main()
