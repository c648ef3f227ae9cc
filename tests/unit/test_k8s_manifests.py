"""deploy/k8s: the manifests validate against a current Kubernetes, and they agree with the
cluster.yaml they carry (which passes the project's own validation)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common.config import ClusterConfig, parse_cluster_config
from frontend.metrics import WORKER_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy/k8s/base"
KUBERNETES_VERSION = "1.34"


def resources() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


@pytest.mark.parametrize("doc", resources(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_strictly(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def cluster_config() -> ClusterConfig:
    return parse_cluster_config(by_kind("ConfigMap")["pdcluster-config"]["data"]["cluster.yaml"])


def test_the_configmap_cluster_yaml_is_valid_and_names_the_orchestrator_service() -> None:
    config = cluster_config()
    assert config.orchestrator.address == "tcp://orchestrator:5550"  # the Service's name
    assert "orchestrator" in by_kind("Service")


def test_every_container_has_probes_and_resources() -> None:
    for doc in resources():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            name = doc["metadata"]["name"]
            assert "readinessProbe" in container and "livenessProbe" in container, name
            assert container["resources"]["requests"], name


def test_engine_workers_ask_for_a_gpu_and_spread_out() -> None:
    for name in ("ctx", "gen"):
        spec = by_kind("StatefulSet")[name]["spec"]["template"]["spec"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "podAntiAffinity" in spec["affinity"]
        args = spec["containers"][0]["args"]
        assert args == ["--worker-id", "$(POD_NAME)", "--advertise-host", "$(POD_IP)"]
    assert {"frontend", "gen", "ctx"} <= set(by_kind("PodDisruptionBudget"))


def test_frontend_is_scraped_and_probed_on_real_endpoints() -> None:
    template = by_kind("Deployment")["frontend"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    container = template["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_every_pod_mounts_the_curve_keys_where_cluster_yaml_looks() -> None:
    config = cluster_config()
    assert config.security.curve and config.security.keys_dir
    for doc in resources():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["curve-keys"]["secret"]["secretName"] == "pdcluster-curve-keys"
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["curve-keys"]["mountPath"] == config.security.keys_dir, doc["metadata"]


def test_workers_drain_before_they_stop_within_their_grace_period() -> None:
    drain_s = cluster_config().orchestrator.drain_timeout_seconds
    for name in ("ctx", "gen", "pp"):
        spec = by_kind("StatefulSet")[name]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert 'orchestrator drain "$POD_NAME"' in pre_stop[-1], name
        # the drain command waits drain_timeout_seconds + 5 at most; SIGKILL only after that
        assert spec["terminationGracePeriodSeconds"] > drain_s + 5, name
        # ready: can take work (not draining); alive: heartbeating, draining or not
        assert "--alive" not in container["readinessProbe"]["exec"]["command"][-1], name
        assert "probe --alive" in container["livenessProbe"]["exec"]["command"][-1], name


def test_the_generation_autoscaler_owns_the_replicas_on_metrics_the_adapter_serves() -> None:
    hpa = by_kind("HorizontalPodAutoscaler")["gen"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "gen"}
    assert "replicas" not in by_kind("StatefulSet")["gen"]["spec"]  # the HPA's, not apply's
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    rules = yaml.safe_load((BASE.parent / "prometheus-adapter-rules.yaml").read_text())
    served = {rule["name"]["as"]: rule for rule in rules["external"]}
    exported = {name for _, name, _, _ in WORKER_FAMILIES}
    for metric in hpa["metrics"]:
        rule = served[metric["external"]["metric"]["name"]]
        series = rule["seriesQuery"].partition("{")[0]
        assert series in exported, series  # a series the frontend's /metrics has
