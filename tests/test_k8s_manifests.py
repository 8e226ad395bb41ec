"""The Kubernetes manifests in deploy/k8s/: each overlay renders (``kubectl kustomize``),
validates against the Kubernetes schemas (``kubernetes-validate``, strict), and keeps the
properties a deployment relies on: probes and resources on every container, non-root
read-only containers, one kvmanager that is never doubled, the executor behind a headless
Service, a NetworkPolicy that lets only gateway pods reach kvmanager and the executors, the
right GPU resource per overlay, and the same images, commands, model preparation and kernel
volume as compose.yaml (and compose.cuda.yaml / compose.musa.yaml for the GPU overlays).

Rendering needs ``kubectl`` (or ``kustomize``) on PATH and skips without it; schema
validation skips where kubernetes-validate is not installed (``make k8s-check`` installs it).
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "nvidia", "mthreads")
GPU_RESOURCES = {"cpu": None, "nvidia": "nvidia.com/gpu", "mthreads": "mthreads.com/gpu"}
DEVICES = {"cpu": "cpu", "nvidia": "cuda", "mthreads": "musa"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}
# The oldest release with GA native gRPC probes, and the newest schemas kubernetes-validate has.
K8S_VERSIONS = ("1.27.0", "latest")
GPU_KEYS = {"nvidia.com/gpu", "mthreads.com/gpu", "amd.com/gpu"}
COMPOSE_OVERRIDES = {"cpu": None, "nvidia": "compose.cuda.yaml", "mthreads": "compose.musa.yaml"}
# What the manifests take over from compose, per service (the rest is compose's own business).
COMPOSE_ENV = ("KVSERVE_MODEL", "KVSERVE_KVMANAGER_ADDRESS", "KVSERVE_EXECUTOR_ADDRESS", "KVSERVE_EXTENSIONS_DIR",
               "KVSERVE_ENSURE_KERNELS", "KVSERVE_DEVICE", "KVSERVE_MUSA_ARCH")


def _renderer() -> list[str] | None:
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    command = _renderer()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is on PATH: cannot render deploy/k8s overlays "
                    "(kubectl >= 1.21, whose built-in kustomize reads `patches:`, runs these checks)")
    out = subprocess.run([*command, str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"{' '.join(command)} overlays/{overlay} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == kind}


def workloads(overlay: str) -> dict[str, dict]:
    found = {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] in WORKLOADS}
    assert {"gateway", "kvmanager", "executor"} <= set(found), sorted(found)
    return found


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def main_container(workload: dict) -> dict:
    (container,) = [c for c in pod_spec(workload)["containers"] if c["name"] == workload["metadata"]["name"]]
    return container


def all_containers(workload: dict):
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions); {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def container_ports(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


# --- files -------------------------------------------------------------------------------------


def test_every_manifest_file_parses_and_kustomizations_list_existing_files():
    files = sorted(K8S.rglob("*.yaml"))
    assert files, "deploy/k8s has no manifests"
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs, f"{path} is empty"
        for doc in docs:
            assert "kind" in doc and "apiVersion" in doc, f"{path}: a document without kind/apiVersion"
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        listed = [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", []) if "path" in p)]
        for entry in listed:
            assert (kustomization.parent / entry).exists(), f"{kustomization}: {entry} does not exist"
    for name in OVERLAYS:
        assert (K8S / "overlays" / name / "kustomization.yaml").is_file()


# --- render + schemas ----------------------------------------------------------------------------


def test_overlay_renders_the_three_services(overlay):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}
    assert {("Deployment", "gateway"), ("Service", "gateway"), ("Deployment", "kvmanager"),
            ("Service", "kvmanager"), ("Service", "executor")} <= kinds
    assert ("StatefulSet", "executor") in kinds or ("Deployment", "executor") in kinds
    namespaces = {o["metadata"].get("namespace") for o in render(overlay) if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, namespaces


def test_overlay_validates_against_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate, "
                                      "or run make k8s-check)")
    versions = [kubernetes_validate.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    errors = []
    for obj in render(overlay):
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {exc.message} at "
                              f"{'.'.join(str(p) for p in exc.path)}")
    assert not errors, "\n".join(errors)


# --- probes, resources, security ---------------------------------------------------------------


def test_every_container_has_liveness_readiness_and_startup_probes(overlay):
    for name, workload in workloads(overlay).items():
        for container in pod_spec(workload)["containers"]:
            where = f"{overlay}: {name}/{container['name']}"
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert probe in container, f"{where} has no {probe}"
            # Native gRPC health (grpc.health.v1) on the container's own gRPC port for liveness.
            grpc_port = container_ports(container)["grpc"]
            assert container["livenessProbe"].get("grpc", {}).get("port") == grpc_port, where
            assert container["startupProbe"].get("grpc", {}).get("port") == grpc_port, where
            readiness = container["readinessProbe"]
            if name == "gateway":
                http = readiness.get("httpGet")
                assert (http and http["path"] == "/health" and http["port"] in ("http", 8000)) or \
                    readiness.get("grpc", {}).get("port") == grpc_port, where
            else:
                assert readiness.get("grpc", {}).get("port") == grpc_port, where


def test_probe_ports_are_the_ports_the_services_listen_on(overlay):
    listen = {"gateway": 50051, "kvmanager": 50052, "executor": 50053}
    for name, workload in workloads(overlay).items():
        container = main_container(workload)
        assert container_ports(container)["grpc"] == listen[name]
        assert str(listen[name]) in container["command"], f"{name} does not listen on {listen[name]}"
    assert container_ports(main_container(workloads(overlay)["gateway"]))["http"] == 8000


def test_every_container_has_cpu_and_memory_requests_and_limits(overlay):
    for name, workload in workloads(overlay).items():
        for container in all_containers(workload):
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    assert resource in resources.get(kind, {}), \
                        f"{overlay}: {name}/{container['name']} has no {kind}.{resource}"


def test_every_container_is_non_root_read_only_and_unprivileged(overlay):
    for name, workload in workloads(overlay).items():
        spec = pod_spec(workload)
        pod_ctx = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False, f"{name} mounts a service account token"
        # KVSERVE_<FLAG> variables set flags: keep Kubernetes' service-link variables out.
        assert spec.get("enableServiceLinks") is False, f"{name} has service links"
        mounts_writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for container in all_containers(workload):
            where = f"{overlay}: {name}/{container['name']}"
            ctx = {**pod_ctx, **container.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True, where
            assert ctx.get("runAsUser", 0) != 0, f"{where} runs as uid 0"
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("privileged", False) is False, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert "ALL" in ctx.get("capabilities", {}).get("drop", []), where
            assert not ctx.get("capabilities", {}).get("add"), where
            assert ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            # A read-only root needs somewhere to write: /tmp, which is also $HOME (caches).
            writable = {m["mountPath"] for m in container.get("volumeMounts", [])
                        if m["name"] in mounts_writable and not m.get("readOnly")}
            assert "/tmp" in writable, f"{where}: no writable /tmp"
            home = env_of(container).get("HOME")
            assert isinstance(home, str) and any(home.startswith(w) for w in writable), f"{where}: HOME={home}"


def test_pods_pass_the_restricted_pod_security_standard_namespace(overlay):
    (namespace,) = objects(overlay, "Namespace").values()
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in render(overlay):
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"]


def test_images_are_compose_images_pulled_if_not_present(overlay):
    for name, workload in workloads(overlay).items():
        service = compose_service(overlay, name)
        for container in all_containers(workload):
            where = f"{overlay}: {name}/{container['name']}"
            assert container.get("imagePullPolicy") == "IfNotPresent", where
            if container["command"] == compose_service(overlay, "model")["command"]:
                assert container["image"] == compose_service(overlay, "model")["image"], where
            else:  # the service's own image (a GPU build in the GPU overlays), as compose runs it
                assert container["image"] == service["image"], where
    if overlay != "cpu":
        assert main_container(workloads(overlay)["executor"])["image"] != "kvserve:latest"


def test_commands_and_settings_match_compose(overlay):
    for name, workload in workloads(overlay).items():
        service = compose_service(overlay, name)
        container = main_container(workload)
        assert container["command"] == service["command"], f"{overlay}: {name} runs another command than compose"
        env = env_of(container)
        for key in COMPOSE_ENV:
            if service["environment"].get(key) is not None:
                assert env.get(key) == str(service["environment"][key]), f"{overlay}: {name} {key}"


# --- topology ----------------------------------------------------------------------------------


def test_kvmanager_is_one_replica_that_is_never_doubled(overlay):
    kvmanager = workloads(overlay)["kvmanager"]
    assert kvmanager["kind"] == "Deployment"
    assert kvmanager["spec"]["replicas"] == 1
    assert kvmanager["spec"]["strategy"]["type"] == "Recreate"
    assert "autoscaling" not in {o["apiVersion"].split("/")[0] for o in render(overlay)}, "no HPA on kvserve"


def test_executor_sits_behind_a_headless_service_the_gateway_points_at(overlay):
    executor = workloads(overlay)["executor"]
    service = objects(overlay, "Service")["executor"]
    assert service["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(executor))
    assert [p["port"] for p in service["spec"]["ports"]] == [50053]
    if executor["kind"] == "StatefulSet":
        assert executor["spec"]["serviceName"] == "executor"
    # Several executors, which the gateway finds through the headless Service's DNS records.
    assert executor["spec"]["replicas"] >= 2
    gateway_env = env_of(main_container(workloads(overlay)["gateway"]))
    assert gateway_env["KVSERVE_EXECUTOR_ADDRESS"] == "dns:///executor:50053"
    assert gateway_env["KVSERVE_KVMANAGER_ADDRESS"] == "kvmanager:50052"
    kvmanager_service = objects(overlay, "Service")["kvmanager"]
    assert [p["port"] for p in kvmanager_service["spec"]["ports"]] == [50052]
    assert selects({"matchLabels": kvmanager_service["spec"]["selector"]}, pod_labels(workloads(overlay)["kvmanager"]))
    gateway_service = objects(overlay, "Service")["gateway"]
    assert sorted(p["port"] for p in gateway_service["spec"]["ports"]) == [8000, 50051]
    # Each Service selects only its own pods.
    for svc_name, svc in objects(overlay, "Service").items():
        chosen = [n for n, w in workloads(overlay).items() if selects({"matchLabels": svc["spec"]["selector"]},
                                                                         pod_labels(w))]
        assert chosen == [svc_name], (svc_name, chosen)


def test_only_gateway_pods_reach_kvmanager_and_executor(overlay):
    loads = workloads(overlay)
    gateway_labels = pod_labels(loads["gateway"])
    policies = list(objects(overlay, "NetworkPolicy").values())
    for target, port in (("kvmanager", 50052), ("executor", 50053)):
        labels = pod_labels(loads[target])
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert selecting, f"no NetworkPolicy selects the {target} pods"
        assert any("Ingress" in p["spec"].get("policyTypes", ["Ingress"]) for p in selecting)
        allowed_ports = set()
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, f"{policy['metadata']['name']}: a rule with no `from` admits every source"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, \
                        f"{policy['metadata']['name']}: {target} admits a non-pod or other-namespace peer {peer}"
                    assert selects(peer["podSelector"], gateway_labels), peer
                    for other in ("kvmanager", "executor"):
                        assert not selects(peer["podSelector"], pod_labels(loads[other])), \
                            f"{target} admits {other} pods"
                allowed_ports |= {p.get("port") for p in rule.get("ports", [{}])}
        assert allowed_ports == {port}, f"{target}: ingress open on {allowed_ports}, want only {port}"


def test_tokens_come_from_one_optional_secret(overlay):
    """--service-token must be the same on all three and --api-key is the gateway's; both come
    from the Secret kvserve-auth, optional, so a stack without it runs without auth."""
    want = {"kvmanager": {"KVSERVE_SERVICE_TOKEN": "service-token"},
            "executor": {"KVSERVE_SERVICE_TOKEN": "service-token"},
            "gateway": {"KVSERVE_SERVICE_TOKEN": "service-token", "KVSERVE_API_KEY": "api-key"}}
    for name, workload in workloads(overlay).items():
        env = env_of(main_container(workload))
        for var, key in want[name].items():
            ref = (env.get(var) or {}).get("secretKeyRef")
            assert ref == {"name": "kvserve-auth", "key": key, "optional": True}, f"{overlay}: {name} {var}: {ref}"
    assert "Secret" not in {o["kind"] for o in render(overlay)}, "no token may be committed in a manifest"


# --- devices -------------------------------------------------------------------------------------


def test_gpu_overlays_give_the_executor_one_gpu_and_nobody_else_any(overlay):
    want = GPU_RESOURCES[overlay]
    for name, workload in workloads(overlay).items():
        for container in all_containers(workload):
            resources = container["resources"]
            asked = GPU_KEYS & {*resources.get("limits", {}), *resources.get("requests", {})}
            if want is not None and name == "executor" and container["name"] == "executor":
                assert asked == {want}, f"{overlay}: executor asks for {asked}"
                assert int(resources["limits"][want]) == 1
            else:
                assert not asked, f"{overlay}: {name}/{container['name']} asks for {asked}"
    executor_env = env_of(main_container(workloads(overlay)["executor"]))
    assert executor_env.get("KVSERVE_DEVICE") == DEVICES[overlay]


# --- the model, as compose.yaml prepares it ------------------------------------------------------


def test_model_is_prepared_into_a_volume_as_compose_does(overlay):
    model = compose_service(overlay, "model")
    compose_model = compose_service(overlay, "executor")["environment"]["KVSERVE_MODEL"]
    for name in ("executor", "gateway"):
        workload = workloads(overlay)[name]
        (init,) = [c for c in pod_spec(workload).get("initContainers", []) if c["command"] == model["command"]]
        assert init["image"] == model["image"]
        cache_dir = env_of(init)["KVSERVE_CACHE_DIR"]
        assert cache_dir == model["environment"]["KVSERVE_CACHE_DIR"]
        init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert init_mounts.get(cache_dir), f"{name}: prepare-model writes {cache_dir}, which is no volume"
        container = main_container(workload)
        model_dir = env_of(container)["KVSERVE_MODEL"]
        assert model_dir == compose_model
        volume = init_mounts[cache_dir]
        assert any(m["name"] == volume and model_dir.startswith(m["mountPath"]) for m in container["volumeMounts"]), \
            f"{name} does not mount the prepared model"


def test_kernel_directory_is_writable_and_seeded_from_the_image(overlay):
    """compose mounts a volume at KVSERVE_EXTENSIONS_DIR that Docker fills from the image; here an
    initContainer of the same image copies the prebuilt kernels into an emptyDir mounted there."""
    workload = workloads(overlay)["executor"]
    container = main_container(workload)
    extensions = env_of(container)["KVSERVE_EXTENSIONS_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == extensions]
    assert not mount.get("readOnly")
    assert "emptyDir" in {v["name"]: v for v in pod_spec(workload)["volumes"]}[mount["name"]]
    seeds = [c for c in pod_spec(workload).get("initContainers", [])
             if c["image"] == container["image"] and any(m["name"] == mount["name"] for m in c["volumeMounts"])]
    assert seeds, "nothing copies the image's prebuilt kernels into the kernel volume"
    (seed_mount,) = [m for m in seeds[0]["volumeMounts"] if m["name"] == mount["name"]]
    script = " ".join(seeds[0]["command"])
    assert "cp -a" in script and f"{extensions}/" in script and f"{seed_mount['mountPath'].rstrip('/')}/" in script, script


# --- compose.yaml, as the overlays mirror it -----------------------------------------------------


def _defaults(value):
    """compose's ``${NAME:-default}`` with nothing set: the default (``${NAME}``: empty)."""
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def _compose_env(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {key: _defaults(value) for key, value in env.items()}


@functools.cache
def _compose_services(override: str | None) -> dict:
    services = {name: {"image": _defaults(spec.get("image")), "command": spec.get("command"),
                       "environment": _compose_env(spec)}
                for name, spec in yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"].items()}
    if override and (REPO_ROOT / override).is_file():
        for name, spec in yaml.safe_load((REPO_ROOT / override).read_text())["services"].items():
            merged = services.setdefault(name, {"image": None, "command": None, "environment": {}})
            merged["image"] = _defaults(spec.get("image", merged["image"]))
            merged["command"] = spec.get("command", merged["command"])
            merged["environment"] = {**merged["environment"], **_compose_env(spec)}
    return services


def compose_service(overlay: str, name: str) -> dict:
    return _compose_services(COMPOSE_OVERRIDES[overlay])[name]


def test_executors_keep_a_kv_store_on_a_volume_of_their_own(overlay):
    """The store tier as compose has it, per pod: KVSERVE_KV_STORE names a mounted, size-limited
    volume, and the capacity kvmanager evicts at stays below that limit."""
    executor = workloads(overlay)["executor"]
    container = main_container(executor)
    env = env_of(container)
    store_dir = env["KVSERVE_KV_STORE"]
    assert store_dir == compose_service(overlay, "executor")["environment"]["KVSERVE_KV_STORE"].split(":-")[-1].rstrip("}")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == store_dir]
    (volume,) = [v for v in pod_spec(executor)["volumes"] if v["name"] == mount["name"]]
    limit = volume["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi") and int(env["KVSERVE_KV_STORE_CAPACITY"]) < int(limit[:-2]) << 30
