"""`expertmesh serve` process settings: the heap is settled once the servers are up, and
plans go to a planner process unless told otherwise."""

import gc
import platform

import pytest

from expertmesh.cli.main import UsageError, build_parser
from expertmesh.cli.serve import build_core, settle_heap


@pytest.fixture
def unfreeze():
    yield
    gc.unfreeze()


def test_settle_heap_puts_the_objects_alive_now_out_of_the_collectors_reach(unfreeze):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    made_before = [[]]
    settle_heap()
    assert gc.get_freeze_count() > 1000  # this interpreter's modules, classes, functions
    made_later = [[]]
    scanned = {id(o) for o in gc.get_objects()}  # what a full collection walks
    assert id(made_before) not in scanned and id(made_later) in scanned


@pytest.mark.parametrize(
    ("flags", "process", "workers"),
    [([], True, 1), (["--no-planner-process"], False, 1), (["--plan-workers", "2"], True, 2)],
)
def test_serve_plans_in_a_planner_process_by_default(flags, process, workers):
    args = build_parser().parse_args(["serve", "--experts", "4", *flags])
    core = build_core(args)
    try:
        assert core.planner_settings.process is process
        assert core.planner_settings.workers == workers
    finally:
        core.close()


def test_plan_workers_out_of_bounds_is_a_usage_error():
    args = build_parser().parse_args(["serve", "--plan-workers", "0"])
    with pytest.raises(UsageError, match="plan-workers"):
        build_core(args)


def test_big_buffers_get_their_own_mapping_on_glibc() -> None:
    from expertmesh.cli.serve import big_buffers_to_mmap

    assert big_buffers_to_mmap() is (platform.libc_ver()[0] == "glibc")
