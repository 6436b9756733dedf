"""KubeRay manifests under k8s/: they parse, compose, validate, and match the cluster config.

What is checked, and against what:
- Built-in kinds (Service, StatefulSet) and every Kubernetes type embedded in the
  RayService (pod templates, the serve Service, ObjectMeta, EnvVarSource, resource
  requirements): the strict Kubernetes 1.30 JSON schemas that `kubernetes-validate`
  ships (offline; unknown fields fail).
- The RayService itself (a CRD, absent from those schemas): a JSON schema of the
  `ray.io/v1` fields of KubeRay v1.6.2, written from KubeRay's generated API reference
  (`docs/reference/api.md` at tag v1.6.2, vendored in ray-project/ray as
  `doc/source/cluster/kubernetes/references/api.md`). Every KubeRay struct is closed
  (`additionalProperties: false`), so a misspelt or invented field fails.
- KubeRay's admission rules for GCS fault tolerance (ray-operator `validation.go`):
  no `REDIS_PASSWORD`/`RAY_REDIS_ADDRESS` env and no `redis-password` start param
  on the head when `gcsFaultToleranceOptions` is set.
- The generated files equal what `warmpath render k8s` renders, and the embedded
  serveConfigV2 is a valid `ServeDeploySchema` whose args are a valid `ClusterConfig`.

No Ray cluster, no kubectl, no network: overlays are composed by
`cluster.k8s_render.build_kustomization`.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema
from typer.testing import CliRunner

from cluster import k8s_render
from cluster.cli import app
from cluster.config import ConfigError, validate_config
from cluster.serve_config import SERVICE_NUM_CPUS, render_serve_config

K8S_DIR = k8s_render.K8S_DIR
KUBERNETES_VERSION = "1.30"
OVERLAYS = k8s_render.default_overlays()
OVERLAY_IDS = [o.name for o in OVERLAYS]
COMPOSITIONS = [K8S_DIR / "base", *OVERLAYS]
COMPOSITION_IDS = ["base", *OVERLAY_IDS]
YAML_FILES = sorted(K8S_DIR.rglob("*.yaml"))

# ---------------------------------------------------------------------------
# KubeRay v1.6.2 RayService (ray.io/v1), fields as documented in its API reference.
# Fields typed as Kubernetes objects are "object" here and validated below against
# the Kubernetes schemas instead.

_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_K8S = {"type": "object"}
_K8S_LIST = {"type": "array", "items": {"type": "object"}}


def _struct(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_REDIS_CREDENTIAL = _struct({"valueFrom": _K8S, "value": _STR})
_WORKER_GROUP = _struct(
    {
        "suspend": _BOOL,
        "groupName": _STR,
        "replicas": _INT,
        "minReplicas": _INT,
        "maxReplicas": _INT,
        "idleTimeoutSeconds": _INT,
        "resources": _STR_MAP,
        "labels": _STR_MAP,
        "rayStartParams": _STR_MAP,
        "template": _K8S,
        "scaleStrategy": _struct({"workersToDelete": {"type": "array", "items": _STR}}),
        "numOfHosts": _INT,
    },
    required=("groupName", "template"),
)
_RAY_CLUSTER_SPEC = _struct(
    {
        "upgradeStrategy": _struct({"type": {"enum": ["Recreate", "None"]}}),
        "authOptions": _struct(
            {"enableK8sTokenAuth": _BOOL, "secretName": _STR, "mode": {"enum": ["disabled", "token"]}}
        ),
        "suspend": _BOOL,
        "managedBy": _STR,
        "autoscalerOptions": _struct(
            {
                "resources": _K8S,
                "image": _STR,
                "imagePullPolicy": _STR,
                "securityContext": _K8S,
                "idleTimeoutSeconds": _INT,
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "version": {"enum": ["v1", "v2"]},
                "env": _K8S_LIST,
                "envFrom": _K8S_LIST,
                "volumeMounts": _K8S_LIST,
            }
        ),
        "headServiceAnnotations": _STR_MAP,
        "enableInTreeAutoscaling": _BOOL,
        "gcsFaultToleranceOptions": _struct(
            {
                "redisUsername": _REDIS_CREDENTIAL,
                "redisPassword": _REDIS_CREDENTIAL,
                "externalStorageNamespace": _STR,
                "redisAddress": _STR,
            }
        ),
        "headGroupSpec": _struct(
            {
                "template": _K8S,
                "headService": _K8S,
                "enableIngress": _BOOL,
                "resources": _STR_MAP,
                "labels": _STR_MAP,
                "rayStartParams": _STR_MAP,
                "serviceType": _STR,
            },
            required=("template",),
        ),
        "rayVersion": _STR,
        "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
    },
    required=("headGroupSpec",),
)
KUBERAY_V1_6_2_RAYSERVICE = _struct(
    {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": _K8S,
        "spec": _struct(
            {
                "rayClusterDeletionDelaySeconds": {"type": "integer", "minimum": 0},
                "serviceUnhealthySecondThreshold": _INT,
                "deploymentUnhealthySecondThreshold": _INT,
                "serveService": _K8S,
                "upgradeStrategy": _struct(
                    {
                        "type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
                        "clusterUpgradeOptions": _struct(
                            {
                                "maxSurgePercent": _INT,
                                "stepSizePercent": _INT,
                                "intervalSeconds": _INT,
                                "gatewayClassName": _STR,
                            }
                        ),
                    }
                ),
                "serveConfigV2": _STR,
                "rayClusterConfig": _RAY_CLUSTER_SPEC,
                "excludeHeadPodFromServeSvc": _BOOL,
            },
            required=("rayClusterConfig",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)


# ---------------------------------------------------------------------------
# Helpers


def _compose(directory: Path) -> list[dict[str, Any]]:
    return k8s_render.build_kustomization(directory)


def _rayservice(directory: Path) -> dict[str, Any]:
    return k8s_render.find_object(_compose(directory), "RayService", "warmpath")


def _head(service: dict[str, Any]) -> dict[str, Any]:
    return service["spec"]["rayClusterConfig"]["headGroupSpec"]


def _workers(service: dict[str, Any]) -> dict[str, Any]:
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


_cpu_cores = k8s_render.cpu_cores


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"}, "template": template}


def _container_template(**fields: Any) -> dict[str, Any]:
    return _pod_template({"spec": {"containers": [{"name": "embedded", "image": "embedded", **fields}]}})


def embedded_kubernetes_objects(service: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes-typed part of a RayService, wrapped as a standalone object."""
    spec = service["spec"]
    cluster = spec["rayClusterConfig"]
    objects = [
        ("metadata", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": service["metadata"]}),
        ("headGroupSpec.template", _pod_template(cluster["headGroupSpec"]["template"])),
    ]
    objects += [
        (f"workerGroupSpecs[{g['groupName']}].template", _pod_template(g["template"]))
        for g in cluster.get("workerGroupSpecs", [])
    ]
    if "serveService" in spec:
        objects.append(("serveService", {"apiVersion": "v1", "kind": "Service", **spec["serveService"]}))
    password = cluster.get("gcsFaultToleranceOptions", {}).get("redisPassword", {}).get("valueFrom")
    if password is not None:
        objects.append(("redisPassword.valueFrom", _container_template(env=[{"name": "P", "valueFrom": password}])))
    autoscaler = cluster.get("autoscalerOptions", {})
    if "resources" in autoscaler:
        objects.append(("autoscalerOptions.resources", _container_template(resources=autoscaler["resources"])))
    return objects


# ---------------------------------------------------------------------------
# Parsing and schema validation


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(K8S_DIR)) for p in YAML_FILES])
def test_every_yaml_file_parses(path: Path):
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert documents, f"{path} holds no YAML document"


