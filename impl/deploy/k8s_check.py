"""Offline checks of Kubernetes manifests: the schemas of a stated Kubernetes version, then what no schema sees.

``schema_problems``: Kubernetes' own kinds against the strict JSON schemas ``kubernetes-validate`` ships
for :data:`KUBERNETES_VERSION`; LeaderWorkerSet, ServiceMonitor and PrometheusRule against the schemas in
``impl/deploy/schemas`` (their sources and licence: ``schemas/README.md``), whose pod templates and label
selectors are Kubernetes' own definitions of the same version.

``consistency_problems``: the references between objects, which a per-object schema cannot follow:

* every Service, PodDisruptionBudget and workload selector selects a pod template, every ServiceMonitor
  a Service; a StatefulSet's ``serviceName`` is a rendered headless Service selecting its pods;
* every port a Service, a ServiceMonitor or a probe names is a port of the pods it reaches;
* every Secret and ConfigMap (and key) a pod or a ServiceMonitor references is rendered;
* every volume mounted is declared, every ``$(VAR)`` in a command is defined in the container's env;
* P and D run one image (one vLLM release: each release has its own NIXL handshake version), one
  ``--block-size`` and one ``--model``;
* the TP fits the instance: ``--tensor-parallel-size`` is the GPUs a pod requests times the pods of its
  group (``--nnodes``), and a pod asks no more GPUs and EFA interfaces than the instance type its
  ``nodeSelector`` pins has (calibration/data/hardware_<preset>.json); extended resources and hugepages
  request what they limit;
* the router's ``--prefill`` / ``--decode`` URLs name pods that exist (``<set>-<i>.<service>.<ns>.svc``,
  ``i`` below the replica count) of the right role on a port they expose, and its ``--store`` URL the store.

Each problem is one line naming the object (``Kind/name``) and the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator
from urllib.parse import urlsplit

KUBERNETES_VERSION = "1.34"  # EKS standard support; kubernetes-validate ships 1.25 .. 1.37
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
CUSTOM_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.monitoring.coreos.com_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.monitoring.coreos.com_v1.json",
}
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")  # set by the LWS controller in every pod
GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
COMPONENT = "app.kubernetes.io/component"
_EXACT_RESOURCES = re.compile(r"^(hugepages-.*|.*/.*)$")  # extended resources and hugepages: requests == limits
_POD_HOST = re.compile(r"^(?P<set>[a-z0-9-]+)-(?P<index>[0-9]+)\.(?P<sub>[a-z0-9-]+)\.(?P<ns>[a-z0-9-]+)\.svc$")


def ident(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


# --- schemas -------------------------------------------------------------------------------------------

def _schema_dir(version: str) -> str:
    """The newest shipped schema set not newer than ``version`` (as kubernetes-validate itself picks)."""
    from kubernetes_validate import utils
    from packaging.version import InvalidVersion, Version

    every = utils.all_versions()
    span = f"kubernetes-validate ships {utils.major_minor(every[0])} to {utils.major_minor(every[-1])}"
    try:
        wanted = Version(utils.major_minor(version.removeprefix("v")))
    except InvalidVersion:
        raise ValueError(f"--kubernetes-version: {version!r} is not a version like 1.34 ({span})") from None
    shipped = [v for v in every if Version(utils.major_minor(v)) <= wanted]
    if not shipped or wanted > Version(utils.major_minor(every[-1])):
        raise ValueError(f"--kubernetes-version: no schemas for Kubernetes {version} ({span})")
    return f"v{shipped[-1]}-local-strict"


def _k8s_definitions(version: str) -> Any:
    from kubernetes_validate import utils

    return utils.schema_contents(f"kubernetes-json-schema/{_schema_dir(version)}/_definitions.json", version)


def schema_problems(objects: Iterable[dict[str, Any]], version: str = KUBERNETES_VERSION) -> list[str]:
    import jsonschema
    import kubernetes_validate
    from referencing import Registry, Resource

    registry = Resource.from_contents(_k8s_definitions(version)) @ Registry()
    problems = []
    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"))
        try:
            if key in CUSTOM_SCHEMAS:
                schema = json.loads((SCHEMA_DIR / CUSTOM_SCHEMAS[key]).read_text())
                jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
        except jsonschema.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path) or "(object)"
            problems.append(f"{ident(obj)}: {where}: {e.message} (schema of Kubernetes {version})")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{ident(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')} in Kubernetes "
                            f"{version}")
    return problems


# --- the objects' references ---------------------------------------------------------------------------

class _Template:
    """A pod template and what owns it."""

    def __init__(self, owner: dict[str, Any], template: dict[str, Any], where: str, *, lws: bool, group_size: int):
        self.owner, self.template, self.where, self.lws, self.group_size = owner, template, where, lws, group_size

    @property
    def labels(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("labels", {}) or {}

    @property
    def spec(self) -> dict[str, Any]:
        return self.template.get("spec", {}) or {}

    @property
    def containers(self) -> list[dict[str, Any]]:
        return list(self.spec.get("containers", []) or []) + list(self.spec.get("initContainers", []) or [])

    def name(self) -> str:
        return f"{ident(self.owner)}: {self.where}"


def _templates(objects: list[dict[str, Any]]) -> list[_Template]:
    out = []
    for obj in objects:
        spec = obj.get("spec", {}) or {}
        if obj.get("kind") in ("StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"):
            out.append(_Template(obj, spec.get("template", {}) or {}, "spec.template", lws=False, group_size=1))
        elif obj.get("kind") == "LeaderWorkerSet":
            lwt = spec.get("leaderWorkerTemplate", {}) or {}
            size = int(lwt.get("size", 1))
            if "leaderTemplate" in lwt:
                out.append(_Template(obj, lwt["leaderTemplate"], "spec.leaderWorkerTemplate.leaderTemplate", lws=True,
                                     group_size=size))
            out.append(_Template(obj, lwt.get("workerTemplate", {}) or {}, "spec.leaderWorkerTemplate.workerTemplate",
                                 lws=True, group_size=size))
    return out


def _selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port_names(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) or [] if "name" in p}


def _port_numbers(container: dict[str, Any]) -> set[int]:
    return {p["containerPort"] for p in container.get("ports", []) or []}


def _exposes(template: _Template, port: Any) -> bool:
    for c in template.spec.get("containers", []) or []:
        if (isinstance(port, str) and port in _port_names(c)) or (isinstance(port, int) and port in _port_numbers(c)):
            return True
    return False


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next ``--flag`` (``--flag=value`` too)."""
    out: list[str] = []
    for i, a in enumerate(args):
        if a == flag:
            for b in args[i + 1:]:
                if b.startswith("--"):
                    break
                out.append(b)
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def _flag(args: list[str], flag: str) -> str | None:
    values = flag_values(args, flag)
    return values[0] if values else None


