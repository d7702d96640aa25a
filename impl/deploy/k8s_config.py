"""The ``[kubernetes]`` table of ``deploy.toml``: what the Kubernetes manifests need beyond the ssh recipe's keys.

Everything the two recipes share (model, TP, ports, NIXL backends and EFA environment, connector keys,
router flags, ``deploy.instance_type``, ``deploy.python``, ``deploy.workdir``) keeps its one key in its own
table; this table holds only what exists on Kubernetes alone (image, replica counts, the fleet store,
volumes, resource requests). The ssh recipe ignores it. Errors name ``kubernetes.<key>`` like every
other deploy error (:class:`impl.deploy.config.DeployConfigError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from impl.router.stores import check_store_url, redact

# A Kubernetes resource quantity (apimachinery resource.Quantity: decimal or binary SI suffix).
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# DNS-1123 label; kept to 40 characters so "<name>-decode-<i>" and the StatefulSet's controller-revision-hash
# label ("<sts name>-<10-char hash>", at most 63) stay within Kubernetes' limits.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX = 40
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")
PULL_POLICIES = ("IfNotPresent", "Always", "Never")
STORE_STATEFULSET = "statefulset"


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str
    name: str  # prefix of every object's name and the app.kubernetes.io/instance label
    image: str  # GPU vLLM + nixl (LIBFABRIC) + this checkout at deploy.workdir; the router runs from it too
    image_pull_policy: str
    prefill_replicas: int  # X
    decode_replicas: int  # Y
    router_replicas: int
    store: str  # "statefulset" (rendered here) or the redis:// URL of an external Redis-compatible store
    store_image: str
    store_storage: str
    storage_class: str  # "" = the cluster's default StorageClass
    hugepages: str  # hugepages-2Mi per P/D pod; "" = none
    shm_size: str  # /dev/shm of P and D (a memory-backed emptyDir)
    server_cpu: str  # "" = derived from the instance preset
    server_memory: str
    router_cpu: str
    router_memory: str
    model_cache: str  # node path holding the Hugging Face cache; "" = an emptyDir per pod
    node_instance_type: str  # the nodes' node.kubernetes.io/instance-type; "" = deploy.instance_type
    monitoring: bool  # ServiceMonitors, PrometheusRule, Grafana dashboard ConfigMap


def parse_kubernetes(table: Any, instance_type: str) -> KubernetesSettings:
    """``table`` is a :class:`impl.deploy.config._Table` over ``[kubernetes]`` (its getters name the key);
    ``instance_type`` is ``deploy.instance_type`` resolved (``p5en.48xlarge``)."""
    t = table

    def name(key: str, default: str) -> str:
        value = t.text(key, default)
        if len(value) > _NAME_MAX or not _NAME.match(value):
            raise t.fail(key, f"must be a lowercase DNS label of at most {_NAME_MAX} characters "
                              f"(a-z, 0-9, '-'), got {value!r}")
        return value

    def quantity(key: str, default: str, *, allow_empty: bool = False) -> str:
        value = t.text(key, default, allow_empty=allow_empty).strip()
        if value and not _QUANTITY.match(value):
            raise t.fail(key, f"must be a Kubernetes quantity like \"64Gi\" or \"500m\", got {value!r}")
        if value and float(re.sub(r"[A-Za-z]+$", "", value)) == 0:
            raise t.fail(key, f"must be more than zero, got {value!r}" + (" (\"\" for none)" if allow_empty else ""))
        return value

    def image(key: str, default: Any = None) -> str:
        value = t.text(key, default).strip()
        if not _IMAGE.match(value):
            raise t.fail(key, f"must be a container image reference like registry/repo:tag, got {value!r}")
        return value

    settings = KubernetesSettings(
        namespace=name("namespace", "bidikv"),
        name=name("name", "bidikv"),
        image=image("image"),
        image_pull_policy=t.text("image_pull_policy", "IfNotPresent"),
        prefill_replicas=t.integer("prefill_replicas", 1, minimum=1),
        decode_replicas=t.integer("decode_replicas", 1, minimum=1),
        router_replicas=t.integer("router_replicas", 2, minimum=1),
        store=t.text("store", STORE_STATEFULSET).strip(),
        store_image=image("store_image", "valkey/valkey:8.1"),
        store_storage=quantity("store_storage", "10Gi"),
        storage_class=t.text("storage_class", "", allow_empty=True).strip(),
        hugepages=quantity("hugepages", "5120Mi", allow_empty=True),
        shm_size=quantity("shm_size", "64Gi"),
        server_cpu=quantity("server_cpu", "", allow_empty=True),
        server_memory=quantity("server_memory", "", allow_empty=True),
        router_cpu=quantity("router_cpu", "2"),
        router_memory=quantity("router_memory", "4Gi"),
        model_cache=t.text("model_cache", "", allow_empty=True).strip(),
        node_instance_type=t.text("node_instance_type", "", allow_empty=True).strip(),
        monitoring=t.boolean("monitoring", True),
    )
    if settings.image_pull_policy not in PULL_POLICIES:
        raise t.fail("image_pull_policy", f"must be one of {', '.join(PULL_POLICIES)}, got {settings.image_pull_policy!r}")
    if settings.store != STORE_STATEFULSET:
        if settings.store == "memory":
            raise t.fail("store", "must be shared by the router's replicas: \"statefulset\" or a redis:// URL (with "
                                  "\"memory\" each replica keeps its own conversations and a turn routed to another "
                                  "replica finds none)")
        try:
            check_store_url(settings.store)
        except ValueError as e:
            raise t.fail("store", f"must be \"statefulset\" or a redis://HOST:PORT/DB URL: {e}") from None
        if urlsplit(settings.store).scheme not in ("redis", "rediss"):
            raise t.fail("store", f"must be \"statefulset\" or a redis:// or rediss:// URL the pods reach over the "
                                  f"network, got {redact(settings.store)!r}")
        if urlsplit(settings.store).password:
            raise t.fail("store", "must not hold a password: the manifests read it from the Secret "
                                  "(BIDIKV_STORE_PASSWORD when rendering)")
    if settings.storage_class and not _NAME.match(settings.storage_class):
        raise t.fail("storage_class", f"must be a StorageClass name, got {settings.storage_class!r}")
    if settings.node_instance_type and settings.node_instance_type.removeprefix("ml.") != instance_type:
        raise t.fail("node_instance_type", f"must be deploy.instance_type ({instance_type}) as the nodes are labelled "
                                           f"with it (SageMaker HyperPod: ml.{instance_type}), got "
                                           f"{settings.node_instance_type!r}")
    if settings.model_cache and not settings.model_cache.startswith("/"):
        raise t.fail("model_cache", f"must be an absolute path on the node (or \"\" for an emptyDir), got "
                                    f"{settings.model_cache!r}")
    t.done()
    return settings


__all__ = ["KubernetesSettings", "PULL_POLICIES", "STORE_STATEFULSET", "parse_kubernetes"]