@pytest.mark.parametrize("directory", COMPOSITIONS, ids=COMPOSITION_IDS)
def test_builtin_kinds_validate_against_kubernetes_schemas(directory: Path):
    builtin = [obj for obj in _compose(directory) if obj["kind"] != "RayService"]
    assert {obj["kind"] for obj in builtin} == {"Service", "StatefulSet"}
    for obj in builtin:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("directory", COMPOSITIONS, ids=COMPOSITION_IDS)
def test_rayservice_fields_exist_in_kuberay_v1_6_2(directory: Path):
    jsonschema.validate(_rayservice(directory), KUBERAY_V1_6_2_RAYSERVICE)


@pytest.mark.parametrize("directory", COMPOSITIONS, ids=COMPOSITION_IDS)
def test_kubernetes_types_inside_the_rayservice_validate(directory: Path):
    for label, obj in embedded_kubernetes_objects(_rayservice(directory)):
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{label}: {'.'.join(map(str, err.path))}: {err.message}")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["spec"]["rayClusterConfig"].update(gcsFaultToleranceOption={"redisAddress": "r:6379"}),
        lambda s: s["spec"].update(upgradeStrategy={"type": "RollingUpdate"}),
        lambda s: _head(s)["rayStartParams"].update({"num-cpus": 0}),
        lambda s: _workers(s).pop("groupName"),
        lambda s: s["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"].update(redisPasword={"value": "x"}),
    ],
    ids=["misspelt-gcs-ft", "unknown-upgrade-type", "int-start-param", "worker-without-name", "misspelt-password"],
)
def test_kuberay_schema_rejects_fields_kuberay_does_not_have(mutate):
    service = _rayservice(OVERLAYS[0])
    mutate(service)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, KUBERAY_V1_6_2_RAYSERVICE)