def _container_problems(t: _Template, secrets: dict[str, set[str]], configmaps: dict[str, set[str]]) -> Iterator[str]:
    volumes = {v.get("name") for v in t.spec.get("volumes", []) or []}
    claims = {c.get("metadata", {}).get("name") for c in t.owner.get("spec", {}).get("volumeClaimTemplates", []) or []}
    claims |= {c.get("metadata", {}).get("name") for c in
               t.owner.get("spec", {}).get("leaderWorkerTemplate", {}).get("volumeClaimTemplates", []) or []}
    for v in t.spec.get("volumes", []) or []:
        if "secret" in v:
            yield from _ref(t.name() + f": volumes[{v['name']}]", "Secret", v["secret"].get("secretName"), None,
                            v["secret"].get("optional", False), secrets)
        if "configMap" in v:
            yield from _ref(t.name() + f": volumes[{v['name']}]", "ConfigMap", v["configMap"].get("name"), None,
                            v["configMap"].get("optional", False), configmaps)
    for s in t.spec.get("imagePullSecrets", []) or []:
        yield from _ref(t.name() + ": imagePullSecrets", "Secret", s.get("name"), None, False, secrets)
    for c in t.containers:
        where = f"{t.name()}: containers[{c.get('name')}]"
        env_names = {e.get("name") for e in c.get("env", []) or []} | (set(LWS_ENV) if t.lws else set())
        for e in c.get("env", []) or []:
            src = e.get("valueFrom", {}) or {}
            if "secretKeyRef" in src:
                r = src["secretKeyRef"]
                yield from _ref(f"{where}.env[{e['name']}]", "Secret", r.get("name"), r.get("key"),
                                r.get("optional", False), secrets)
            if "configMapKeyRef" in src:
                r = src["configMapKeyRef"]
                yield from _ref(f"{where}.env[{e['name']}]", "ConfigMap", r.get("name"), r.get("key"),
                                r.get("optional", False), configmaps)
        for e in c.get("envFrom", []) or []:
            if "secretRef" in e:
                yield from _ref(f"{where}.envFrom", "Secret", e["secretRef"].get("name"), None,
                                e["secretRef"].get("optional", False), secrets)
            if "configMapRef" in e:
                yield from _ref(f"{where}.envFrom", "ConfigMap", e["configMapRef"].get("name"), None,
                                e["configMapRef"].get("optional", False), configmaps)
        for m in c.get("volumeMounts", []) or []:
            if m.get("name") not in volumes | claims:
                yield f"{where}.volumeMounts[{m.get('name')}]: no volume or volumeClaimTemplate of that name"
        for text in [*(c.get("command", []) or []), *(c.get("args", []) or [])]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                if var not in env_names:
                    yield f"{where}: $({var}) in its command is not defined in its env"
        names, numbers = _port_names(c), _port_numbers(c)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            if not p:
                continue
            for kind in ("httpGet", "tcpSocket", "grpc"):
                if kind in p:
                    port = p[kind].get("port")
                    if (isinstance(port, str) and port not in names) or (isinstance(port, int) and port not in numbers):
                        yield (f"{where}.{probe}: port {port!r} is not a port of the container "
                               f"(ports: {', '.join(sorted(names)) or 'none'})")
        resources = c.get("resources", {}) or {}
        requests, limits = resources.get("requests", {}) or {}, resources.get("limits", {}) or {}
        for name in sorted(set(requests) | set(limits)):
            if _EXACT_RESOURCES.match(name) and str(requests.get(name)) != str(limits.get(name)):
                yield (f"{where}.resources: {name} must request what it limits (requests {requests.get(name)!r}, "
                       f"limits {limits.get(name)!r})")


