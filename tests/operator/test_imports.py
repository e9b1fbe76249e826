"""The operator never imports torch, ray or user code; RBAC rules cover what the code calls."""

from __future__ import annotations

import subprocess
import sys

from ppojob_operator import k8s
from ppojob_operator.rbac import KUBERAY_READ_RULES, LEADER_ELECTION_RULES, OPERATOR_RULES


def test_operator_imports_no_torch_or_ray():
    code = (
        "import sys, ppojob_operator, ppojob_operator.handlers, ppojob_operator.__main__, "
        "ppojob_operator.builders, ppojob_operator.status, ppojob_operator.k8s; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rbac_covers_every_kind_the_operator_touches():
    # the Lease: a Role in its own namespace; KubeRay's Deployment: a Role in KubeRay's
    rules = [*OPERATOR_RULES, *LEADER_ELECTION_RULES, *KUBERAY_READ_RULES]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    for api_version, _kind in k8s.KINDS:
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert (group, k8s.KINDS[(api_version, _kind)]) in granted, (api_version, _kind)
    assert ("ppojob.io", "ppojobs/status") in granted


def test_cli_flags():
    from ppojob_operator.__main__ import build_parser

    args = build_parser().parse_args(
        [
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--metrics-port",
            "9090",
            "--gang-scheduler",
            "volcano",
        ]
    )
    assert args.namespace == ["a", "b"] and args.metrics_port == 9090 and args.health_port == 8081