def test_strict_kubernetes_schema_rejects_an_unknown_container_field():
    template = _head(_rayservice(OVERLAYS[0]))["template"]
    template["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_pod_template(template), KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------------
# One source of truth: generated files and the embedded Serve config


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_generated_files_match_warmpath_render_k8s(overlay: Path):
    assert k8s_render.check_k8s(overlay) == [], "run `warmpath render k8s` and commit the result"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_serve_config_v2_is_exactly_what_warmpath_renders(overlay: Path):
    cfg = k8s_render.load_overlay_config(overlay)
    assert k8s_render.embedded_serve_config(overlay) == render_serve_config(cfg)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_serve_config_v2_is_a_serve_deploy_schema_of_a_cluster_config(overlay: Path):
    schema = ServeDeploySchema.model_validate(k8s_render.embedded_serve_config(overlay))
    application, grpc_application = schema.applications
    assert application.import_path == "serve_apps.builders:build_app"
    assert grpc_application.import_path == "serve_apps.builders:build_grpc_app"
    assert grpc_application.args == application.args
    cfg = validate_config(application.args)
    assert cfg.redis_url is None, "the Redis password must come from the Secret, not the RayService"
    assert cfg.model.source == k8s_render.load_overlay_config(overlay).model.source


def test_cpu_image_builds_the_model_where_the_cpu_config_loads_it():
    dockerfile = (K8S_DIR / "Dockerfile.cpu").read_text()
    (built_at,) = re.findall(r"build-model --out (\S+)", dockerfile)
    assert k8s_render.load_overlay_config(K8S_DIR / "overlays" / "cpu").model.source == built_at


def test_gpu_image_checks_its_base_for_the_versions_pyproject_pins():
    dockerfile = (K8S_DIR / "Dockerfile.gpu").read_text()
    (want,) = re.findall(r"want = \('([^']+)', '([^']+)', '([^']+)'\)", dockerfile)
    project = tomllib.loads((K8S_DIR.parent / "pyproject.toml").read_text())["project"]
    python, ray, vllm = want
    assert project["requires-python"] == f">={python},<3.{int(python.split('.')[1]) + 1}"
    assert f"ray[serve]=={ray}" in project["dependencies"]
    assert project["optional-dependencies"]["gpu"] == [f"vllm=={vllm}"]
    (base,) = re.findall(r"ARG BASE_IMAGE=(\S+)", dockerfile)
    assert base.startswith(f"rayproject/ray-llm:{ray}-py{python.replace('.', '')}-")


# ---------------------------------------------------------------------------
# What the composed manifests promise


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_head_runs_no_model_replicas(overlay: Path):
    head = _head(_rayservice(overlay))
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in _container(head)["resources"].get("limits", {})


def _ray_start_resources(group: dict) -> dict:
    """A group's custom Ray resources from `rayStartParams.resources`, quoted for the shell as KubeRay quotes it."""
    quoted = group["rayStartParams"]["resources"]
    assert quoted.startswith("'") and quoted.endswith("'"), quoted
    return json.loads(quoted[1:-1])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_no_group_sets_ray_resources_in_two_places(overlay: Path):
    """KubeRay's validation refuses a group with resources in both rayStartParams and its `resources` field
    (`validateRayGroupResources`): the RayService would never get a cluster."""
    service = _rayservice(overlay)
    for group in [_head(service), *service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]:
        params = group.get("rayStartParams") or {}
        in_params = any(params.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources"))
        assert not (in_params and group.get("resources")), group.get("groupName", "head")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_worker_group_fits_one_replica_per_pod(overlay: Path):
    cfg = k8s_render.load_overlay_config(overlay)
    service = _rayservice(overlay)
    workers = _workers(service)
    resources = _container(workers)["resources"]
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert workers["replicas"] == cfg.replicas.num_replicas
    assert workers["minReplicas"] <= cfg.replicas.num_replicas <= workers["maxReplicas"]
    ray_cpus = int(workers["rayStartParams"]["num-cpus"])
    assert ray_cpus >= cfg.replicas.num_cpus + SERVICE_NUM_CPUS, "a replica bundle and the services must fit"
    assert _cpu_cores(resources["limits"]["cpu"]) >= ray_cpus
    assert int(workers["rayStartParams"]["num-gpus"]) == cfg.replicas.num_gpus
    assert resources["limits"].get("nvidia.com/gpu", 0) == cfg.replicas.num_gpus
    if cfg.replicas.accelerator == "gpu":
        assert cfg.replicas.num_gpus == cfg.replicas.tensor_parallel_size
    else:
        # The CPUs would fit a second replica bundle; a custom resource each worker
        # offers once is what keeps two replicas (and their KV caches) out of one pod.
        assert ray_cpus >= 2 * cfg.replicas.num_cpus
        assert cfg.replicas.ray_resources, "nothing keeps two CPU replicas out of one worker pod"
        offered = _ray_start_resources(workers)
        assert offered.keys() == cfg.replicas.ray_resources.keys()
        for name, amount in cfg.replicas.ray_resources.items():
            assert amount <= float(offered[name]) < 2 * amount


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_ports_and_services_match_the_serve_config(overlay: Path):
    serve = k8s_render.embedded_serve_config(overlay)
    objects = _compose(overlay)
    service = k8s_render.find_object(objects, "RayService", "warmpath")
    http_port, grpc_port = serve["http_options"]["port"], serve["grpc_options"]["port"]
    for group in (_head(service), _workers(service)):
        assert (_port(_container(group), "serve"), _port(_container(group), "serve-grpc")) == (http_port, grpc_port)
    http = service["spec"]["serveService"]
    assert http["metadata"]["name"] == "warmpath-http"
    assert [(p["name"], p["port"]) for p in http["spec"]["ports"]] == [("serve", http_port)]
    grpc = k8s_render.find_object(objects, "Service", "warmpath-grpc")
    assert [(p["port"], p["targetPort"]) for p in grpc["spec"]["ports"]] == [(grpc_port, "serve-grpc")]
    worker_labels = {**_workers(service)["template"]["metadata"]["labels"], "ray.io/serve": "true"}
    assert grpc["spec"]["selector"].items() <= worker_labels.items()
    # KubeRay's head Service of a RayService (warmpath-head-svc, the dashboard) selects
    # app.kubernetes.io/name=kuberay whatever the pods say: a pod template that set its
    # own name label would leave that Service without endpoints.
    for group in (_head(service), _workers(service)):
        assert "app.kubernetes.io/name" not in group["template"]["metadata"]["labels"]


def _redis_memory_limit_bytes(container: dict) -> int:
    """`--maxmemory` of a Redis container, in bytes (Redis's `mb` is MiB)."""
    args = container["args"]
    value = args[args.index("--maxmemory") + 1]
    assert value.endswith("mb"), value
    return int(value[:-2]) * 2**20


def _quantity_bytes(quantity: str) -> int:
    units = {"Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_sessions_and_gcs_fault_tolerance_each_have_their_own_redis(overlay: Path):
    """A full session store refuses session writes; it must not refuse the GCS's, which would end the Ray cluster."""
    objects = _compose(overlay)
    service = k8s_render.find_object(objects, "RayService", "warmpath")
    sessions, gcs_redis = (k8s_render.find_object(objects, "StatefulSet", name)
                           for name in ("warmpath-redis", "warmpath-gcs-redis"))
    sessions_port, gcs_port = (k8s_render.find_object(objects, "Service", name)["spec"]["ports"][0]["port"]
                               for name in ("warmpath-redis", "warmpath-gcs-redis"))
    session_container = sessions["spec"]["template"]["spec"]["containers"][0]
    secret_ref = _env(session_container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert sessions["spec"]["selector"] != gcs_redis["spec"]["selector"]

    gcs = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] == f"warmpath-gcs-redis:{gcs_port}"
    assert gcs["redisPassword"]["valueFrom"]["secretKeyRef"] == secret_ref
    for group in (_head(service), _workers(service)):
        env = _env(_container(group))
        assert env["SESSION_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret_ref
        url = urlsplit(env["REDIS_URL"]["value"])
        assert (url.hostname, url.port, url.password) == ("warmpath-redis", sessions_port, "$(SESSION_REDIS_PASSWORD)")
    # KubeRay refuses these on the head when gcsFaultToleranceOptions is set.
    assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS", "REDIS_USERNAME"} & set(_env(_container(_head(service))))
    assert "redis-password" not in _head(service)["rayStartParams"]
    for redis in (sessions, gcs_redis):
        container = redis["spec"]["template"]["spec"]["containers"][0]
        assert _env(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret_ref
        # Persistence: append-only file on a claim mounted where Redis writes it.
        args = container["args"]
        assert args[args.index("--appendonly") + 1] == "yes"
        (claim,) = redis["spec"]["volumeClaimTemplates"]
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}[claim["metadata"]["name"]]
        assert args[args.index("--dir") + 1] == mount
        # Full means refusing writes, never dropping keys or being OOM-killed.
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
        assert _redis_memory_limit_bytes(container) < _quantity_bytes(container["resources"]["limits"]["memory"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_container_probes_and_bounds_its_resources(overlay: Path):
    objects = _compose(overlay)
    service = k8s_render.find_object(objects, "RayService", "warmpath")
    containers = [_container(_head(service)), _container(_workers(service))]
    for name in ("warmpath-redis", "warmpath-gcs-redis"):
        containers += k8s_render.find_object(objects, "StatefulSet", name)["spec"]["template"]["spec"]["containers"]
    for container in containers:
        assert {"readinessProbe", "livenessProbe"} <= set(container), container["name"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_images_and_telemetry_follow_the_overlay(overlay: Path):
    cfg = k8s_render.load_overlay_config(overlay)
    service = _rayservice(overlay)
    (image,) = [entry for entry in yaml.safe_load((overlay / "kustomization.yaml").read_text())["images"]
                if entry["name"] == "warmpath"]
    images = {_container(_head(service))["image"], _container(_workers(service))["image"]}
    assert images == {f"{image['newName']}:{image['newTag']}"}
    for group in (_head(service), _workers(service)):
        env = _env(_container(group))
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT", {}).get("value") == cfg.telemetry.otlp_endpoint


def test_gpu_overlay_loads_a_hugging_face_model_with_a_token_secret():
    cfg = k8s_render.load_overlay_config(K8S_DIR / "overlays" / "gpu")
    assert cfg.replicas.accelerator == "gpu" and not cfg.model.source.startswith("/")
    env = _env(_container(_workers(_rayservice(K8S_DIR / "overlays" / "gpu"))))
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "warmpath-hf-token", "key": "token"}


# ---------------------------------------------------------------------------
# Rendering guards and the CLI


@pytest.mark.parametrize(
    "config, message",
    [
        ("model:\n  source: ''\n", "model.source"),
        ("model:\n  source: ./models/m\n", "relative to the machine that renders"),
        ("model:\n  source: ~/models/m\n", "relative to the machine that renders"),
        ("model:\n  source: /m\nredis_url: redis://:secret@r:6379/1\n", "password"),
        # Without a password it still won over the pods' REDIS_URL (with the Secret's): every session call NOAUTH.
        ("model:\n  source: /m\nredis_url: redis://warmpath-redis:6379/1\n", "override the REDIS_URL the pods build"),
        ("replicas:\n  num_replicas: 0\n", "replicas.num_replicas"),
        ("model:\n  source: /m\naccess:\n  is_auth_enabled: false\n", r"listen on 127\.0\.0\.1, ports\.host \(unset"),
        ("model:\n  source: /m\nports:\n  host: ::1\n", r"listen on ::1, ports\.host, which nothing outside"),
        # Each pod has addresses of its own: a proxy bound to another never passed the readiness probe either.
        ("model:\n  source: /m\nports:\n  host: 10.0.0.5\n", r"ports\.host 10\.0\.0\.5, an address a pod does not"),
        ("model:\n  source: /m\nports:\n  host: my-host.example\n", r"set ports\.host: 0\.0\.0\.0 \(or :: for IPv6\)"),
    ],
)
def test_render_refuses_configs_unfit_for_a_pod(tmp_path: Path, config: str, message: str):
    (tmp_path / "cluster.yaml").write_text(config)
    with pytest.raises(ConfigError, match=message) as err:
        k8s_render.render_k8s(tmp_path)
    assert str(tmp_path / "cluster.yaml") in str(err.value)  # which overlay, when every one is rendered


def test_render_k8s_check_reports_drift_and_render_fixes_it(tmp_path: Path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, k8s)
    overlay = k8s / "overlays" / "cpu"
    config = overlay / "cluster.yaml"
    config.write_text(config.read_text().replace("num_replicas: 2", "num_replicas: 3"))
    runner = CliRunner()

    result = runner.invoke(app, ["render", "k8s", "--overlay", str(overlay), "--check"])
    assert result.exit_code == 1
    assert str(overlay / "generated" / "rayservice-patch.yaml") in result.output

    assert runner.invoke(app, ["render", "k8s", "--overlay", str(overlay)]).exit_code == 0
    assert runner.invoke(app, ["render", "k8s", "--overlay", str(overlay), "--check"]).exit_code == 0
    assert _workers(_rayservice(overlay))["replicas"] == 3
    assert k8s_render.embedded_serve_config(overlay)["applications"][0]["args"]["replicas"]["num_replicas"] == 3


def test_memory_quantities_read_as_kubernetes_writes_them():
    assert [k8s_render.memory_bytes(q) for q in ("4Gi", "512Mi", "3G", "1e9", 1024, "3221225472000m")] == [
        4 * 2**30, 512 * 2**20, 3e9, 1e9, 1024, pytest.approx(3 * 2**30)]
    with pytest.raises(ConfigError, match="not one Kubernetes reads"):  # a traceback out of `render k8s`
        k8s_render.memory_bytes("4GB")


@pytest.mark.parametrize("edit, message", [
    (("num_replicas: 2", "num_replicas: 4"), r"num_replicas 4 is above the worker group's maxReplicas \(3\)"),
    (("num_cpus: 1", "num_cpus: 4"), r"offers Ray 5 CPUs .* its container's CPU limit in the overlay's patch is 2"),
    (("warmpath_replica_slot: 1", "warmpath_replica_slot: 0.5"), r"ray_resources .* must be whole numbers"),
    (("router:", "ports:\n  http_port: 8001\nrouter:"), r"ports\.http_port is 8001 but the worker container's port 'serve' is 8000"),
    (("router:", "ports:\n  grpc_port: 9001\nrouter:"), r"ports\.grpc_port is 9001 but .* 'serve-grpc' is 9000"),
    # The pod was killed for memory as its engine allocated the cache.
    (("kv_cache_space_gib: 1", "kv_cache_space_gib: 8"), r"KV cache alone takes .* 8 GiB.* memory limit .* is 4Gi"),
], ids=["over-max-replicas", "over-cpu-limit", "fractional-resource", "http-port", "grpc-port", "over-memory-limit"])
def test_render_refuses_a_config_the_overlays_worker_group_cannot_hold(tmp_path: Path, edit, message):
    """Each rendered and applied cleanly, and the app never left DEPLOYING (or KubeRay's autoscaler failed)."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, k8s)
    config = k8s / "overlays" / "cpu" / "cluster.yaml"
    assert edit[0] in config.read_text()
    config.write_text(config.read_text().replace(*edit))
    with pytest.raises(ConfigError, match=message):
        k8s_render.render_k8s(config.parent)


def test_render_k8s_says_a_write_it_cannot_make_in_one_line(tmp_path: Path):
    """An overlay whose `generated` is a file gave a 30-line FileExistsError traceback."""
    overlay = tmp_path / "cpu"
    shutil.copytree(K8S_DIR / "overlays" / "cpu", overlay)
    shutil.rmtree(overlay / "generated")
    (overlay / "generated").write_text("not a folder")
    result = CliRunner().invoke(app, ["render", "k8s", "--overlay", str(overlay)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("error: ") and "generated" in result.output and len(result.output.splitlines()) == 1


@pytest.mark.parametrize("old, new, said", [
    ("      memory: 4Gi\n", "      memory: 4Gi\n  bad: [\n", "rayservice-patch.yaml is not valid YAML (line "),
    ('      cpu: "2"\n      memory: 4Gi', '      cpu: "2Gi"\n      memory: 4Gi',
     "the worker container's limits in the overlay's patch: CPU quantity '2Gi' is not one Kubernetes reads"),
])
def test_render_k8s_names_a_typo_in_a_hand_written_patch_in_one_line(tmp_path: Path, old, new, said):
    """A YAML syntax error, or a CPU limit that is no CPU quantity: a traceback of hundreds of lines."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "cpu"
    patch = overlay / "rayservice-patch.yaml"
    assert old in patch.read_text()
    patch.write_text(patch.read_text().replace(old, new))
    result = CliRunner().invoke(app, ["render", "k8s", "--overlay", str(overlay)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert said in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_stale_generated_files_count_as_drift(tmp_path: Path):
    overlay = tmp_path / "cpu"
    shutil.copytree(K8S_DIR / "overlays" / "cpu", overlay)
    stale = overlay / "generated" / "old.yaml"
    stale.write_text("- op: test\n")
    assert k8s_render.check_k8s(overlay) == [str(stale)]
    assert k8s_render.write_k8s(overlay) == [stale] and not stale.exists()


# ---------------------------------------------------------------------------
# The kustomize subset


@pytest.mark.parametrize(
    "doc, ops, expected",
    [
        ({"a": {}}, [{"op": "add", "path": "/a/b", "value": 1}], {"a": {"b": 1}}),
        ({"l": [1]}, [{"op": "add", "path": "/l/-", "value": 2}], {"l": [1, 2]}),
        ({"l": [1]}, [{"op": "add", "path": "/l/0", "value": 0}], {"l": [0, 1]}),
        ({"a": 1}, [{"op": "replace", "path": "/a", "value": 2}], {"a": 2}),
        ({"l": [1, 2]}, [{"op": "remove", "path": "/l/0"}], {"l": [2]}),
        ({"m": {}}, [{"op": "add", "path": "/m/nvidia.com~1gpu", "value": 1}], {"m": {"nvidia.com/gpu": 1}}),
        ({"a": 1}, [{"op": "test", "path": "/a", "value": 1}], {"a": 1}),
    ],
    ids=["add-key", "append", "insert", "replace", "remove", "escaped-key", "test"],
)
def test_json_patch_operations(doc, ops, expected):
    assert k8s_render.apply_json_patch(doc, ops) == expected


@pytest.mark.parametrize(
    "doc, op, message",
    [
        ({}, {"op": "replace", "path": "/a", "value": 1}, "does not exist"),
        ({}, {"op": "add", "path": "/a/b", "value": 1}, "does not exist"),
        ({"l": []}, {"op": "replace", "path": "/l/0", "value": 1}, "out of range"),
        ({"a": 1}, {"op": "move", "path": "/a", "from": "/b"}, "unsupported operation"),
        ({"a": 1}, {"op": "test", "path": "/a", "value": 2}, "test failed"),
    ],
)
def test_json_patch_errors(doc, op, message):
    with pytest.raises(ValueError, match=message):
        k8s_render.apply_json_patch(doc, [op])


@pytest.mark.parametrize(
    "image, rule, expected",
    [
        ("warmpath", {"name": "warmpath", "newName": "warmpath-cpu", "newTag": "0.1.0"}, "warmpath-cpu:0.1.0"),
        ("warmpath:old", {"name": "warmpath", "newTag": "new"}, "warmpath:new"),
        ("reg:5000/warmpath:1", {"name": "reg:5000/warmpath", "newTag": "2"}, "reg:5000/warmpath:2"),
        ("redis:7", {"name": "warmpath", "newTag": "x"}, "redis:7"),
        ("warmpath:1", {"name": "warmpath", "digest": "sha256:ab"}, "warmpath@sha256:ab"),
        ("warmpath:1", {"name": "warmpath", "newName": "reg/warmpath-gpu"}, "reg/warmpath-gpu:1"),
    ],
    ids=["name-and-tag", "tag-only", "registry-port", "other-image", "digest", "name-only"],
)
def test_images_rewrite_containers_at_any_depth(image, rule, expected):
    obj = {"spec": {"groups": [{"template": {"spec": {"containers": [{"name": "c", "image": image}]}}}]}}
    rewritten = k8s_render.set_image(obj, rule)
    assert rewritten["spec"]["groups"][0]["template"]["spec"]["containers"][0]["image"] == expected


@pytest.mark.parametrize(
    "kustomization, message",
    [
        ({"resources": [], "namePrefix": "x-"}, "unsupported fields"),
        ({"resources": ["svc.yaml"], "patches": [{"path": "p.yaml", "target": {"kind": "Service"}}]}, "JSON 6902"),
        ({"resources": ["svc.yaml", "svc.yaml"]}, "duplicate"),
        ({"resources": ["svc.yaml"], "patches": [{"path": "ops.yaml", "target": {"kind": "Pod"}}]}, "matches 0"),
    ],
)
def test_unsupported_kustomizations_fail_loudly(tmp_path: Path, kustomization: dict, message: str):
    (tmp_path / "svc.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata:\n  name: s\n")
    (tmp_path / "p.yaml").write_text("metadata:\n  name: t\n")
    (tmp_path / "ops.yaml").write_text("- op: add\n  path: /spec\n  value: {}\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(ValueError, match=message):
        k8s_render.build_kustomization(tmp_path)


def test_the_guides_api_key_goes_to_the_redis_database_the_pods_read():
    """k8s/README.md's `keys create` must write where the pods' `REDIS_URL` looks, or every call is a 401."""
    guide = (k8s_render.K8S_DIR / "README.md").read_text()
    created = re.findall(r'REDIS_URL="([^"]+)" warmpath keys create', guide)
    assert created, "the guide no longer creates a key with REDIS_URL"
    rayservice = yaml.safe_load((k8s_render.K8S_DIR / "base" / "rayservice.yaml").read_text())
    cluster_spec = rayservice["spec"]["rayClusterConfig"]
    pods = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    read = {env["value"] for pod in pods for container in pod["template"]["spec"]["containers"]
            for env in container.get("env", []) if env["name"] == "REDIS_URL"}
    assert read, "no pod sets REDIS_URL"
    databases_read = {urlsplit(url).path for url in read}
    assert {urlsplit(url).path for url in created} == databases_read == {"/1"}


def test_the_network_policy_keeps_ray_and_redis_to_the_namespace_and_serving_ports_open():
    """k8s/extras/network-policy.yaml selects the pods the overlays make, and opens exactly their serving ports."""
    policies = list(yaml.safe_load_all((k8s_render.K8S_DIR / "extras" / "network-policy.yaml").read_text()))
    for policy in policies:
        kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    ray_policy, redis_policy = policies
    for overlay in OVERLAYS:
        objects = _compose(overlay)
        service = k8s_render.find_object(objects, "RayService", "warmpath")
        for group in (_head(service), _workers(service)):
            labels = group["template"]["metadata"]["labels"]
            assert ray_policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        open_rule, namespace_rule = ray_policy["spec"]["ingress"]
        assert "from" not in open_rule
        serving_ports = {_port(_container(_workers(service)), "serve"), _port(_container(_workers(service)), "serve-grpc")}
        assert {port["port"] for port in open_rule["ports"]} == serving_ports
        assert "ports" not in namespace_rule and {"podSelector": {}} in namespace_rule["from"]
        (selector,) = redis_policy["spec"]["podSelector"]["matchExpressions"]
        for name in ("warmpath-redis", "warmpath-gcs-redis"):
            labels = k8s_render.find_object(objects, "StatefulSet", name)["spec"]["template"]["metadata"]["labels"]
            assert labels[selector["key"]] in selector["values"]
    assert redis_policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]



@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_an_overlays_tools_cannot_reach_the_pods_own_loopback(overlay: Path):
    """A pod's loopback holds Ray's unauthenticated ports (dashboard and Jobs API, GCS, metrics)."""
    from cluster.config import DEFAULT_BLOCKED_TOOL_NETWORKS
    from serve_apps.orchestrator.tool_network import ToolNetworkPolicy

    tool_network = k8s_render.load_overlay_config(overlay).tool_network
    assert set(DEFAULT_BLOCKED_TOOL_NETWORKS) <= set(tool_network.blocked_networks)
    policy = ToolNetworkPolicy(tool_network)
    for url in ("http://127.0.0.1:8265/api/jobs/", "http://[::1]:6379/", "http://0.0.0.0:8080/"):
        assert "blocked network" in policy.check_url(url)
