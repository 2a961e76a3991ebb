"""deploy/kubernetes renders and holds together: every overlay through the real `kubectl kustomize`,
every object against Kubernetes' own schemas (kubernetes-validate, strict) or, for the custom
resources, against tests/deploy/crd_schemas.yaml; then what no schema sees: Services select pods
that exist at ports those pods have, references to ConfigMaps, Secrets and ServiceAccounts resolve,
probes name real ports, the RBAC grants read-only discovery and nothing else, the InferencePool's
picker is the EPP Service on 9002, Envoy's config is deploy/envoy/envoy.yaml and names Services that
exist, and the gateway config each overlay mounts loads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.gateway_config import GatewayConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
ENVOY = ROOT / "deploy" / "envoy" / "envoy.yaml"
OVERLAYS = ["epp", "proxy"]
KUBERNETES_VERSION = "1.34"
CRDS = yaml.safe_load((Path(__file__).parent / "crd_schemas.yaml").read_text())
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
READ_ONLY = ["get", "list", "watch"]
DISCOVERY = {
    ("", "pods"),
    ("discovery.k8s.io", "endpointslices"),
    ("inference.networking.k8s.io", "inferencepools"),
}

Obj = dict[str, Any]


def render(overlay: str) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it renders deploy/kubernetes (apt-get install kubectl)")
    result = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[Obj]:
    return render(request.param)


def of_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_templates(objects: list[Obj]) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj["spec"]["template"] for obj in objects if obj["kind"] in WORKLOADS}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def selected_pods(objects: list[Obj], selector: dict[str, str]) -> list[Obj]:
    return [t for t in pod_templates(objects).values() if selects(selector, t["metadata"].get("labels", {}))]


def container_ports(pod: Obj) -> dict[str | int, int]:
    """Each container port by name and by number, to its number."""
    ports: dict[str | int, int] = {}
    for container in pod["spec"]["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def test_every_object_validates_against_its_schema(objects: list[Obj]) -> None:
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        crd = CRDS["kinds"].get(f"{obj['apiVersion']}/{obj['kind']}")
        if crd is not None:
            jsonschema.validate(obj, {**crd, "definitions": CRDS["definitions"]})
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {'.'.join(map(str, error.path))}: {error.message}")
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") == "prefixgate", name


def test_each_service_selects_pods_and_reaches_their_ports(objects: list[Obj]) -> None:
    for name, service in of_kind(objects, "Service").items():
        pods = selected_pods(objects, service["spec"].get("selector", {}))
        assert pods, f"Service {name} selects no pod template"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in pods:
                assert target in container_ports(pod), f"Service {name}: no container port {target}"


def test_probes_name_ports_their_containers_have(objects: list[Obj]) -> None:
    for workload, pod in pod_templates(objects).items():
        ports = container_ports(pod)
        for container in pod["spec"]["containers"]:
            assert container.get("readinessProbe") and container.get("livenessProbe"), workload
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = container.get(probe)
                if spec is None or "exec" in spec:
                    continue
                (handler,) = (spec[k] for k in ("httpGet", "tcpSocket", "grpc") if k in spec)
                assert handler["port"] in ports, f"{workload} {probe}: no container port {handler['port']}"


def test_references_to_config_maps_secrets_and_service_accounts_resolve(objects: list[Obj]) -> None:
    config_maps, secrets = of_kind(objects, "ConfigMap"), of_kind(objects, "Secret")
    accounts = of_kind(objects, "ServiceAccount")
    for workload, pod in pod_templates(objects).items():
        account = pod["spec"].get("serviceAccountName")
        assert account is None or account in accounts, f"{workload}: no ServiceAccount {account}"
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, f"{workload}: {volume}"
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, f"{workload}: {volume}"
        for container in pod["spec"]["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                for key, found in (("configMapKeyRef", config_maps), ("secretKeyRef", secrets)):
                    if key in ref:
                        target = found.get(ref[key]["name"])
                        assert target is not None, f"{workload} {env['name']}: no {ref[key]['name']}"
                        assert ref[key]["key"] in target.get("data", {}), f"{workload} {env['name']}"
    for name, binding in of_kind(objects, "RoleBinding").items():
        assert binding["roleRef"]["name"] in of_kind(objects, binding["roleRef"]["kind"]), name
        for subject in binding["subjects"]:
            assert subject["name"] in accounts and subject["namespace"] == "prefixgate", name


def test_rbac_grants_read_only_discovery_and_nothing_else(objects: list[Obj]) -> None:
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    (role,) = of_kind(objects, "Role").values()
    granted = set()
    for rule in role["rules"]:
        assert sorted(rule["verbs"]) == sorted(READ_ONLY), rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        granted |= {(group, resource) for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == DISCOVERY
    gateways = [p for p in pod_templates(objects).values() if p["spec"].get("serviceAccountName")]
    assert gateways, "no workload runs under the discovery ServiceAccount"
    for pod in pod_templates(objects).values():
        if not pod["spec"].get("serviceAccountName"):
            assert pod["spec"].get("automountServiceAccountToken") is False, "a pod with a token it needs not"


def test_the_monitors_select_services_and_pods_with_their_port(objects: list[Obj]) -> None:
    (service_monitor,) = of_kind(objects, "ServiceMonitor").values()
    services = [
        s
        for s in of_kind(objects, "Service").values()
        if selects(service_monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
    ]
    assert services, "the ServiceMonitor selects no Service"
    for endpoint in service_monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in services)
    (pod_monitor,) = of_kind(objects, "PodMonitor").values()
    pods = selected_pods(objects, pod_monitor["spec"]["selector"]["matchLabels"])
    assert pods, "the PodMonitor selects no pod"
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert all(endpoint["port"] in container_ports(pod) for pod in pods)


def gateway_containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(pod template, container) of each container that runs `prefixgate serve` or `epp`."""
    return [
        (pod, c)
        for pod in pod_templates(objects).values()
        for c in pod["spec"]["containers"]
        if c.get("args", [])[:1] in (["serve"], ["epp"])
    ]


