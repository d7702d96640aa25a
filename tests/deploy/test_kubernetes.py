"""`bidikv deploy manifests`: Kubernetes manifests for XpYd from the same deploy.toml, checked offline.

The manifests are checked against the strict schemas kubernetes-validate ships for the stated Kubernetes
version (and the vendored CRD schemas), and against each other (k8s_check.consistency_problems). No API
server, no EFA here: what runs is the rendering and every offline check; each check is shown to fail on a
manifest broken the way it guards against.
"""

from __future__ import annotations

import copy
import json
import os
import stat

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.hardware import PRESETS, load_hardware
from impl.deploy.cli import main
from impl.deploy.config import DeployConfigError, parse_config
from impl.deploy.k8s_check import KUBERNETES_VERSION, check_manifests, consistency_problems, schema_problems
from impl.deploy.k8s_check import flag_values as flag
from impl.deploy.k8s_render import render_manifests, to_yaml
from impl.deploy.render import kv_transfer_config
from tests.deploy.conftest import sample, to_toml

ENV = {"BIDIKV_STORE_PASSWORD": "s3cret", "BIDIKV_API_KEYS": "acme=k1", "BIDIKV_METRICS_TOKEN": "m-token"}
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/bidikv-vllm:0.32.0"


def k8s_sample(prefill: int = 1, decode: int = 1, tp: int = 8, **kubernetes) -> dict:
    config = sample()
    config["model"]["tensor_parallel_size"] = tp
    config["kubernetes"] = {"image": IMAGE, "prefill_replicas": prefill, "decode_replicas": decode, **kubernetes}
    return config


def render(config: dict, mode: str = "on", env: dict | None = None):
    return render_manifests(parse_config(config, "my.toml"), mode, ENV if env is None else env)


