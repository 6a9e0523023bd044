"""The pass manager: runs a pass list in order, enforces each pass's sections, logs it, and
names the pass that failed.

After every pass the manager checks that the plan differs from the one the pass was given
only in the sections the pass declares (``Pass.sections``); anything else is a
:class:`~hetplan.errors.PassError` naming the pass, the section and the first field that
changed. The plan the passes leave is then validated as a whole, once: every section from
its dump, then the plan's cross-section rules (a 3072-rank plan's TP groups and per-rank
predictions are validated once per pipeline, not once per pass, which was a fifth of a
large search's time). Each pass is handed the plan the previous one returned, not
validated yet: a pass after one that left an invalid plan runs on it, and whatever it
raises is reported as the earlier pass's invalid plan (below).

When that validation fails, or a pass raises, the manager re-validates the plan after each
pass in turn, as it would had it validated after every pass, and reports the first plan
that fails, naming the pass that left it; only when all of them pass is the pass's own
error reported. So a pass that leaves an invalid plan is named exactly as before. What is
not reported: a plan one pass leaves invalid and a later pass repairs, since only the
pipeline's result is used (``docs/decisions.md``, "One validation per pass pipeline").

A failure inside a pass is re-raised with the pass named: a hetplan error keeps its class and
its attributes (e.g. :attr:`TraceError.module`), any other exception becomes a ``PassError``;
both chain the original (``raise … from e``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hetplan.errors import HetplanError, PassError
from hetplan.ir.plan import Plan
from hetplan.ir.plan_sections import PassLogEntry
from hetplan.passes.base import Pass, PassContext

__all__ = ["run_passes", "check_sections"]

def _first_difference(a: Any, b: Any, path: str) -> str:
    """The path of the first value that differs between two dumped plan fields."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length {len(a)} -> {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return path


def check_sections(p: Pass, before: Plan, after: Plan) -> None:
    """Raise PassError if ``after`` differs from ``before`` outside ``p.sections``."""
    allowed = set(p.sections)
    for name in Plan.model_fields:
        if name in allowed:
            continue
        old, new = getattr(before, name), getattr(after, name)
        if old is new or old == new:
            continue
        where = _first_difference(before.model_dump(mode="json").get(name),
                                  after.model_dump(mode="json").get(name), name)
        raise PassError(
            f"pass {p.name!r} changed plan section {name!r} (first at {where}), but it "
            f"declares only {sorted(allowed)}; a pass writes only its own sections: add "
            f"{name!r} to {type(p).__name__}.sections if it owns it, or leave it unchanged"
        )


def _named(e: HetplanError, note: str) -> HetplanError:
    """``e`` with ``note`` appended to its message, same class and attributes."""
    try:
        out = copy.copy(e)
    except Exception:  # noqa: BLE001 - an exception class copy cannot rebuild
        return PassError(f"{e} ({note})")
    out.args = (f"{e} ({note})",) + tuple(e.args[1:])
    return out


def _revalidate(plan: Plan, validated: Plan | None, handed: Plan | None = None) -> Plan:
    """``Plan.model_validate(plan.model_dump())``, passing as that object each field that is
    still the very object of ``validated`` (a plan that validation made), or of ``handed``
    (the plan ``validated`` was made from: the field is then ``validated``'s), which
    pydantic does not validate again; the plan-level rules run in full."""
    if validated is None:
        return Plan.model_validate(plan.model_dump())
    kept = {}
    for name in Plan.model_fields:
        field = getattr(plan, name)
        if field is getattr(validated, name) or (
                handed is not None and field is getattr(handed, name)):
            kept[name] = getattr(validated, name)
    data = plan.model_dump(exclude=set(kept))
    data.update(kept)
    return Plan.model_validate(data)


def run_passes(plan: Plan, passes: Sequence[Pass], ctx: PassContext) -> Plan:
    """Run ``passes`` in order (see module docstring).

    Raises:
        PassError: naming the failing pass and the passes that ran before it, a pass that
            wrote outside its sections, or the first pass that left an invalid plan.
        HetplanError: a user-facing error from inside a pass, with the pass named.
    """
    log = list(plan.pass_log)
    done: list[str] = []
    steps: list[tuple[Pass, Plan]] = []  # each pass and the plan it returned
    for p in passes:
        try:
            result = p.run(plan, ctx)
            check_sections(p, plan, result.plan)
        except PassError:
            _first_invalid(steps)
            raise
        except HetplanError as e:
            _first_invalid(steps)
            raise _named(e, f"in pass {p.name!r}, after {done}") from e
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            _first_invalid(steps)
            raise PassError(
                f"pass {p.name!r} failed after passes {done}: {type(e).__name__}: {e}"
            ) from e
        plan = result.plan
        steps.append((p, plan))
        log.append(PassLogEntry(name=p.name, changed=result.changed, notes=result.notes))
        done.append(p.name)
    if steps:
        try:
            plan = _revalidate(plan, None)
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            _first_invalid(steps)  # raises for the first invalid plan, normally this one
            raise PassError(f"pass {steps[-1][0].name!r} failed after passes {done[:-1]}: "
                            f"{type(e).__name__}: {e}") from e
    return plan.model_copy(update={"pass_log": tuple(log)})


def _first_invalid(steps: Sequence[tuple[Pass, Plan]]) -> None:
    """Re-validate the plan after each of ``steps`` in order, as a check after every pass
    would (each plan from the previous one's validation: only the sections a pass changed
    are validated from their dump), and raise a :class:`PassError` for the first that
    fails (nothing if none does)."""
    validated: Plan | None = None
    handed: Plan | None = None
    done: list[str] = []
    for p, after in steps:
        try:
            validated = _revalidate(after, validated, handed)
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            raise PassError(
                f"pass {p.name!r} failed after passes {done}: {type(e).__name__}: {e}"
            ) from e
        handed = after
        done.append(p.name)