def _ref(where: str, kind: str, name: str | None, key: str | None, optional: bool,
         rendered: dict[str, set[str]]) -> Iterator[str]:
    if optional:
        return
    if name not in rendered:
        yield f"{where}: references {kind} {name!r}, which is not rendered"
    elif key is not None and key not in rendered[name]:
        yield f"{where}: references key {key!r} of {kind} {name!r}, which has only {sorted(rendered[name])}"


def _vllm_container(t: _Template) -> dict[str, Any] | None:
    for c in t.spec.get("containers", []) or []:
        if any("vllm" in part for part in c.get("command", []) or []):
            return c
    return None


def _server_problems(templates: list[_Template]) -> Iterator[str]:
    from calibration.hardware import PRESETS, load_hardware
    from impl.deploy.k8s_render import preset_facts

    servers = [(t, _vllm_container(t)) for t in templates if t.labels.get(COMPONENT) in ("prefill", "decode")]
    servers = [(t, c) for t, c in servers if c is not None]
    for what, get in (("image", lambda c: c.get("image")),
                      ("--block-size", lambda c: _flag(c.get("args", []) or [], "--block-size")),
                      ("--model", lambda c: _flag(c.get("args", []) or [], "--model"))):
        seen = {get(c) for _, c in servers}
        if len(seen) > 1:
            detail = "; ".join(f"{t.name()}: {get(c)!r}" for t, c in servers)
            yield (f"P and D must run one {what} (one vLLM release, block size and model on both sides of a "
                   f"KV transfer), got {detail}")
    by_type = {name: key for key, name in PRESETS.items()}
    for t, c in servers:
        args = c.get("args", []) or []
        tp = int(_flag(args, "--tensor-parallel-size") or 1)
        limits = (c.get("resources", {}) or {}).get("limits", {}) or {}
        gpus, efa = int(limits.get(GPU, 0)), int(limits.get(EFA, 0))
        nnodes = int(_flag(args, "--nnodes") or 1)
        where = f"{t.name()}: containers[{c.get('name')}]"
        if nnodes != t.group_size:
            yield f"{where}: --nnodes {nnodes} but its group has {t.group_size} pod(s)"
        if tp != gpus * nnodes:
            yield (f"{where}: --tensor-parallel-size {tp} does not fit: the pod requests {gpus} {GPU} over {nnodes} "
                   f"pod(s) of its group, {gpus * nnodes} GPUs")
        instance_type = (t.spec.get("nodeSelector", {}) or {}).get(INSTANCE_TYPE_LABEL)
        instance_type = instance_type.removeprefix("ml.") if isinstance(instance_type, str) else None  # HyperPod
        if instance_type not in by_type:
            yield (f"{t.name()}: spec.nodeSelector must pin {INSTANCE_TYPE_LABEL} to a known instance type "
                   f"({', '.join(PRESETS.values())}), got {instance_type!r}")
            continue
        hw = load_hardware(by_type[instance_type])
        interfaces = preset_facts(hw.key)["efa_interfaces"]
        if gpus > hw.gpus_per_node:
            yield f"{where}: requests {gpus} {GPU}, more than the {hw.gpus_per_node} of one {instance_type}"
        if efa > interfaces:
            yield f"{where}: requests {efa} {EFA}, more than the {interfaces} EFA interfaces of one {instance_type}"


