"""The ``Dispatcher`` interface is the whole set of operations: neither transport has a public
operation the other lacks, and each takes at least the interface's arguments."""

from __future__ import annotations

import inspect

import pytest

from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
from mtc.head.dispatch.colocated import ColocatedDispatcher
from mtc.head.dispatch.interface import Dispatcher

pytestmark = pytest.mark.unit


def _operations(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


@pytest.mark.parametrize("cls", [ColocatedDispatcher, ClusterDispatcher])
def test_each_dispatcher_has_exactly_the_interfaces_operations(cls):
    assert set(_operations(cls)) == set(_operations(Dispatcher))
    assert not getattr(cls, "__abstractmethods__", frozenset())


@pytest.mark.parametrize("cls", [ColocatedDispatcher, ClusterDispatcher])
def test_each_operation_takes_the_interfaces_arguments(cls):
    mine = _operations(cls)
    for name, sig in _operations(Dispatcher).items():
        have = mine[name].parameters
        for p in sig.parameters.values():
            assert p.name in have, f"{cls.__name__}.{name} lacks the argument {p.name!r}"
            assert have[p.name].kind == p.kind, f"{cls.__name__}.{name}: {p.name!r} is passed another way"
        extra = [q for q in have.values() if q.name not in sig.parameters]
        assert all(q.default is not inspect.Parameter.empty for q in extra), \
            f"{cls.__name__}.{name} requires arguments the interface does not have: {[q.name for q in extra]}"


def test_the_generation_is_part_of_both():
    assert hasattr(Dispatcher, "generation")
    assert isinstance(inspect.getattr_static(ClusterDispatcher, "generation"), property)
