"""k8s.check_owner: a child's name held by an existing object is taken over only when that
object is this PPOJob's own (its controller ownerReference has this PPOJob's uid). Anything else
is never adopted: on its way out (being deleted, or an earlier PPOJob's of the same name) the
job waits (ChildWaiting); unowned or another controller's is a conflict (ChildConflict)."""

from __future__ import annotations

from typing import Any

import pytest

from ppojob_operator import k8s
from ppojob_operator.builders import owner_reference


def config_map(*refs: dict[str, Any], deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo-trainer", "namespace": "ns1"}
    if refs:
        meta["ownerReferences"] = list(refs)
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


OURS = owner_reference("demo", "uid-new")
WANTED = config_map(OURS)


def test_an_object_this_job_controls_is_its_own():
    k8s.check_owner(WANTED, config_map(OURS))


def test_an_unowned_object_is_a_conflict_not_adopted():
    with pytest.raises(k8s.ChildConflict, match="has no owner"):
        k8s.check_owner(WANTED, config_map())
    # owner references that are not a controller's do not make it ours either
    with pytest.raises(k8s.ChildConflict, match="has no owner"):
        k8s.check_owner(WANTED, config_map({**OURS, "controller": False}))


def test_another_controllers_object_is_a_conflict():
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "uid-web"}
    with pytest.raises(k8s.ChildConflict, match="controlled by Deployment web"):
        k8s.check_owner(WANTED, config_map({**other, "controller": True}))
    # another PPOJob's (another name) is a conflict too
    with pytest.raises(k8s.ChildConflict, match="controlled by PPOJob other"):
        k8s.check_owner(WANTED, config_map(owner_reference("other", "uid-other")))


def test_an_object_on_its_way_out_is_waited_for():
    with pytest.raises(k8s.ChildWaiting, match="garbage collector"):
        k8s.check_owner(WANTED, config_map(owner_reference("demo", "uid-old")))
    with pytest.raises(k8s.ChildWaiting, match="being deleted"):
        k8s.check_owner(WANTED, config_map(deleting=True))


def test_without_an_owner_to_compare_nothing_is_checked():
    """A child built without the PPOJob's uid (``ppojob render``) has no owner to compare."""
    k8s.check_owner(config_map(), config_map())