def by(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert found, (kind, name)
    return found if name is None else found[0]


def container(workload, template="template"):
    spec = workload["spec"]
    t = spec[template] if template == "template" else spec["leaderWorkerTemplate"][template]
    return t["spec"]["containers"][0]




CONFIGS = {
    "1P1D": dict(prefill=1, decode=1),
    "2P4D": dict(prefill=2, decode=4),
    "2P2D-TP16-LWS": dict(prefill=2, decode=2, tp=16),
}


@pytest.mark.parametrize("shape", list(CONFIGS))
@pytest.mark.parametrize("mode", ["on", "off"])
def test_rendered_manifests_pass_every_check(shape, mode):
    rendered = render(k8s_sample(**CONFIGS[shape]), mode)
    assert schema_problems(rendered.objects, KUBERNETES_VERSION) == []
    assert consistency_problems(rendered.objects) == []
    assert rendered.warnings == []  # API keys, metrics token and store password all given


def test_xpyd_shape_the_router_sees_every_instance():
    objects = render(k8s_sample(prefill=2, decode=4)).objects
    p, d = by(objects, "StatefulSet", "bidikv-prefill"), by(objects, "StatefulSet", "bidikv-decode")
    assert (p["spec"]["replicas"], d["spec"]["replicas"]) == (2, 4)
    router = container(by(objects, "Deployment", "bidikv-router"))
    assert flag(router["args"], "--prefill") == [f"http://bidikv-prefill-{i}.bidikv-prefill.bidikv.svc:8100"
                                                 for i in range(2)]
    assert flag(router["args"], "--decode") == [f"http://bidikv-decode-{i}.bidikv-decode.bidikv.svc:8200"
                                                for i in range(4)]
    assert flag(router["args"], "--store") == ["redis://bidikv-store-0.bidikv-store.bidikv.svc:6379/0"]
    # each replica is notified at its own pod IP: D posts to the router that holds the turn
    assert flag(router["args"], "--notify-url") == ["http://$(POD_IP):9000/internal/kv_params"]
    assert by(objects, "Deployment", "bidikv-router")["spec"]["replicas"] == 2
    assert {o["metadata"]["name"] for o in by(objects, "PodDisruptionBudget")} == {
        "bidikv-prefill", "bidikv-decode", "bidikv-router", "bidikv-store"}


def test_p_and_d_run_the_ssh_recipes_engine_flags_with_the_instance_presets_resources():
    config = k8s_sample()
    parsed = parse_config(config, "my.toml")
    objects = render(config).objects
    for role, port, side in (("prefill", 8100, 5600), ("decode", 8200, 5601)):
        c = container(by(objects, "StatefulSet", f"bidikv-{role}"))
        kv = json.loads(flag(c["args"], "--kv-transfer-config")[0])
        assert kv == kv_transfer_config(parsed, role, "on")  # the same key names and values as the ssh recipe
        assert flag(c["args"], "--port") == [str(port)] and flag(c["args"], "--tensor-parallel-size") == ["8"]
        limits = c["resources"]["limits"]
        # p5en.48xlarge: 8 H200 and 16 EFA interfaces (calibration/data/hardware_p5en.json)
        assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == ("8", "16")
        assert limits["hugepages-2Mi"] == "5120Mi" and c["resources"]["requests"] == limits
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(side)
        assert env["FI_PROVIDER"]["value"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"]["value"] == "1"
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port, "nixl": side}
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        pod = by(objects, "StatefulSet", f"bidikv-{role}")["spec"]["template"]["spec"]
        assert "hostNetwork" not in pod  # EFA needs the device, not the host network
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
    assert "--no-enable-prefix-caching" in container(by(objects, "StatefulSet", "bidikv-prefill"))["args"]


def test_instance_presets_set_gpus_and_efa_per_pod():
    config = k8s_sample(tp=2)
    config["deploy"]["instance_type"] = "p5.48xlarge"
    limits = container(by(render(config).objects, "StatefulSet", "bidikv-decode"))["resources"]["limits"]
    # a TP-2 pod takes 2 of p5's 8 GPUs and the same share of its 32 EFA interfaces, vCPUs and RAM
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"], limits["cpu"]) == ("2", "8", "36")


def _expand(args: list[str], values: dict[str, str]) -> list[str]:
    """What the kubelet does to $(VAR) in a container's args."""
    for name, value in values.items():
        args = [a.replace(f"$({name})", value) for a in args]
    return args


def test_the_rendered_commands_parse_with_the_installed_vllm_and_the_router():
    """The real parsers, not a shape check: vLLM 0.32's serve parser (the api_server's and `vllm serve`'s
    make_arg_parser) and its EngineArgs take every P/D command, LWS leader and worker included, and the
    router's own CLI builds a RouterConfig from the router's."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from impl.router.cli import add_arguments, config_from_args

    lws_values = {"LWS_LEADER_ADDRESS": "bidikv-decode-0.bidikv-decode", "LWS_WORKER_INDEX": "1"}
    for shape, tp in (("1P1D", 8), ("2P2D-TP16-LWS", 16)):
        objects = render(k8s_sample(**CONFIGS[shape])).objects
        servers = [(o, t) for o in objects if o["kind"] in ("StatefulSet", "LeaderWorkerSet")
                   and o["metadata"]["name"] != "bidikv-store"
                   for t in (("template",) if o["kind"] == "StatefulSet" else ("leaderTemplate", "workerTemplate"))]
        assert len(servers) == (2 if tp == 8 else 4)
        for workload, template in servers:
            c = container(workload, template)
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(_expand(c["args"], lws_values))
            validate_parsed_serve_args(args)
            engine = AsyncEngineArgs.from_cli_args(args)
            assert engine.tensor_parallel_size == tp and engine.model == "Qwen/Qwen3-32B"
            assert engine.kv_transfer_config.kv_connector_module_path == "impl.connector"
            assert engine.kv_transfer_config.kv_role == ("kv_producer" if "prefill" in workload["metadata"]["name"]
                                                         else "kv_consumer")
            if tp > 8:
                assert (engine.nnodes, engine.node_rank) == (2, 0 if template == "leaderTemplate" else 1)
                assert engine.master_addr == "bidikv-decode-0.bidikv-decode"
                assert args.headless == (template == "workerTemplate")
        router = container(by(objects, "Deployment", "bidikv-router"))
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        config = config_from_args(parser.parse_args(_expand(router["args"], {"POD_IP": "10.1.2.3"})))
        assert config.notify_url == "http://10.1.2.3:9000/internal/kv_params" and config.notify
        assert config.store.startswith("redis://bidikv-store-0.") and len(config.decode) == CONFIGS[shape]["decode"]


def test_hyperpod_nodes_are_selected_by_their_ml_instance_type():
    objects = render(k8s_sample(node_instance_type="ml.p5en.48xlarge")).objects
    pod = by(objects, "StatefulSet", "bidikv-decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5en.48xlarge"}
    assert consistency_problems(objects) == []  # the checker finds the p5en preset behind the ml. prefix


def test_lease_heartbeat_port_is_exposed_on_d():
    config = k8s_sample()
    config["connector"].update(bidikv_retention="lease", bidikv_heartbeat_port=5700)
    objects = render(config).objects
    assert consistency_problems(objects) == []
    d = container(by(objects, "StatefulSet", "bidikv-decode"))
    assert {"name": "heartbeat", "containerPort": 5700, "protocol": "TCP"} in d["ports"]
    assert "heartbeat" in {p["name"] for p in by(objects, "Service", "bidikv-decode")["spec"]["ports"]}


def test_a_tp_spanning_instances_is_a_leaderworkerset_of_whole_instances():
    objects = render(k8s_sample(prefill=2, decode=2, tp=16)).objects
    lws = by(objects, "LeaderWorkerSet", "bidikv-decode")
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader, worker = container(lws, "leaderTemplate"), container(lws, "workerTemplate")
    assert flag(leader["args"], "--nnodes") == ["2"] and flag(leader["args"], "--node-rank") == ["0"]
    assert flag(worker["args"], "--node-rank") == ["$(LWS_WORKER_INDEX)"] and "--headless" in worker["args"]
    assert flag(worker["args"], "--master-addr") == ["$(LWS_LEADER_ADDRESS)"]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "readinessProbe" in leader and "readinessProbe" not in worker  # workers serve no HTTP
    # the router reaches the leaders by the names the LWS controller's headless Service gives them
    router = container(by(objects, "Deployment", "bidikv-router"))
    assert flag(router["args"], "--decode") == [f"http://bidikv-decode-{i}.bidikv-decode.bidikv.svc:8200"
                                                for i in range(2)]
    assert by(objects, "Service", "bidikv-decode-leader")["spec"]["selector"]["bidikv.io/lws-role"] == "leader"


def test_secrets_come_from_the_environment_and_reach_the_pods_that_need_them():
    env = dict(ENV, BIDIKV_UPSTREAM_API_KEY="up", HF_TOKEN="hf")
    objects = render(k8s_sample(), env=env).objects
    secret = by(objects, "Secret", "bidikv-secrets")
    assert secret["stringData"] == {"api-keys": "acme=k1", "hf-token": "hf", "metrics-token": "m-token",
                                    "store-password": "s3cret", "upstream-api-key": "up"}
    d_env = {e["name"]: e for e in container(by(objects, "StatefulSet", "bidikv-decode"))["env"]}
    assert d_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "bidikv-secrets", "key": "upstream-api-key"}
    router_env = {e["name"] for e in container(by(objects, "Deployment", "bidikv-router"))["env"]}
    assert {"BIDIKV_API_KEYS", "BIDIKV_METRICS_TOKEN", "BIDIKV_STORE_PASSWORD", "BIDIKV_UPSTREAM_API_KEY"} <= router_env
    monitor = by(objects, "ServiceMonitor", "bidikv-router")["spec"]["endpoints"][0]
    assert monitor["authorization"]["credentials"] == {"name": "bidikv-secrets", "key": "metrics-token"}
    assert consistency_problems(objects) == []


def test_an_external_store_renders_no_statefulset():
    objects = render(k8s_sample(store="redis://store.example.internal:6379/2"), env={}).objects
    assert not [o for o in objects if o["metadata"]["name"] == "bidikv-store"]
    router = container(by(objects, "Deployment", "bidikv-router"))
    assert flag(router["args"], "--store") == ["redis://store.example.internal:6379/2"]
    assert check_manifests(objects) == []


def test_monitoring_off_renders_no_prometheus_operator_objects():
    kinds = {o["kind"] for o in render(k8s_sample(monitoring=False)).objects}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}


def test_yaml_round_trips_and_the_cli_writes_it_private(tmp_path, monkeypatch, capsys):
    rendered = render(k8s_sample(prefill=2, decode=4))
    text = to_yaml(rendered.objects)
    assert list(yaml.safe_load_all(text)) == rendered.objects and "&id" not in text
    cfg = tmp_path / "deploy.toml"
    cfg.write_text(to_toml(k8s_sample(prefill=2, decode=4)))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "manifests.yaml"
    assert main(["manifests", "--config", str(cfg), "--out", str(out)]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600  # it holds the Secret's values
    assert out.read_text() == text
    assert main(["check-manifests", str(out)]) == 0
    assert f"{len(rendered.objects)} objects: OK" in capsys.readouterr().out


# --- a bad deploy.toml is an error naming the key -------------------------------------------------------

def _k(key, value):
    def mutate(config):
        config["kubernetes"][key] = value
    return mutate


BAD = [
    (_k("prefil_replicas", 2), "kubernetes.prefil_replicas", "unknown setting"),
    (_k("decode_replicas", 0), "kubernetes.decode_replicas", ">= 1"),
    (_k("hugepages", "5 GiB"), "kubernetes.hugepages", "quantity"),
    (_k("shm_size", "0"), "kubernetes.shm_size", "more than zero"),
    (_k("name", "Bidikv_Prod"), "kubernetes.name", "DNS label"),
    (_k("store", "memory"), "kubernetes.store", "shared by the router's replicas"),
    (_k("store", "redis://:pw@store:6379/0"), "kubernetes.store", "must not hold a password"),
    (_k("store", "unix:///tmp/redis.sock"), "kubernetes.store", "redis:// or rediss://"),
    (_k("image", "my image"), "kubernetes.image", "container image"),
    (_k("image_pull_policy", "Sometimes"), "kubernetes.image_pull_policy", "IfNotPresent"),
    (_k("model_cache", "relative/path"), "kubernetes.model_cache", "absolute path"),
    (_k("node_instance_type", "p5.48xlarge"), "kubernetes.node_instance_type", "must be deploy.instance_type"),
    (lambda c: c["kubernetes"].pop("image"), "kubernetes.image", "required"),
    (lambda c: c["model"].update(tensor_parallel_size=12), "model.tensor_parallel_size", "not a multiple of 8"),
]


@pytest.mark.parametrize("mutate,field,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_kubernetes_config_names_the_key(mutate, field, words):
    config = k8s_sample()
    mutate(config)
    with pytest.raises(DeployConfigError) as caught:
        parse_config(config, "my.toml")
    assert str(caught.value).startswith(f"my.toml: {field}: ") and words in str(caught.value)


RENDER_ERRORS = [
    (lambda c: c.pop("kubernetes"), ENV, "my.toml: kubernetes: section is required"),
    (lambda c: c["deploy"].update(instance_type="trn2.48xlarge"), ENV, "my.toml: deploy.instance_type: "),
    (lambda c: c["router"].update(extra_args=["--store", "redis://x:1/0"]), ENV, "my.toml: router.extra_args: --store"),
    (lambda c: None, {"BIDIKV_API_KEYS": "a=b"}, "environment: BIDIKV_STORE_PASSWORD: is unset"),
    (lambda c: None, {"BIDIKV_API_KEYS": "a=b", "BIDIKV_STORE_PASSWORD": "x"},
     "environment: BIDIKV_METRICS_TOKEN: is unset while BIDIKV_API_KEYS is set"),
]


@pytest.mark.parametrize("mutate,env,message", RENDER_ERRORS, ids=[r[2] for r in RENDER_ERRORS])
def test_what_only_rendering_can_refuse_names_the_key(mutate, env, message):
    config = k8s_sample()
    mutate(config)
    with pytest.raises(DeployConfigError) as caught:
        render(config, env=env)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_cli_refuses_a_bad_config_naming_the_key_and_prints_nothing(tmp_path, capsys):
    config = k8s_sample()
    config["kubernetes"]["router_replicas"] = -1
    path = tmp_path / "deploy.toml"
    path.write_text(to_toml(config))
    done = _run_cli(["manifests", "--config", str(path)])
    assert done.returncode == 2 and done.stdout == ""
    assert "kubernetes.router_replicas: must be an integer >= 1" in done.stderr and "Traceback" not in done.stderr


def _run_cli(args):
    import subprocess
    import sys

    from tests.deploy.conftest import ROOT

    return subprocess.run([sys.executable, "-m", "impl.deploy", *args], capture_output=True, text=True,
                          cwd=str(ROOT), env={**os.environ, **ENV}, timeout=120)


# --- each offline check fails on the manifests it guards against --------------------------------------

def _mutated(shape, mutate):
    objects = copy.deepcopy(render(k8s_sample(**CONFIGS[shape])).objects)
    mutate(objects)
    return objects


def _drop(kind, name):
    def mutate(objects):
        objects[:] = [o for o in objects if not (o["kind"] == kind and o["metadata"]["name"] == name)]
    return mutate


def _edit(kind, name, change):
    def mutate(objects):
        change(by(objects, kind, name))
    return mutate


def _set_arg(args, name, value):
    if name in args:
        args[args.index(name) + 1] = value
    else:
        args += [name, value]


BROKEN = [
    ("1P1D", _drop("Secret", "bidikv-secrets"),
     "containers[router].env[BIDIKV_STORE_PASSWORD]: references Secret 'bidikv-secrets', which is not rendered"),
    ("1P1D", _edit("Secret", "bidikv-secrets", lambda o: o["stringData"].pop("metrics-token")),
     "ServiceMonitor/bidikv-router: endpoints.authorization: references key 'metrics-token' of Secret "
     "'bidikv-secrets'"),
    ("1P1D", _drop("ConfigMap", "bidikv-grafana-dashboard"), None),  # nothing references it: no problem
    ("1P1D", _edit("Service", "bidikv-decode", lambda o: o["spec"]["selector"].update({
        "app.kubernetes.io/component": "decoder"})), "Service/bidikv-decode: spec.selector"),
    ("1P1D", _edit("Service", "bidikv-router", lambda o: o["spec"]["ports"][0].update(targetPort="metrics")),
     "Service/bidikv-router: port 'http' targets 'metrics', which Deployment/bidikv-router: spec.template does not "
     "expose"),
    ("1P1D", _edit("StatefulSet", "bidikv-decode",
                   lambda o: container(o)["readinessProbe"]["httpGet"].update(port="healthz")),
     "StatefulSet/bidikv-decode: spec.template: containers[vllm].readinessProbe: port 'healthz' is not a port"),
    ("2P4D", _edit("StatefulSet", "bidikv-prefill", lambda o: container(o).update(image="vllm/vllm-openai:v0.33.0")),
     "P and D must run one image"),
    ("2P4D", _edit("StatefulSet", "bidikv-decode", lambda o: _set_arg(container(o)["args"], "--block-size", "32")),
     "P and D must run one --block-size"),
    ("1P1D", _edit("StatefulSet", "bidikv-decode", lambda o: [
        container(o)["resources"][k].update({"nvidia.com/gpu": "4"}) for k in ("requests", "limits")]),
     "--tensor-parallel-size 8 does not fit: the pod requests 4 nvidia.com/gpu"),
    ("1P1D", _edit("StatefulSet", "bidikv-decode", lambda o: [
        container(o)["resources"][k].update({"vpc.amazonaws.com/efa": "32"}) for k in ("requests", "limits")]),
     "requests 32 vpc.amazonaws.com/efa, more than the 16 EFA interfaces of one p5en.48xlarge"),
    ("1P1D", _edit("StatefulSet", "bidikv-decode", lambda o: container(o)["resources"]["requests"].update({
        "hugepages-2Mi": "2Gi"})), "hugepages-2Mi must request what it limits"),
    ("2P2D-TP16-LWS", _edit("LeaderWorkerSet", "bidikv-decode",
                            lambda o: o["spec"]["leaderWorkerTemplate"].update(size=3)),
     "--nnodes 2 but its group has 3 pod(s)"),
    ("2P4D", _edit("StatefulSet", "bidikv-decode", lambda o: o["spec"].update(replicas=3)),
     "bidikv-decode-3.bidikv-decode.bidikv.svc:8200: StatefulSet/bidikv-decode has 3 replica(s), no pod 3"),
    ("1P1D", _edit("Deployment", "bidikv-router", lambda o: container(o)["args"].__setitem__(
        container(o)["args"].index("--decode") + 1, "http://bidikv-prefill-0.bidikv-prefill.bidikv.svc:8100")),
     "StatefulSet/bidikv-prefill is a 'prefill', not a 'decode'"),
    ("1P1D", _edit("StatefulSet", "bidikv-store", lambda o: o["spec"].update(serviceName="bidikv-redis")),
     "StatefulSet/bidikv-store: spec.serviceName 'bidikv-redis' is not a rendered Service"),
    ("1P1D", _edit("ServiceMonitor", "bidikv-vllm", lambda o: o["spec"]["endpoints"][0].update(port="metrics")),
     "ServiceMonitor/bidikv-vllm: endpoint port 'metrics' is not a port of Service/bidikv-prefill"),
    ("1P1D", _edit("Deployment", "bidikv-router", lambda o: container(o)["args"].append("$(ROUTER_TOKEN)")),
     "$(ROUTER_TOKEN) in its command is not defined in its env"),
    ("1P1D", _edit("StatefulSet", "bidikv-decode", lambda o: container(o)["volumeMounts"].append(
        {"name": "scratch", "mountPath": "/scratch"})), "volumeMounts[scratch]: no volume"),
]


@pytest.mark.parametrize("shape,mutate,problem", BROKEN, ids=[str(b[2])[:60] for b in BROKEN])
def test_consistency_checks_catch_what_a_schema_cannot(shape, mutate, problem):
    objects = _mutated(shape, mutate)
    problems = consistency_problems(objects)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems
    assert schema_problems(objects) == []  # each of these is valid object by object


SCHEMA_BROKEN = [
    (_edit("StatefulSet", "bidikv-store", lambda o: o["spec"]["template"]["spec"].update(
        contaners=o["spec"]["template"]["spec"].pop("containers"))), "StatefulSet/bidikv-store: spec.template.spec"),
    (_edit("Deployment", "bidikv-router", lambda o: o["spec"].update(replicas="two")),
     "Deployment/bidikv-router: spec.replicas: 'two' is not of type 'integer'"),
    (_edit("Service", "bidikv-router", lambda o: o["spec"]["ports"][0].update(port="http")),
     "Service/bidikv-router: spec.ports.0.port"),
    (_edit("LeaderWorkerSet", "bidikv-prefill", lambda o: o["spec"]["leaderWorkerTemplate"].update(
        restartPolicy="Always")), "LeaderWorkerSet/bidikv-prefill: spec.leaderWorkerTemplate.restartPolicy"),
    (_edit("LeaderWorkerSet", "bidikv-prefill", lambda o: container(o, "workerTemplate").update(
        imagePullPolicy=7)), "LeaderWorkerSet/bidikv-prefill: spec.leaderWorkerTemplate.workerTemplate.spec"),
    (_edit("ServiceMonitor", "bidikv-vllm", lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
     "ServiceMonitor/bidikv-vllm: spec.endpoints.0.interval"),
    (_edit("PrometheusRule", "bidikv-alerts", lambda o: o["spec"]["groups"][0]["rules"][0].update(record="x")),
     "PrometheusRule/bidikv-alerts: spec.groups.0.rules.0"),
]


@pytest.mark.parametrize("mutate,problem", SCHEMA_BROKEN, ids=[b[1][:60] for b in SCHEMA_BROKEN])
def test_schemas_catch_a_malformed_object(mutate, problem):
    objects = _mutated("2P2D-TP16-LWS", mutate)
    problems = schema_problems(objects)
    assert any(p.startswith(problem) for p in problems), problems


def test_check_manifests_cli_names_the_problem(tmp_path):
    objects = _mutated("1P1D", _drop("Secret", "bidikv-secrets"))
    path = tmp_path / "edited.yaml"
    path.write_text(to_yaml(objects))
    done = _run_cli(["check-manifests", str(path)])
    assert done.returncode == 1 and "references Secret 'bidikv-secrets', which is not rendered" in done.stderr


@pytest.mark.parametrize("version, words", [("1.99", "no schemas for Kubernetes 1.99"), ("latest", "not a version")])
def test_an_unknown_kubernetes_version_is_a_named_error(tmp_path, version, words):
    path = tmp_path / "deploy.toml"
    path.write_text(to_toml(k8s_sample()))
    done = _run_cli(["manifests", "--config", str(path), "--kubernetes-version", version])
    assert done.returncode == 2 and done.stdout == "" and words in done.stderr and "Traceback" not in done.stderr


def test_an_older_kubernetes_version_is_checked_against_its_own_schemas():
    objects = render(k8s_sample(prefill=2, decode=4)).objects
    assert schema_problems(objects, "1.30") == []


def test_the_shipped_deploy_toml_renders_and_passes_every_check():
    from impl.deploy.config import load_config
    from tests.deploy.conftest import DEPLOY_DIR

    config = load_config(DEPLOY_DIR / "deploy.toml")
    assert config.kubernetes is not None and config.kubernetes.router_replicas == 2
    assert check_manifests(render_manifests(config, "on", ENV).objects) == []


# --- any valid deploy.toml renders manifests that pass every check -------------------------------------


@st.composite
def _configs(draw):
    instance = draw(st.sampled_from(sorted(v for k, v in PRESETS.items() if k != "trn2")))
    per_node = load_hardware(instance).gpus_per_node
    tp = draw(st.sampled_from([1, 2, 4, per_node, 2 * per_node, 3 * per_node]))
    config = k8s_sample(prefill=draw(st.integers(1, 6)), decode=draw(st.integers(1, 6)), tp=tp,
                        router_replicas=draw(st.integers(1, 4)), monitoring=draw(st.booleans()),
                        hugepages=draw(st.sampled_from(["", "2Gi", "5120Mi"])),
                        model_cache=draw(st.sampled_from(["", "/opt/dlami/nvme/hf"])),
                        store=draw(st.sampled_from(["statefulset", "redis://cache.internal:6379/1"])),
                        name=draw(st.sampled_from(["bidikv", "p-d-7"])), namespace=draw(st.sampled_from(["bidikv", "llm"])))
    config["deploy"]["instance_type"] = instance
    if draw(st.booleans()):
        config["connector"].update(bidikv_retention="lease", bidikv_heartbeat_port=draw(st.integers(5700, 5710)))
    block = draw(st.sampled_from([None, "16", "32"]))
    if block:
        for role in ("prefill", "decode"):
            config[role]["extra_args"] = ["--block-size", block]
    env = {k: v for k, v in {"BIDIKV_STORE_PASSWORD": "pw", "BIDIKV_API_KEYS": draw(st.sampled_from(["", "a=k"])),
                             "BIDIKV_UPSTREAM_API_KEY": draw(st.sampled_from(["", "up"])),
                             "HF_TOKEN": draw(st.sampled_from(["", "hf"]))}.items() if v}
    if "BIDIKV_API_KEYS" in env:
        env["BIDIKV_METRICS_TOKEN"] = "m"
    return config, env, draw(st.sampled_from(["on", "off"]))


@settings(max_examples=40)
@given(_configs())
def test_any_valid_config_renders_manifests_that_pass_every_check(drawn):
    config, env, mode = drawn
    rendered = render(config, mode, env)
    assert check_manifests(rendered.objects) == []
    k = config["kubernetes"]
    router = container(by(rendered.objects, "Deployment", f"{k['name']}-router"))
    assert len(flag(router["args"], "--decode")) == k["decode_replicas"]
    assert [o["metadata"]["namespace"] for o in rendered.objects[1:]] == [k["namespace"]] * (len(rendered.objects) - 1)