def mounted_config(objects: list[Obj], pod: Obj, container: Obj) -> str:
    """The text the container reads as its --config, through its ConfigMap volume."""
    path = Path(container["args"][container["args"].index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    return of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"][path.name]


def test_the_mounted_gateway_config_loads_and_names_what_the_overlay_deploys(
    objects: list[Obj], tmp_path: Path
) -> None:
    (pod, container), *_ = gateway_containers(objects)
    data = yaml.safe_load(mounted_config(objects, pod, container))
    section = data.pop("kubernetes")
    assert section["namespace"] == "prefixgate"
    if "inference_pool" in section:
        assert section["inference_pool"] in of_kind(objects, "InferencePool")
    else:
        service = of_kind(objects, "Service")[section["service"]]
        assert section["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert data["redis"]["url"].split("//")[1].split(":")[0] in of_kind(objects, "Service")
    assert data["listen"]["port"] == container_ports(pod)["http"]
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(data))
    load_config(config)
    if "kubernetes" not in GatewayConfig.model_fields:
        pytest.skip("the gateway config has no `kubernetes:` section yet: all but it loads")
    config.write_text(yaml.safe_dump({**data, "kubernetes": section}))
    load_config(config)


def test_the_inference_pool_picks_with_the_epp_on_9002() -> None:
    objects = render("epp")
    (pool,) = of_kind(objects, "InferencePool").values()
    picker = pool["spec"]["endpointPickerRef"]
    assert picker.get("kind", "Service") == "Service" and picker["port"]["number"] == 9002
    service = of_kind(objects, "Service")[picker["name"]]
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == 9002]
    (epp,) = selected_pods(objects, service["spec"]["selector"])
    (container,) = epp["spec"]["containers"]
    args = container["args"]
    assert args[0] == "epp" and args[args.index("--grpc-port") + 1] == "9002"
    assert container_ports(epp)[grpc["targetPort"]] == 9002
    workers = selected_pods(objects, pool["spec"]["selector"]["matchLabels"])
    assert workers and all(p["metadata"]["annotations"]["prefixgate.io/kind"] for p in workers)
    for port in pool["spec"]["targetPorts"]:
        assert all(port["number"] in container_ports(w).values() for w in workers)


def envoy_addresses(config: Obj) -> dict[str, tuple[str, int]]:
    clusters = config["static_resources"]["clusters"]
    addresses = {}
    for cluster in clusters:
        (endpoint,) = [e for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
        socket = endpoint["endpoint"]["address"]["socket_address"]
        addresses[cluster["name"]] = (socket["address"], socket["port_value"])
    return addresses


def test_envoys_config_is_deploy_envoy_and_reaches_the_picker_and_the_workers() -> None:
    objects = render("epp")
    (envoy,) = [p for p in pod_templates(objects).values() if p["spec"]["containers"][0]["name"] == "envoy"]
    (volume,) = envoy["spec"]["volumes"]
    text = of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]["envoy.yaml"]
    services = of_kind(objects, "Service")
    for cluster, (host, port) in envoy_addresses(yaml.safe_load(text)).items():
        assert host in services, f"Envoy's {cluster} cluster names {host}, no Service"
        assert port in {p["port"] for p in services[host]["spec"]["ports"]}, f"{host}:{port}"
        if cluster == "replicas":  # STRICT_DNS must resolve to every pod, not to a virtual IP
            assert services[host]["spec"].get("clusterIP") == "None"
    if not ENVOY.is_file():
        pytest.skip(
            f"{ENVOY.relative_to(ROOT)} does not exist yet: nothing to keep the overlay's copy equal to"
        )
    assert text == ENVOY.read_text(), "overlays/epp/envoy.yaml differs from deploy/envoy/envoy.yaml: copy it"
