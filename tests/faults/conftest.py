"""Fault-injection suite options and the summary table (``--fault-injections N``, ``--fault-seed S``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.driver import dump_table

CI_INJECTIONS = 5  # one of each kind of fault: a few minutes on 2 cores
CI_SEED = 1  # its points: a stopped rank 0, signals and a full disk before the last step (so there is work to resume)
OUTCOMES: list = []  # filled by the tests, printed at the end of the session


def pytest_addoption(parser):
    group = parser.getgroup("faults")
    group.addoption("--fault-injections", type=int, default=CI_INJECTIONS,
                    help=f"seeded fault injections to run (default {CI_INJECTIONS})")
    group.addoption("--fault-seed", type=int, default=CI_SEED, help="seed of the injection points")
    group.addoption("--fault-table", default=None, help="also write the summary table (markdown) to this file")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.faults)
    _idle_injections_last(items)


def idle_fault(item):
    """The item's ``fault`` parameter when it is of an idle kind (driver.IDLE_KINDS), else None."""
    from tests.faults.driver import IDLE_KINDS

    callspec = getattr(item, "callspec", None)
    fault = callspec.params.get("fault") if callspec is not None else None
    return fault if fault is not None and fault.kind in IDLE_KINDS else None


def _idle_injections_last(items) -> None:
    """Injections of an idle kind run in the background from their module's start (test_fault_injection.py): their
    checks go last within that module, so that the module's other tests run while they wait. Only the positions of
    that module's items are reordered (stably), so it stays one block and its fixtures are built once."""
    by_module: dict = {}
    for position, item in enumerate(items):
        by_module.setdefault(getattr(item, "module", None), []).append(position)
    for positions in by_module.values():
        ordered = sorted((items[p] for p in positions), key=lambda item: idle_fault(item) is not None)
        for position, item in zip(positions, ordered, strict=True):
            items[position] = item


def pytest_generate_tests(metafunc):
    if "fault" in metafunc.fixturenames:
        from tests.faults.driver import seeded_faults

        # default=: the options exist only when this conftest is loaded at start-up (pytest tests/faults ...)
        faults = seeded_faults(metafunc.config.getoption("--fault-injections", default=CI_INJECTIONS),
                               metafunc.config.getoption("--fault-seed", default=CI_SEED))
        metafunc.parametrize("fault", faults, ids=[str(f) for f in faults])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not OUTCOMES:
        return
    table = dump_table(OUTCOMES)
    terminalreporter.section("fault injection")
    terminalreporter.write_line(table)
    path = config.getoption("--fault-table", default=None) or os.environ.get("HPC_RLHF_FAULT_TABLE")
    if path:
        Path(path).write_text(table + "\n")


@pytest.fixture(scope="session")
def slurm_or_skip() -> None:
    from tests.slurm.conftest import _controller_problem

    problem = _controller_problem()
    if problem:
        pytest.skip(problem)
