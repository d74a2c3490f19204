"""The suite's dealing to pytest-xdist workers (tests/conftest.py): a shared-fixture module's tests carry their
xdist_group in the node id that --dist loadgroup's scheduler reads, so they go to one worker, which builds the module's
fixture once; the longest tests are dealt first."""
from __future__ import annotations

import copy
import types

import conftest


def test_a_grouped_test_carries_its_group_in_its_node_id_under_loadgroup(request):
    item = copy.copy(request.node)  # a copy: this test's own id stays as it is
    item.own_markers = []
    conftest._group(item, "g", types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=True)))
    assert item.nodeid == f"{request.node.nodeid}@g" and item.get_closest_marker("xdist_group").args == ("g",)
    conftest._group(item, "g", types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=True)))
    assert item.nodeid == f"{request.node.nodeid}@g"  # once


def test_without_loadgroup_the_node_id_is_unchanged(request):
    item = copy.copy(request.node)
    item.own_markers = []
    conftest._group(item, "g", types.SimpleNamespace(option=types.SimpleNamespace()))
    assert item.nodeid == request.node.nodeid and item.get_closest_marker("xdist_group").args == ("g",)


def test_the_longest_tests_are_dealt_first():
    items = [types.SimpleNamespace(nodeid=n) for n in ("tests/test_a.py::test_x", "tests/test_wheel.py::test_w",
                                                       "tests/test_kill.py::test_run_killed_at_every_phase_x")]
    assert [conftest._rank(i) for i in items] == [len(conftest.LONGEST_FIRST), 1, 0]