def _url_problems(objects: list[dict[str, Any]], templates: list[_Template]) -> Iterator[str]:
    sets = {o["metadata"]["name"]: o for o in objects if o.get("kind") in ("StatefulSet", "LeaderWorkerSet")}
    for t in templates:
        for c in t.spec.get("containers", []) or []:
            args = c.get("args", []) or []
            for flag, role in (("--prefill", "prefill"), ("--decode", "decode"), ("--store", "store")):
                for url in flag_values(args, flag):
                    yield from _url_target(f"{t.name()}: containers[{c.get('name')}] {flag}", url, role, sets,
                                           templates)


def _url_target(where: str, url: str, role: str, sets: dict[str, dict[str, Any]],
                templates: list[_Template]) -> Iterator[str]:
    parts = urlsplit(url)
    m = _POD_HOST.match(parts.hostname or "")
    if not m:
        if (parts.hostname or "").endswith(".svc"):
            yield f"{where} {url}: not a pod's name <set>-<i>.<service>.<namespace>.svc"
        return  # an address outside the cluster: nothing to check here
    workload = sets.get(m["set"])
    if workload is None:
        yield f"{where} {url}: no StatefulSet or LeaderWorkerSet {m['set']!r} is rendered"
        return
    spec = workload.get("spec", {})
    governing = spec.get("serviceName") if workload["kind"] == "StatefulSet" else workload["metadata"]["name"]
    if m["sub"] != governing:
        yield f"{where} {url}: {ident(workload)}'s pods are named under {governing!r}, not {m['sub']!r}"
    if m["ns"] != workload["metadata"].get("namespace"):
        yield f"{where} {url}: {ident(workload)} is in namespace {workload['metadata'].get('namespace')!r}"
    if int(m["index"]) >= int(spec.get("replicas", 1)):
        yield f"{where} {url}: {ident(workload)} has {spec.get('replicas', 1)} replica(s), no pod {m['index']}"
    own = [t for t in templates if t.owner is workload and not t.where.endswith("workerTemplate")] or \
          [t for t in templates if t.owner is workload]
    if own and own[0].labels.get(COMPONENT) != role:
        yield f"{where} {url}: {ident(workload)} is a {own[0].labels.get(COMPONENT)!r}, not a {role!r}"
    if own and parts.port is not None and not _exposes(own[0], parts.port):
        yield f"{where} {url}: port {parts.port} is not a port of {ident(workload)}'s pods"


