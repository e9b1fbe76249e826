"""The Helm chart: lint, render with several value sets, strict schema validation of every
built-in object, RBAC equal to the operator's own rule list, CRD byte-identity, hardening."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from ppojob_api.crd import crd_yaml
from ppojob_operator.__main__ import build_parser, operator_config
from ppojob_operator.builders import NetworkPolicySettings
from ppojob_operator.rbac import KUBERAY_READ_RULES, LEADER_ELECTION_RULES, OPERATOR_RULES
from tests.helpers.helm import CHART, ROOT, run_helm

# A recent Kubernetes release kubernetes-validate ships schemas for (also helm v4's client).
K8S_VERSION = "1.35"
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterqueues", "admissionchecks"}
BUILTIN_GROUPS = {
    "v1",
    "apps/v1",
    "rbac.authorization.k8s.io/v1",
    "apiextensions.k8s.io/v1",
    "admissionregistration.k8s.io/v1",
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "volcano-debug-extra": {
        "defaultGangScheduler": "volcano",
        "kuberay": {"batchScheduler": "volcano", "sidecarMode": "supported", "rayAuth": "off"},
        "logLevel": "DEBUG",
        "extraArgs": ["--trainer-entrypoint=ppojob-train"],
        "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        "image": {
            "repository": "registry.example.com/ppojob-operator",
            "tag": "dev",
            "digest": "sha256:" + "a" * 64,
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "kuberay-unset": {"kuberay": {"batchScheduler": ""}},
    "metrics-off": {"metrics": {"enabled": False}, "rbac": {"aggregateToDefaultRoles": False}},
    "servicemonitor": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "ML"}}},
        "podAnnotations": {"example.com/team": "ml"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}
        ],
        "priorityClassName": "system-cluster-critical",
    },
    "existing-sa-no-rbac": {
        "serviceAccount": {"create": False, "name": "ppojob-preexisting"},
        "rbac": {"create": False},
        "replicaCount": 0,
    },
    "kueue-namespaced-one": {"watchNamespaces": ["ml"], "defaultGangScheduler": "kueue"},
    "network-policy-own": {
        "kuberay": {"namespace": "ray-system"},
        "networkPolicy": {
            "dashboardFrom": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
            "extraIngress": [{"ports": [{"port": 8080}], "from": [{"namespaceSelector": {}}]}],
        },
    },
    "network-policy-off": {"networkPolicy": {"enabled": False}},
}


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _operator_rbac(objs: list[dict], kind: str) -> list[dict]:
    return [
        o
        for o in _by_kind(objs, kind)
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "operator-rbac"
    ]


def _container(objs: list[dict]) -> dict:
    (deploy,) = _by_kind(objs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def _triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def _is_cluster_scoped(rule: dict) -> bool:
    return any(r in CLUSTER_SCOPED for r in rule["resources"])


# ---------------------------------------------------------------------------------------------
# lint and render
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(helm: Path, tmp_path: Path, name: str) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUE_SETS[name]))
    out = run_helm(helm, "lint", "--strict", str(CHART), "--values", str(values))
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_validate_strictly(render, name: str) -> None:
    objs = render(values=VALUE_SETS[name])
    assert objs, "nothing rendered"
    for obj in objs:
        if obj["apiVersion"] not in BUILTIN_GROUPS:
            assert obj["kind"] == "ServiceMonitor", f"unexpected non-built-in object {obj['kind']}"
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


def test_validation_version_is_shipped() -> None:
    assert K8S_VERSION in {kv_utils.major_minor(v) for v in kv_utils.all_versions()}


def test_defaults_render_the_expected_objects(render) -> None:
    objs = render()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == [
        ("ClusterRole", "ppojob-ppojob-operator"),
        ("ClusterRole", "ppojob-ppojob-operator-edit"),
        ("ClusterRole", "ppojob-ppojob-operator-view"),
        ("ClusterRoleBinding", "ppojob-ppojob-operator"),
        ("Deployment", "ppojob-ppojob-operator"),
        ("Role", "ppojob-ppojob-operator-kuberay-read"),
        ("Role", "ppojob-ppojob-operator-leader-election"),
        ("RoleBinding", "ppojob-ppojob-operator-kuberay-read"),
        ("RoleBinding", "ppojob-ppojob-operator-leader-election"),
        ("Service", "ppojob-ppojob-operator-metrics"),
        ("ServiceAccount", "ppojob-ppojob-operator"),
        ("ValidatingAdmissionPolicy", "ppojob-ppojob-operator-trainer-status"),
        ("ValidatingAdmissionPolicyBinding", "ppojob-ppojob-operator-trainer-status"),
    ]
    for o in objs:
        if o["kind"] in {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}:
            kuberay = o["metadata"]["name"].endswith("-kuberay-read")
            assert o["metadata"]["namespace"] == ("default" if kuberay else "ppojob-system")


@pytest.mark.parametrize("watch", [[], ["team-a"]], ids=["cluster-wide", "namespaced"])
def test_kuberays_batch_scheduler_is_read_at_run_time_in_its_namespace_only(render, watch) -> None:
    """``kuberay.batchScheduler: auto`` (the default): no ``lookup`` at install; the operator
    gets ``--kuberay-batch-scheduler=auto`` and a Role in ``kuberay.namespace`` only (exactly
    KUBERAY_READ_RULES), and no rule anywhere grants Deployments cluster-wide."""
    objs = render(values={"watchNamespaces": watch, "kuberay": {"namespace": "ray-system"}})
    args = build_parser().parse_args(_container(objs)["args"])
    assert args.kuberay_batch_scheduler == "auto" and args.kuberay_namespace == "ray-system"
    mine = [
        o
        for o in objs
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "kuberay-read"
    ]
    (role,) = _by_kind(mine, "Role")
    (binding,) = _by_kind(mine, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ray-system"
    assert role["rules"] == KUBERAY_READ_RULES
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ppojob-ppojob-operator", "namespace": "ppojob-system"}
    ]
    for o in objs:
        if o["kind"] in {"ClusterRole", "Role"} and o is not role:
            for rule in o["rules"]:
                assert "deployments" not in rule["resources"], o["metadata"]["name"]
    template = (CHART / "templates" / "_helpers.tpl").read_text()
    assert "lookup" not in template
    told = render(values={"kuberay": {"batchScheduler": "volcano"}})
    assert not [o for o in told if o["metadata"]["name"].endswith("-kuberay-read")]
    assert build_parser().parse_args(_container(told)["args"]).kuberay_batch_scheduler == "volcano"


@pytest.mark.parametrize(
    "bad",
    [
        "replicaCount=-1",
        "leaderElection.leaseSeconds=1",
        "defaultGangScheduler=slurm",
        "logLevel=TRACE",
        "notAValue=1",
        "watchNamespaces[0]=Not_A_Namespace",
        "image.pullPolicy=Sometimes",
        "kuberay.batchScheduler=slurm",
        "kuberay.sidecarMode=maybe",
        "kuberay.rayAuth=basic",
    ],
)
def test_values_schema_rejects(helm: Path, bad: str) -> None:
    out = run_helm(helm, "template", "x", str(CHART), "--set", bad, check=False)
    assert out.returncode != 0, f"--set {bad} should be rejected by values.schema.json"
    assert "values don't meet the specifications" in out.stderr or "schema" in out.stderr.lower()


def test_default_gang_scheduler_must_agree_with_kuberay(helm: Path) -> None:
    """Issue 10, item 7: a volcano default on a KubeRay told to have no batchScheduler is a
    chart error, not a cluster of refused jobs."""
    sets = ["--set", "defaultGangScheduler=volcano", "--set", "kuberay.batchScheduler="]
    out = run_helm(helm, "template", "x", str(CHART), *sets, check=False)
    assert out.returncode != 0, out.stdout[-500:]
    # the value, where it came from (here the chart value, not a detection) and the fix
    assert 'but it is "none" (set in kuberay.batchScheduler)' in out.stderr, out.stderr
    assert "start KubeRay with --batch-scheduler=volcano" in out.stderr, out.stderr
    # kai is KubeRay's kai-scheduler: agreeing renders, another batchScheduler does not
    kai = ["--set", "defaultGangScheduler=kai", "--set", "kuberay.batchScheduler=kai-scheduler"]
    assert run_helm(helm, "template", "x", str(CHART), *kai, check=False).returncode == 0
    kai[-1] = "kuberay.batchScheduler=volcano"
    out = run_helm(helm, "template", "x", str(CHART), *kai, check=False)
    assert "start KubeRay with --batch-scheduler=kai-scheduler" in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------
# CRDs
# ---------------------------------------------------------------------------------------------
def test_chart_crd_is_byte_identical_to_generated_crd() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    repo_crds = sorted(p.name for p in (ROOT / "crds").iterdir())
    assert chart_crds == repo_crds
    for name in repo_crds:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/ppojob-operator/crds/{name} differs from crds/{name}: "
            f"cp crds/{name} charts/ppojob-operator/crds/"
        )


def test_chart_crd_matches_the_models() -> None:
    assert (CHART / "crds" / "ppojob.io_ppojobs.yaml").read_text() == crd_yaml(), (
        "regenerate: ppojob crd > crds/ppojob.io_ppojobs.yaml and copy it into the chart"
    )


def test_chart_ships_the_crd_and_it_validates(render) -> None:
    objs = render(include_crds=True)
    crds = _by_kind(objs, "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == ["ppojobs.ppojob.io"]
    kubernetes_validate.validate(crds[0], K8S_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------
# RBAC: exactly ppojob_operator.rbac.OPERATOR_RULES
# ---------------------------------------------------------------------------------------------
def test_cluster_wide_rbac_is_exactly_operator_rules(render) -> None:
    objs = render()
    (role,) = _operator_rbac(objs, "ClusterRole")
    expected = yaml.safe_dump({"rules": OPERATOR_RULES}, sort_keys=False)
    assert role["rules"] == OPERATOR_RULES, (
        "the chart's rules (templates/_helpers.tpl, ppojob-operator.rules) differ from "
        f"ppojob_operator.rbac.OPERATOR_RULES; they should be:\n{expected}"
    )
    assert not _operator_rbac(objs, "Role")
    (binding,) = _operator_rbac(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ppojob-ppojob-operator", "namespace": "ppojob-system"}
    ]


def test_namespaced_rbac_splits_operator_rules(render) -> None:
    namespaces = ["team-a", "team-b"]
    objs = render(values={"watchNamespaces": namespaces})
    namespaced = [r for r in OPERATOR_RULES if not _is_cluster_scoped(r)]
    cluster_rules = [r for r in OPERATOR_RULES if _is_cluster_scoped(r)]
    (cluster_role,) = _operator_rbac(objs, "ClusterRole")
    # namespaced mode: only kopf's reads of CRDs and namespaces cluster-wide (kopf lists and
    # watches namespaces whenever it is not cluster-wide: kopf/_core/reactor/observation.py),
    # and gets of Kueue's cluster-scoped queues and admission checks (the MultiKueue refusal)
    assert cluster_role["rules"] == cluster_rules
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
        "clusterqueues",
        "admissionchecks",
    }
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    roles = _operator_rbac(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
    for role in roles:
        assert role["rules"] == namespaced
    bindings = _operator_rbac(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"][0]["namespace"] == "ppojob-system"
    # Together they grant every operator permission.
    granted = _triples(cluster_role["rules"]) | _triples(roles[0]["rules"])
    assert granted == _triples(OPERATOR_RULES)


@pytest.mark.parametrize("watch", [[], ["team-a"]], ids=["cluster-wide", "namespaced"])
def test_leader_election_lease_rbac_and_flags(render, watch) -> None:
    """On by default, in both modes: a Role on leases in the release's namespace only (exactly
    LEADER_ELECTION_RULES), bound to the operator's ServiceAccount; the flags that elect on
    the Lease named like the release; the pod's name as the holder identity."""
    objs = render(values={"watchNamespaces": watch})
    mine = [
        o
        for o in objs
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "leader-election"
    ]
    (role,) = _by_kind(mine, "Role")
    (binding,) = _by_kind(mine, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ppojob-system"
    assert role["rules"] == LEADER_ELECTION_RULES
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ppojob-ppojob-operator", "namespace": "ppojob-system"}
    ]
    c = _container(objs)
    args = build_parser().parse_args(c["args"])
    assert args.leader_elect and args.leader_election_namespace == "ppojob-system"
    assert args.leader_election_name == "ppojob-ppojob-operator"
    assert args.leader_election_lease_seconds == 15
    (pod_name,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    off = render(values={"leaderElection": {"enabled": False}})
    assert not [o for o in off if o["metadata"]["name"].endswith("-leader-election")]
    assert not build_parser().parse_args(_container(off)["args"]).leader_elect


def test_replicas_beyond_one_need_leader_election(render, helm) -> None:
    objs = render(values={"replicaCount": 3})
    (dep,) = _by_kind(objs, "Deployment")
    assert dep["spec"]["replicas"] == 3
    out = run_helm(
        helm,
        "template",
        "ppojob",
        str(CHART),
        "--set",
        "replicaCount=2",
        "--set",
        "leaderElection.enabled=false",
        check=False,
    )
    assert out.returncode != 0 and "needs leaderElection.enabled" in out.stderr


def test_operator_rules_use_only_known_scopes() -> None:
    """A new cluster-scoped resource in OPERATOR_RULES must be classified here and in the chart."""
    for rule in OPERATOR_RULES:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        if _is_cluster_scoped(rule):
            assert set(rule["resources"]) <= CLUSTER_SCOPED, rule
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for resource in CLUSTER_SCOPED:
        assert resource in helpers


def test_user_roles_aggregate_and_grant_no_status_writes(render) -> None:
    objs = render()
    user = [
        o
        for o in _by_kind(objs, "ClusterRole")
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "user-rbac"
    ]
    labels = set().union(*(o["metadata"]["labels"] for o in user))
    assert {
        "rbac.authorization.k8s.io/aggregate-to-edit",
        "rbac.authorization.k8s.io/aggregate-to-view",
    } <= labels
    for role in user:
        for g, r, v in _triples(role["rules"]):
            assert g == "ppojob.io"
            assert not (r == "ppojobs/status" and v not in {"get", "list", "watch"})


def test_the_trainer_status_policy_guards_every_status_field_but_progress(render) -> None:
    """The chart's admission policy compares each status field of the CRD, less progress (the
    trainer's), before and after a trainer's write: a field added to the status is guarded
    as soon as it is (tests/cluster/test_cluster_progress.py sees the real API server refuse)."""
    import re

    [policy] = _by_kind(render(), "ValidatingAdmissionPolicy")
    [binding] = _by_kind(render(), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["ppojobs/status"], ["UPDATE"])
    [check] = policy["spec"]["validations"]
    guarded = re.findall(
        r"object\.\?status\.\?(\w+) == oldObject\.\?status\.\?(\w+)", check["expression"]
    )
    assert all(a == b for a, b in guarded), guarded
    crd = yaml.safe_load(crd_yaml())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert [a for a, _ in guarded] == [f for f in status["properties"] if f != "progress"]
    [match] = policy["spec"]["matchConditions"]
    assert "':' + object.metadata.name + '-trainer'" in match["expression"]
    assert not _by_kind(render("trainerStatusPolicy.enabled=false"), "ValidatingAdmissionPolicy")


def test_rbac_can_be_disabled(render) -> None:
    objs = render(values=VALUE_SETS["existing-sa-no-rbac"])
    assert {o["kind"] for o in objs} == {"Deployment", "Service"}
    spec = _by_kind(objs, "Deployment")[0]["spec"]
    assert spec["replicas"] == 0
    assert spec["template"]["spec"]["serviceAccountName"] == "ppojob-preexisting"


# ---------------------------------------------------------------------------------------------
# Deployment
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_args_are_accepted_by_the_operator_cli(render, name: str) -> None:
    args = _container(render(values=VALUE_SETS[name]))["args"]
    parsed = build_parser().parse_args(args)  # exits (fails the test) on an unknown flag
    config = operator_config(parsed)
    watch = VALUE_SETS[name].get("watchNamespaces", [])
    assert parsed.namespace == watch
    assert parsed.all_namespaces is (not watch)
    assert parsed.health_port == 8081
    metrics_on = VALUE_SETS[name].get("metrics", {}).get("enabled", True)
    assert parsed.metrics_port == (8080 if metrics_on else 0)
    assert parsed.gang_scheduler == (VALUE_SETS[name].get("defaultGangScheduler") or None)
    kuberay = VALUE_SETS[name].get("kuberay", {})
    # auto (the default): the operator reads KubeRay's Deployment at start-up
    told = kuberay.get("batchScheduler", "auto")
    want = None if told == "unknown" else told or "none"
    assert parsed.kuberay_batch_scheduler == want
    assert parsed.kuberay_sidecar_mode == kuberay.get("sidecarMode", "auto")
    sidecar = {"auto": None, "supported": True, "unsupported": False}
    assert config.sidecar_supported is sidecar[kuberay.get("sidecarMode", "auto")]
    auth = {"auto": None, "token": True, "off": False}
    assert config.dashboard_auth is auth[kuberay.get("rayAuth", "auto")]
    assert config.gang_default == parsed.gang_scheduler
    assert parsed.log_level == VALUE_SETS[name].get("logLevel", "INFO")
    # the NetworkPolicy settings the operator gets are the values as written
    net = VALUE_SETS[name].get("networkPolicy", {})
    settings = config.network_policy
    if net.get("enabled", True):
        want = NetworkPolicySettings()
        assert settings == NetworkPolicySettings(
            kuberay_namespace=kuberay.get("namespace", "default"),
            dashboard_from=net.get("dashboardFrom", want.dashboard_from),
            extra_ingress=net.get("extraIngress", want.extra_ingress),
        )
    else:
        assert settings is None


def test_extra_args_and_image_digest(render) -> None:
    c = _container(render(values=VALUE_SETS["volcano-debug-extra"]))
    assert c["args"][-1] == "--trainer-entrypoint=ppojob-train"
    assert c["image"] == "registry.example.com/ppojob-operator@sha256:" + "a" * 64
    assert c["imagePullPolicy"] == "Always"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"]


def test_deployment_is_single_replica_recreate(render) -> None:
    (deploy,) = _by_kind(render(), "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert _container(render())["image"] == "ghcr.io/ppojob/ppojob-operator:0.1.0"


@pytest.mark.parametrize(
    "weaken",
    [
        {},
        {
            "securityContext": {
                "readOnlyRootFilesystem": False,
                "allowPrivilegeEscalation": True,
                "privileged": True,
                "capabilities": {"add": ["NET_ADMIN"]},
                "runAsNonRoot": False,
            }
        },
    ],
    ids=["defaults", "attempted-weakening"],
)
def test_container_is_hardened(render, weaken: dict) -> None:
    objs = render(values=weaken)
    c = _container(objs)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    pod = _by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # A read-only root filesystem needs a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_probes_get_healthz_on_the_health_port(render) -> None:
    c = _container(render())
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8081, "metrics": 8080}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def test_metrics_service_selects_the_operator(render) -> None:
    objs = render()
    (svc,) = _by_kind(objs, "Service")
    (deploy,) = _by_kind(objs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_metrics_off_renders_no_service(render) -> None:
    objs = render(values=VALUE_SETS["metrics-off"])
    assert not _by_kind(objs, "Service")
    assert [p["name"] for p in _container(objs)["ports"]] == ["health"]


def test_service_monitor(render) -> None:
    objs = render(values=VALUE_SETS["servicemonitor"])
    (sm,) = _by_kind(objs, "ServiceMonitor")
    (svc,) = _by_kind(objs, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    # the scraped labels win over target labels of the same name (and are never exported_*)
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ppojob-system"]}
    assert not _by_kind(render(), "ServiceMonitor")
