"""The pass manager: runs a pass list in order, enforces each pass's sections, logs it, and
names the pass that failed.

After every pass the manager checks that the plan differs from the one the pass was given
only in the sections the pass declares (``Pass.sections``); anything else is a
:class:`~hetplan.errors.PassError` naming the pass, the section and the first field that
changed. The new plan is then re-validated as a whole (a pass must leave a valid plan):
every section it changed from its dump, every other one as the object the previous
re-validation already made of it (pydantic keeps a validated model instance as it is), then
the plan's cross-section rules. That is the check of dumping and validating the whole plan,
without re-validating the large sections (a 3072-rank plan's TP groups) after every pass.

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


def _revalidate(plan: Plan, validated: Plan | None) -> Plan:
    """``Plan.model_validate(plan.model_dump())``, passing each field that is still the
    very object of ``validated`` (a plan that validation made) as that object, which pydantic
    does not validate again; the plan-level rules run in full."""
    if validated is None:
        return Plan.model_validate(plan.model_dump())
    kept = {name for name in Plan.model_fields
            if getattr(plan, name) is getattr(validated, name)}
    data = plan.model_dump(exclude=kept)
    data.update({name: getattr(plan, name) for name in kept})
    return Plan.model_validate(data)


def run_passes(plan: Plan, passes: Sequence[Pass], ctx: PassContext) -> Plan:
    """Run ``passes`` in order (see module docstring).

    Raises:
        PassError: naming the failing pass and the passes that ran before it, or a pass that
            wrote outside its sections.
        HetplanError: a user-facing error from inside a pass, with the pass named.
    """
    log = list(plan.pass_log)
    done: list[str] = []
    validated: Plan | None = None  # the last plan this loop re-validated
    for p in passes:
        try:
            result = p.run(plan, ctx)
            check_sections(p, plan, result.plan)
            plan = validated = _revalidate(result.plan, validated)
        except PassError:
            raise
        except HetplanError as e:
            raise _named(e, f"in pass {p.name!r}, after {done}") from e
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            raise PassError(
                f"pass {p.name!r} failed after passes {done}: {type(e).__name__}: {e}"
            ) from e
        log.append(PassLogEntry(name=p.name, changed=result.changed, notes=result.notes))
        done.append(p.name)
    return plan.model_copy(update={"pass_log": tuple(log)})
