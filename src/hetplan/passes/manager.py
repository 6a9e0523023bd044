"""The pass manager: runs a pass list in order, logs it, and names the pass that failed."""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.errors import HetplanError, PassError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import PassLogEntry
from hetplan.passes.base import Pass, PassContext

__all__ = ["run_passes"]


def run_passes(plan: Plan, passes: Sequence[Pass], ctx: PassContext) -> Plan:
    """Run ``passes`` in order; each result is re-validated (a pass must leave a valid plan).

    Raises:
        PassError: naming the failing pass and the passes that ran before it.
    """
    log = list(plan.pass_log)
    done: list[str] = []
    for p in passes:
        try:
            result = p.run(plan, ctx)
            plan = Plan.model_validate(result.plan.model_dump())
        except HetplanError as e:
            if isinstance(e, PassError):
                raise
            raise type(e)(f"{e} (in pass {p.name!r}, after {done})") from e
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            raise PassError(
                f"pass {p.name!r} failed after passes {done}: {type(e).__name__}: {e}"
            ) from e
        log.append(PassLogEntry(name=p.name, changed=result.changed, notes=result.notes))
        done.append(p.name)
    return plan.model_copy(update={"pass_log": tuple(log)})