def consistency_problems(objects: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    templates = _templates(objects)
    secrets = {o["metadata"]["name"]: set(o.get("data", {}) or {}) | set(o.get("stringData", {}) or {})
               for o in objects if o.get("kind") == "Secret"}
    configmaps = {o["metadata"]["name"]: set(o.get("data", {}) or {}) | set(o.get("binaryData", {}) or {})
                  for o in objects if o.get("kind") == "ConfigMap"}
    services = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "Service"}
    namespaces = {o["metadata"]["name"] for o in objects if o.get("kind") == "Namespace"}

    for obj in objects:
        ns = obj.get("metadata", {}).get("namespace")
        if obj.get("kind") != "Namespace" and namespaces and ns not in namespaces:
            problems.append(f"{ident(obj)}: metadata.namespace {ns!r} is not the rendered Namespace")
        spec = obj.get("spec", {}) or {}
        kind = obj.get("kind")
        if kind == "Service" and spec.get("selector"):
            chosen = [t for t in templates if _selects(spec["selector"], t.labels)]
            if not chosen:
                problems.append(f"{ident(obj)}: spec.selector {spec['selector']} selects no pod template")
            for p in spec.get("ports", []) or []:
                target = p.get("targetPort", p.get("port"))
                for t in chosen:
                    if not _exposes(t, target):
                        problems.append(f"{ident(obj)}: port {p.get('name')!r} targets {target!r}, which "
                                        f"{t.name()} does not expose")
        if kind in ("StatefulSet", "Deployment"):
            match = (spec.get("selector", {}) or {}).get("matchLabels")
            labels = (spec.get("template", {}).get("metadata", {}) or {}).get("labels", {}) or {}
            if not _selects(match, labels):
                problems.append(f"{ident(obj)}: spec.selector.matchLabels {match} does not select its own template")
        if kind == "StatefulSet":
            governing = services.get(spec.get("serviceName"))
            if governing is None:
                problems.append(f"{ident(obj)}: spec.serviceName {spec.get('serviceName')!r} is not a rendered Service")
            elif governing["spec"].get("clusterIP") != "None" or not _selects(
                    governing["spec"].get("selector"), spec.get("template", {}).get("metadata", {}).get("labels", {})):
                problems.append(f"{ident(obj)}: spec.serviceName {spec.get('serviceName')!r} must be a headless "
                                "Service selecting its pods (it gives them their DNS names)")
        if kind == "PodDisruptionBudget":
            match = (spec.get("selector", {}) or {}).get("matchLabels")
            if not any(_selects(match, t.labels) for t in templates):
                problems.append(f"{ident(obj)}: spec.selector.matchLabels {match} selects no pod template")
        if kind == "ServiceMonitor":
            match = (spec.get("selector", {}) or {}).get("matchLabels")
            chosen = [s for s in services.values() if _selects(match, s["metadata"].get("labels", {}) or {})]
            if not chosen:
                problems.append(f"{ident(obj)}: spec.selector.matchLabels {match} selects no Service")
            for e in spec.get("endpoints", []) or []:
                for s in chosen:
                    if e.get("port") and e["port"] not in {p.get("name") for p in s["spec"].get("ports", [])}:
                        problems.append(f"{ident(obj)}: endpoint port {e['port']!r} is not a port of {ident(s)}")
                cred = (e.get("authorization", {}) or {}).get("credentials")
                if cred:
                    problems += list(_ref(f"{ident(obj)}: endpoints.authorization", "Secret", cred.get("name"),
                                          cred.get("key"), cred.get("optional", False), secrets))
    for t in templates:
        problems += list(_container_problems(t, secrets, configmaps))
    problems += list(_server_problems(templates))
    problems += list(_url_problems(objects, templates))
    return problems


def check_manifests(objects: list[dict[str, Any]], version: str = KUBERNETES_VERSION) -> list[str]:
    """Every problem, schema first; an empty list when the manifests hold together."""
    return schema_problems(objects, version) + consistency_problems(objects)


__all__ = ["CUSTOM_SCHEMAS", "KUBERNETES_VERSION", "check_manifests", "consistency_problems", "flag_values", "ident",
           "schema_problems"]
