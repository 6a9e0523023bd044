"""How the operating system schedules a CPU rank: as it is (default), or as a batch task
(Linux ``SCHED_BATCH``) with ``HETPLAN_CPU_SCHED=batch``.

A CPU rank (gloo on CPU devices) that sends a message wakes the rank waiting for it. Under
Linux's default policy the woken process may preempt the sender at once, so on a host with
more ranks than cores (the CPU presets' machine runs 4 gloo processes on 2 cores) a send of a
few tens of KiB can cost the sender its core for milliseconds, and every hand-over becomes a
round of context switches. ``SCHED_BATCH`` keeps the fair scheduler and its time slices but
marks the task as a throughput job: a wake-up does not preempt the running task, which keeps
its core until it blocks or its slice ends.

Measured on that machine (``docs/decisions/cpu-sched.md``; one run of each plan under each
policy), batch made the runtime's ZeRO-3, tensor-parallel and interleaved steps 1.3-1.75x
faster, and a plain pipeline's no faster (its hand-overs wait for the sender to block). It
stays opt-in: the cost model's CPU records (``hetplan profile``'s hand-overs) were measured
under the default policy, and a profile taken under batch does not predict runs under batch
as well (the same document).

``HETPLAN_CPU_SCHED``: ``normal`` (default; the process keeps the policy it was started with)
or ``batch``. The runtime's workers (:mod:`hetplan.runtime.worker`), the profiler's
processes and ``hetplan profile``'s own process (:mod:`hetplan.profiling`, which times layers
in it by default) all apply it before they join a process group, so a profile and a run under
the same value measure the same thing. GPU ranks are left alone. On a system without
``SCHED_BATCH`` (not Linux) nothing changes.
"""

from __future__ import annotations

import os

from hetplan.errors import SpecError

__all__ = ["ENV", "POLICIES", "apply_cpu_sched", "cpu_sched_policy", "current_cpu_sched"]

#: The environment variable that chooses the policy.
ENV = "HETPLAN_CPU_SCHED"
#: The policies it may name; the first is the default.
POLICIES: tuple[str, ...] = ("normal", "batch")


def cpu_sched_policy(environ: dict[str, str] | None = None) -> str:
    """The policy ``HETPLAN_CPU_SCHED`` asks for (``normal`` when unset or empty).

    Raises:
        SpecError: any other value, naming the variable and the values it takes.

    Example:
        >>> cpu_sched_policy({}), cpu_sched_policy({"HETPLAN_CPU_SCHED": "Batch"})
        ('normal', 'batch')
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip().lower() or POLICIES[0]
    if value not in POLICIES:
        raise SpecError(f"{ENV}={env.get(ENV)!r}: use one of {', '.join(POLICIES)} (normal, the "
                        "default, leaves the operating system's policy; batch schedules CPU "
                        "ranks as Linux batch tasks)")
    return value


def apply_cpu_sched(policy: str | None = None) -> str:
    """Schedule this process (and the threads it starts from now on) under ``policy``
    (default: :func:`cpu_sched_policy`); call it before the process group starts its threads.

    Returns:
        What now holds (:func:`current_cpu_sched`); ``unsupported`` where the system has no
        ``SCHED_BATCH`` (the process keeps its policy).
    """
    policy = cpu_sched_policy() if policy is None else policy
    if policy not in POLICIES:
        raise SpecError(f"apply_cpu_sched(policy={policy!r}): use one of "
                        f"{', '.join(POLICIES)}")
    if policy == "normal":  # the policy the process was started with
        return current_cpu_sched()
    batch = getattr(os, "SCHED_BATCH", None)
    setter = getattr(os, "sched_setscheduler", None)
    if batch is None or setter is None:
        return "unsupported"
    if os.sched_getscheduler(0) != batch:
        try:
            setter(0, batch, os.sched_param(0))
        except OSError as e:  # e.g. a container's seccomp profile refuses it
            raise SpecError(f"{ENV}=batch: this system refuses the batch policy ({e}); unset "
                            f"{ENV} or set it to normal") from e
    return policy


def current_cpu_sched() -> str:
    """This process's policy as :func:`apply_cpu_sched` names it (``other`` for a policy
    neither of its two, e.g. a real-time one set from outside)."""
    getter = getattr(os, "sched_getscheduler", None)
    if getter is None or not hasattr(os, "SCHED_BATCH"):
        return "unsupported"
    now = getter(0)
    return {os.SCHED_BATCH: "batch", os.SCHED_OTHER: "normal"}.get(now, "other")
