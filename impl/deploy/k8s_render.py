"""Kubernetes manifests for XpYd from the same ``deploy.toml`` as the ssh recipe (``bidikv deploy manifests``).

What is rendered, and why each choice:

* **P and D are StatefulSets** behind headless Services (one LeaderWorkerSet each when
  ``model.tensor_parallel_size`` spans instances). The router must address the very D that holds a
  conversation's blocks, and P must reach that D's NIXL side channel: stable per-pod DNS names
  (``<name>-decode-3.<name>-decode.<ns>.svc``) give both, which a Deployment's random pod names do not.
  ``podManagementPolicy: Parallel`` starts all replicas at once (a model load takes minutes each).
* **No host networking.** EFA traffic never crosses the pod network: libfabric drives the EFA device that
  the EFA device plugin mounts into the pod (``vpc.amazonaws.com/efa``), so the pod only needs the
  device, the hugepages libfabric's EFA provider uses for its buffers, and locked memory (``IPC_LOCK``)
  for registering GPU memory. The NIXL side channel (a ZMQ handshake, metadata only) and HTTP go over
  the pod network. ``VLLM_NIXL_SIDE_CHANNEL_HOST`` is the pod's IP (downward API): vLLM binds it and its
  default, localhost, would be unreachable.
* **Resources come from the instance preset** (calibration/data/hardware_<preset>.json): each P/D pod
  asks for min(TP, GPUs per instance) GPUs, all the instance's EFA interfaces when it takes the whole
  instance (else its share), and by default the same share of three quarters of the vCPUs and RAM.
  Limits equal requests (Guaranteed QoS: the last evicted under node pressure).
* **The router** is a Deployment of ``kubernetes.router_replicas`` sharing one Redis-compatible store
  (a StatefulSet with a PersistentVolumeClaim, or an external ``redis://`` URL). D posts its
  notifications to the replica that sent the turn, so each replica advertises its pod IP as
  ``--notify-url``; its readiness probe is ``/health`` (503 until one P and one D are healthy), its
  liveness a TCP check (``/health`` would restart routers while P and D load).
* **Secrets** come from the environment of whoever renders, under the names the router reads them
  by (``BIDIKV_API_KEYS``, ``BIDIKV_METRICS_TOKEN``, ``BIDIKV_STORE_PASSWORD``, ``BIDIKV_UPSTREAM_API_KEY``,
  ``BIDIKV_TRACE_SALT``) plus ``HF_TOKEN``; never from ``deploy.toml``. The output then holds them:
  treat it as a secret.
* **Monitoring** is Prometheus Operator objects (``kubernetes.monitoring``): ServiceMonitors for vLLM's
  and the router's ``/metrics`` (the router's with the metrics token as a Bearer credential), a
  PrometheusRule with ``impl/deploy/monitoring/alerts.yaml`` and a ConfigMap with the Grafana dashboard
  (label ``grafana_dashboard: "1"``, which the kube-prometheus-stack Grafana sidecar loads). The
  ``bidikv_role`` label of each Service (prefill, decode, router) is copied onto its series, which the
  dashboard and the alerts select by.

Sources for the EFA pieces: the EKS EFA guide
(https://docs.aws.amazon.com/eks/latest/userguide/node-efa.html) and device-management page
(https://docs.aws.amazon.com/eks/latest/userguide/device-management-efa.html); llm-d on AWS
(https://aws.amazon.com/blogs/machine-learning/introducing-disaggregated-inference-on-aws-powered-by-llm-d);
Dynamo's EFA guide (https://docs.nvidia.com/dynamo/dev/kubernetes-deployment/cloud-provider-guides/aws/efa-rdma-over-aws-fabric).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from calibration import jsondata
from calibration.hardware import DATA_DIR
from impl.deploy.config import DeployConfig, DeployConfigError
from impl.deploy.k8s_config import STORE_STATEFULSET, KubernetesSettings
from impl.deploy.render import engine_args, router_args

MONITORING_DIR = Path(__file__).resolve().parent / "monitoring"
DASHBOARD_FILE = MONITORING_DIR / "grafana-dashboard.json"
ALERTS_FILE = MONITORING_DIR / "alerts.yaml"

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ROLE_LABEL = "bidikv_role"  # on Services; ServiceMonitor targetLabels copies it onto every series
METRICS_LABEL = "bidikv.io/metrics"  # which ServiceMonitor scrapes a Service: vllm | router
LWS_ROLE_LABEL = "bidikv.io/lws-role"  # leader | worker, on LeaderWorkerSet pod templates
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
STORE_PORT = 6379
MASTER_PORT = 29501  # vLLM's ParallelConfig.master_port default: torch.distributed rendezvous of a multi-node TP group
MODEL_CACHE_MOUNT = "/models"

# Secret keys: (key in the Secret, environment variable of the renderer it is read from)
SECRET_KEYS = {
    "api-keys": "BIDIKV_API_KEYS",
    "metrics-token": "BIDIKV_METRICS_TOKEN",
    "store-password": "BIDIKV_STORE_PASSWORD",
    "upstream-api-key": "BIDIKV_UPSTREAM_API_KEY",
    "trace-salt": "BIDIKV_TRACE_SALT",
    "hf-token": "HF_TOKEN",
}
# Router flags the manifests write; the same flag in router.extra_args would clash
ROUTER_FLAGS_OWNED_K8S = ("--store", "--notify-url", "--api-keys-file", "--open-metrics", "--no-open-metrics")


@dataclass
class Rendered:
    """The objects, in ``kubectl apply`` order, and what the person rendering should know."""

    objects: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


def preset_facts(key: str) -> dict[str, Any]:
    """The raw preset file of ``key`` (``p5en``): EFA interfaces, vCPUs and RAM are read from it (each with
    its source URL there)."""
    return jsondata.read_json(DATA_DIR / f"hardware_{key}.json")


def _k(config: DeployConfig) -> KubernetesSettings:
    if config.kubernetes is None:
        raise DeployConfigError(config.source, "kubernetes", "section is required to render manifests "
                                "(image, replica counts, store; see impl/deploy/deploy.toml)")
    return config.kubernetes


def _labels(k: KubernetesSettings, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "bidikv", INSTANCE: k.name, COMPONENT: component,
            "app.kubernetes.io/managed-by": "bidikv-deploy"}


def _selector(k: KubernetesSettings, component: str) -> dict[str, str]:
    return {INSTANCE: k.name, COMPONENT: component}


def _meta(k: KubernetesSettings, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": k.namespace, "labels": {**_labels(k, component), **extra_labels}}


def _secret_name(k: KubernetesSettings) -> str:
    return f"{k.name}-secrets"


def _secret_env(k: KubernetesSettings, name: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": _secret_name(k), "key": key}}}


def _pod_ip_env(name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _quantity_share(total: float, share: float, unit: str) -> str:
    if unit == "cpu":
        return str(max(1, int(total * share)))
    return f"{max(1, int(total * share / 2**30))}Gi"


def pod_dns(name: str, subdomain: str, namespace: str, index: int) -> str:
    """The DNS name of pod ``<name>-<index>`` of a StatefulSet or LeaderWorkerSet governed by ``subdomain``."""
    return f"{name}-{index}.{subdomain}.{namespace}.svc"


def server_name(k: KubernetesSettings, role: str) -> str:
    return f"{k.name}-{role}"


def upstream_urls(config: DeployConfig, role: str) -> list[str]:
    k = _k(config)
    server = config.prefill if role == "prefill" else config.decode
    replicas = k.prefill_replicas if role == "prefill" else k.decode_replicas
    name = server_name(k, role)
    return [f"http://{pod_dns(name, name, k.namespace, i)}:{server.http_port}" for i in range(replicas)]


def store_url(config: DeployConfig) -> str:
    k = _k(config)
    if k.store != STORE_STATEFULSET:
        return k.store
    name = f"{k.name}-store"
    return f"redis://{pod_dns(name, name, k.namespace, 0)}:{STORE_PORT}/0"


# --- secrets -------------------------------------------------------------------------------------------

def _secret_values(config: DeployConfig, environ: Mapping[str, str], warnings: list[str]) -> dict[str, str]:
    k = _k(config)
    values = {key: environ[var] for key, var in SECRET_KEYS.items() if environ.get(var)}
    if k.store == STORE_STATEFULSET and "store-password" not in values:
        raise DeployConfigError("environment", "BIDIKV_STORE_PASSWORD",
                                "is unset: the in-cluster store (kubernetes.store = \"statefulset\") is reachable from "
                                "every pod of the cluster, so it gets a password; export one before rendering")
    if "api-keys" in values and "metrics-token" not in values and k.monitoring:
        raise DeployConfigError("environment", "BIDIKV_METRICS_TOKEN",
                                "is unset while BIDIKV_API_KEYS is set: the router then answers /metrics with 403 "
                                "and Prometheus could not scrape it; export a metrics token (kubernetes.monitoring = "
                                "false renders no scraping)")
    if "api-keys" not in values:
        warnings.append("BIDIKV_API_KEYS is unset: the router runs with one tenant and no authentication; any pod "
                        "that reaches it can reuse any conversation's KV")
    return values


def _secret(k: KubernetesSettings, values: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(k, _secret_name(k), "secrets"),
            "type": "Opaque", "stringData": dict(sorted(values.items()))}


# --- P and D -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _PodShape:
    gpus: int
    efa: int
    cpu: str
    memory: str


def _pod_shape(config: DeployConfig) -> _PodShape:
    k = _k(config)
    facts = preset_facts(config.instance.key)
    per_node = config.instance.gpus_per_node
    gpus = min(config.model.tensor_parallel_size, per_node)
    share = gpus / per_node
    efa_total = int(facts["efa_interfaces"])
    efa = max(1, efa_total * gpus // per_node)
    cpu = k.server_cpu or _quantity_share(float(facts["vcpus"]), 0.75 * share, "cpu")
    memory = k.server_memory or _quantity_share(float(facts["host_ram_bytes"]), 0.75 * share, "memory")
    return _PodShape(gpus=gpus, efa=efa, cpu=cpu, memory=memory)


def _server_env(config: DeployConfig, role: str, secrets: dict[str, str]) -> list[dict[str, Any]]:
    k = _k(config)
    server = config.prefill if role == "prefill" else config.decode
    env: list[dict[str, Any]] = [{"name": n, "value": v} for n, v in config.transfer.env]
    if not k.hugepages and not any(n == "FI_EFA_USE_HUGE_PAGE" for n, _ in config.transfer.env):
        # without hugepages in the pod, libfabric's EFA provider must not try to map them
        env.append({"name": "FI_EFA_USE_HUGE_PAGE", "value": "0"})
    env += [_pod_ip_env("VLLM_NIXL_SIDE_CHANNEL_HOST"),
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(server.side_channel_port)},
            {"name": "PYTHONPATH", "value": config.workdir},
            {"name": "HF_HOME", "value": f"{MODEL_CACHE_MOUNT}/hf"}]
    if "hf-token" in secrets:
        env.append(_secret_env(k, "HF_TOKEN", "hf-token"))
    if "upstream-api-key" in secrets:  # the key the router sends to vLLM (--api-key's environment form)
        env.append(_secret_env(k, "VLLM_API_KEY", "upstream-api-key"))
    return env


def _server_ports(config: DeployConfig, role: str, *, leader: bool) -> list[dict[str, Any]]:
    server = config.prefill if role == "prefill" else config.decode
    ports = [{"name": "http", "containerPort": server.http_port, "protocol": "TCP"},
             {"name": "nixl", "containerPort": server.side_channel_port, "protocol": "TCP"}]
    heartbeat = config.connector_settings.heartbeat_port
    if role == "decode" and heartbeat:
        ports.append({"name": "heartbeat", "containerPort": heartbeat, "protocol": "TCP"})
    if config.nodes_per_server > 1 and leader:
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    return ports


def _server_volumes(k: KubernetesSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if k.hugepages:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    if k.model_cache:
        volumes.append({"name": "models", "hostPath": {"path": k.model_cache, "type": "DirectoryOrCreate"}})
    else:
        volumes.append({"name": "models", "emptyDir": {}})
    mounts.append({"name": "models", "mountPath": MODEL_CACHE_MOUNT})
    return volumes, mounts


def _server_container(config: DeployConfig, role: str, mode: str, secrets: dict[str, str], *,
                      lws: str | None) -> dict[str, Any]:
    """The vLLM container of P or D; ``lws`` is None (one pod), ``"leader"`` or ``"worker"``."""
    k = _k(config)
    server = config.prefill if role == "prefill" else config.decode
    shape = _pod_shape(config)
    nodes = config.nodes_per_server
    multi = ["--nnodes", str(nodes), "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(MASTER_PORT)]
    if lws == "worker":
        # a headless engine process: vLLM's multi-node launch without Ray (vllm serve --headless)
        command = [config.python, "-m", "vllm.entrypoints.cli.main", "serve"]
        args = ["--headless", *multi, "--node-rank", "$(LWS_WORKER_INDEX)", *engine_args(config, role, mode)]
    else:
        command = [config.python, "-m", "vllm.entrypoints.openai.api_server"]
        args = ["--host", "0.0.0.0", "--port", str(server.http_port)]
        if lws == "leader":
            args += [*multi, "--node-rank", "0"]
        args += engine_args(config, role, mode)
    limits: dict[str, Any] = {GPU_RESOURCE: str(shape.gpus), EFA_RESOURCE: str(shape.efa), "cpu": shape.cpu,
                              "memory": shape.memory}
    if k.hugepages:
        limits[HUGEPAGES_RESOURCE] = k.hugepages
    _, mounts = _server_volumes(k)
    container: dict[str, Any] = {
        "name": "vllm", "image": k.image, "imagePullPolicy": k.image_pull_policy, "workingDir": config.workdir,
        "command": command, "args": args, "env": _server_env(config, role, secrets),
        "ports": _server_ports(config, role, leader=lws != "worker"),
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": mounts,
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},  # RDMA memory registration pins pages
    }
    if lws != "worker":  # workers serve no HTTP: the group restarts when one of them fails (restartPolicy)
        health = {"httpGet": {"path": "/health", "port": "http"}}
        container["startupProbe"] = {**health, "periodSeconds": 10, "failureThreshold": 180}  # up to 30 min to load
        container["readinessProbe"] = {**health, "periodSeconds": 10, "failureThreshold": 3}
        container["livenessProbe"] = {**health, "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 5}
    return container


def _server_pod(config: DeployConfig, role: str, mode: str, secrets: dict[str, str], *,
                lws: str | None) -> dict[str, Any]:
    k = _k(config)
    labels = dict(_labels(k, role))
    if lws:
        labels[LWS_ROLE_LABEL] = lws
    volumes, _ = _server_volumes(k)
    spec: dict[str, Any] = {
        "nodeSelector": {INSTANCE_TYPE_LABEL: k.node_instance_type or config.instance.name},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 60,
        "containers": [_server_container(config, role, mode, secrets, lws=lws)],
        "volumes": volumes,
    }
    return {"metadata": {"labels": labels}, "spec": spec}


def _server_service(config: DeployConfig, role: str, name: str, selector: dict[str, str]) -> dict[str, Any]:
    k = _k(config)
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in _server_ports(config, role, leader=True) if p["name"] != "dist"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(k, name, role, **{ROLE_LABEL: role, METRICS_LABEL: "vllm"}),
            "spec": {"clusterIP": "None", "selector": selector, "ports": ports}}


def _server_objects(config: DeployConfig, role: str, mode: str, secrets: dict[str, str]) -> list[dict[str, Any]]:
    k = _k(config)
    name = server_name(k, role)
    replicas = k.prefill_replicas if role == "prefill" else k.decode_replicas
    selector = _selector(k, role)
    if config.nodes_per_server == 1:
        workload = {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(k, name, role),
            "spec": {"serviceName": name, "replicas": replicas, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": selector},
                     "template": _server_pod(config, role, mode, secrets, lws=None)}}
        service = _server_service(config, role, name, selector)
    else:
        # The LeaderWorkerSet controller creates the headless Service "<name>" that gives the leaders their
        # DNS names (<name>-<i>.<name>); the Service rendered here selects the leaders for scraping.
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": _meta(k, name, role),
            "spec": {"replicas": replicas, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {
                         "size": config.nodes_per_server, "restartPolicy": "RecreateGroupOnPodRestart",
                         "leaderTemplate": _server_pod(config, role, mode, secrets, lws="leader"),
                         "workerTemplate": _server_pod(config, role, mode, secrets, lws="worker")}}}
        service = _server_service(config, role, f"{name}-leader", {**selector, LWS_ROLE_LABEL: "leader"})
    return [service, workload, _pdb(k, name, role, selector)]


# --- router and store ----------------------------------------------------------------------------------

def _router_objects(config: DeployConfig, mode: str, secrets: dict[str, str]) -> list[dict[str, Any]]:
    k = _k(config)
    for arg in config.router.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_FLAGS_OWNED_K8S:
            raise DeployConfigError(config.source, "router.extra_args",
                                    f"{flag} is written by the Kubernetes manifests (store, notify URL, keys from the "
                                    "Secret); remove it")
    name = f"{k.name}-router"
    port = config.router.port
    args = ["--host", "0.0.0.0",
            *router_args(config, mode, upstream_urls(config, "prefill"), upstream_urls(config, "decode"),
                         f"http://$(POD_IP):{port}"),
            "--store", store_url(config)]
    env: list[dict[str, Any]] = [_pod_ip_env("POD_IP"), {"name": "PYTHONPATH", "value": config.workdir}]
    for key, var in (("api-keys", "BIDIKV_API_KEYS"), ("metrics-token", "BIDIKV_METRICS_TOKEN"),
                     ("store-password", "BIDIKV_STORE_PASSWORD"), ("upstream-api-key", "BIDIKV_UPSTREAM_API_KEY"),
                     ("trace-salt", "BIDIKV_TRACE_SALT")):
        if key in secrets:
            env.append(_secret_env(k, var, key))
    resources = {"cpu": k.router_cpu, "memory": k.router_memory}
    selector = _selector(k, "router")
    container = {
        "name": "router", "image": k.image, "imagePullPolicy": k.image_pull_policy, "workingDir": config.workdir,
        "command": [config.python, "-m", "impl.router"], "args": args, "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
    }
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector},
                                            "topologyKey": "kubernetes.io/hostname"}}]}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(k, name, "router"),
        "spec": {"replicas": k.router_replicas, "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": _labels(k, "router")},
                              "spec": {"affinity": spread, "containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": _meta(k, name, "router", **{ROLE_LABEL: "router", METRICS_LABEL: "router"}),
               "spec": {"type": "ClusterIP", "selector": selector,
                        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}
    return [service, deployment, _pdb(k, name, "router", selector)]


def _store_objects(config: DeployConfig) -> list[dict[str, Any]]:
    k = _k(config)
    if k.store != STORE_STATEFULSET:
        return []
    name = f"{k.name}-store"
    selector = _selector(k, "store")
    resources = {"cpu": "1", "memory": "2Gi"}
    container = {
        "name": "store", "image": k.store_image, "imagePullPolicy": k.image_pull_policy,
        # the Redis and Valkey images' entrypoint runs the server when the first argument is a flag
        "args": ["--appendonly", "yes", "--dir", "/data", "--requirepass", "$(STORE_PASSWORD)"],
        "env": [_secret_env(k, "STORE_PASSWORD", "store-password")],
        "ports": [{"name": "redis", "containerPort": STORE_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    claim: dict[str, Any] = {"metadata": {"name": "data"},
                             "spec": {"accessModes": ["ReadWriteOnce"],
                                      "resources": {"requests": {"storage": k.store_storage}}}}
    if k.storage_class:
        claim["spec"]["storageClassName"] = k.storage_class
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(k, name, "store"),
        "spec": {"serviceName": name, "replicas": 1, "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": _labels(k, "store")}, "spec": {"containers": [container]}},
                 "volumeClaimTemplates": [claim]}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(k, name, "store"),
               "spec": {"clusterIP": "None", "selector": selector,
                        "ports": [{"name": "redis", "port": STORE_PORT, "targetPort": "redis", "protocol": "TCP"}]}}
    # maxUnavailable 1 lets a node drain move the single store pod; meanwhile the routers serve turns
    # without reuse (store_timeout_s, store_retry_s) rather than fail them
    return [service, statefulset, _pdb(k, name, "store", selector)]


def _pdb(k: KubernetesSettings, name: str, component: str, selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(k, name, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


# --- monitoring ----------------------------------------------------------------------------------------

def load_alert_rules() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(ALERTS_FILE.read_text())


def _monitoring_objects(config: DeployConfig, secrets: dict[str, str]) -> list[dict[str, Any]]:
    k = _k(config)
    if not k.monitoring:
        return []

    def monitor(which: str, endpoint: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                "metadata": _meta(k, f"{k.name}-{which}", "monitoring"),
                "spec": {"selector": {"matchLabels": {INSTANCE: k.name, METRICS_LABEL: which}},
                         "namespaceSelector": {"matchNames": [k.namespace]}, "targetLabels": [ROLE_LABEL],
                         "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", **endpoint}]}}

    router_endpoint: dict[str, Any] = {}
    if "metrics-token" in secrets:
        router_endpoint["authorization"] = {"type": "Bearer",
                                            "credentials": {"name": _secret_name(k), "key": "metrics-token"}}
    rules = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
             "metadata": _meta(k, f"{k.name}-alerts", "monitoring"), "spec": load_alert_rules()}
    dashboard = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": _meta(k, f"{k.name}-grafana-dashboard", "monitoring", grafana_dashboard="1"),
                 "data": {"bidikv.json": DASHBOARD_FILE.read_text()}}
    return [monitor("vllm", {}), monitor("router", router_endpoint), rules, dashboard]


# --- all -----------------------------------------------------------------------------------------------

def render_manifests(config: DeployConfig, mode: str, environ: Mapping[str, str]) -> Rendered:
    """Every object of the deployment (``mode``: bidirectional transfer ``on`` or ``off``)."""
    if mode not in ("on", "off"):
        raise ValueError(f"mode must be on or off, got {mode!r}")
    k = _k(config)
    if config.instance.is_neuron:
        raise DeployConfigError(config.source, "deploy.instance_type",
                                f"{config.instance.name} runs vLLM's Neuron backend: the manifests request NVIDIA GPUs "
                                "(nvidia.com/gpu) and a CUDA image; they are not rendered for Trainium")
    warnings: list[str] = []
    secrets = _secret_values(config, environ, warnings)
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": k.namespace, "labels": {"app.kubernetes.io/name": "bidikv"}}}
    objects = [namespace, _secret(k, secrets)]
    objects += _store_objects(config)
    objects += _server_objects(config, "decode", mode, secrets)
    objects += _server_objects(config, "prefill", mode, secrets)
    objects += _router_objects(config, mode, secrets)
    objects += _monitoring_objects(config, secrets)
    return Rendered(objects=objects, warnings=warnings)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """One YAML document per object; no anchors or aliases (shared dicts are written out in full), and
    multi-line strings (the dashboard JSON) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, data: str) -> Any:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    return "".join("---\n" + yaml.dump(o, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)
                   for o in objects)


__all__ = ["ALERTS_FILE", "DASHBOARD_FILE", "Rendered", "SECRET_KEYS", "preset_facts",
           "load_alert_rules", "pod_dns", "render_manifests", "server_name", "store_url", "to_yaml",
           "upstream_urls"]
