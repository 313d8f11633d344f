"""The simulator's Celery tasks: thin wrappers over apps.sim.runs."""

from __future__ import annotations

from celery import shared_task

__all__ = ["run_simulation", "sweep_sim_runs"]


@shared_task(ignore_result=True, acks_late=False)
def run_simulation(pk: int) -> None:
    """Run one queued simulation in a child process held to its budgets, then start the next.
    Not acknowledged late: a simulation that took its worker down is failed by the sweep, not
    run again."""
    from apps.sim.runs import execute

    execute(pk)


@shared_task(ignore_result=True)
def sweep_sim_runs() -> None:
    """Start what waits, fail runs whose worker stopped, remove old runs."""
    from apps.sim.runs import sweep

    sweep()
