"""torchrun, started by ``hetplan run`` while the launcher is still checking the plan.

    python -m hetplan.runtime.torchrun_gate torch.distributed.run [torchrun's arguments]

The process imports torchrun (and with it torch: about 3 s of CPU) at once, then waits for
one line on its stdin. ``go`` runs torchrun's ``main`` with the arguments, exactly as
``python -m torch.distributed.run`` would; anything else (end of file: the launcher refused
the plan, or died) ends the process with code 0 before torchrun has parsed an argument,
printed a line or started a rank. When torchrun's ``main`` has returned (or raised: printed
as an uncaught exception, code 1) the process exits with ``os._exit``, without the
interpreter's teardown of torch (about 1 s, which the launcher waited for).

Why: the launcher's preflight (:func:`hetplan.runtime.launch.preflight`) imports torch and
captures the model on one core; torchrun's own torch import used to start only after it. On
a machine with a second core the two now overlap, and the ranks start about 3 s sooner. No
rank starts before the preflight has passed: the launcher writes ``go`` only then.
"""

from __future__ import annotations

import os
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
    try:
        torchrun.main()
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        code = 1 if code is not None and not isinstance(code, int) else int(code or 0)
    except Exception:  # printed as the interpreter prints an uncaught one
        sys.excepthook(*sys.exc_info())
        code = 1
    else:
        code = 0
    # torchrun has reaped its ranks (and passed its exit barrier): leave without the
    # interpreter's teardown of torch, about 1 s the launcher would wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
