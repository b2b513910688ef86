"""Tests of the commd Helm chart: `helm lint --strict`, `helm template` for the default values and
for a values file that sets every value, schema validation of every rendered object (and of the
example job manifests) with kubernetes-validate against a current Kubernetes, the properties the
deployment relies on (host network and PIDs, GPUs without GPU requests, capabilities, socket
hostPath, probes through `commd health`), bad values failing with a clear message, and the
rendered ConfigMap's commd.toml accepted by the real daemon (`commd config`, then `commd serve`
probed with the rendered probe command).

Run by scripts/test-deploy, which installs helm and kubernetes-validate. Environment:
HELM (helm binary), K8S_VERSION (default below), COMMD_BIN_DIR (default target/release).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "commd"
EXAMPLES = ROOT / "helm" / "examples"
HELM = os.environ.get("HELM", "helm")
K8S_VERSION = os.environ.get("K8S_VERSION", "1.37.0")
BIN = Path(os.environ.get("COMMD_BIN_DIR", ROOT / "target" / "release"))
COMMD = str(BIN / "commd")
VALUES = {
    "default": CHART / "ci" / "default-values.yaml",
    "all-options": CHART / "ci" / "all-options-values.yaml",
}
# Objects of CRDs kubernetes-validate has no schema for; checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}


def helm(*args, check=True):
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def render(values_file, *extra):
    out = helm("template", "commd", str(CHART), "--namespace", "commd-system", "-f", str(values_file), *extra)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def daemonset(docs):
    (ds,) = by_kind(docs, "DaemonSet")
    return ds


def container(docs):
    (c,) = daemonset(docs)["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def kubernetes_validate(paths):
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION,
                          *map(str, paths)], capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def write_docs(tmp_path, docs, stem):
    paths = []
    for i, d in enumerate(docs):
        p = tmp_path / f"{stem}-{i:02d}-{d['kind']}.yaml"
        p.write_text(yaml.safe_dump(d))
        paths.append(p)
    return paths


def leaf_paths(value, prefix=()):
    """Every path to a leaf of a values tree (a dict's entries are followed; lists and scalars are
    leaves, and so are empty dicts, which stand for free-form maps)."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaf_paths(v, prefix + (k,))
    else:
        yield prefix


@pytest.mark.parametrize("name", VALUES)
def test_helm_lint_strict(name):
    out = helm("lint", "--strict", str(CHART), "-f", str(VALUES[name]))
    assert "0 chart(s) failed" in out.stdout, out.stdout


def test_all_options_values_set_every_value():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    everything = yaml.safe_load(VALUES["all-options"].read_text())
    have = set(leaf_paths(everything))
    missing = []
    for path in leaf_paths(defaults):
        # A free-form map (empty by default) counts as set when the file fills it.
        if path not in have and not any(h[: len(path)] == path for h in have):
            missing.append(".".join(path))
    assert not missing, f"ci/all-options-values.yaml does not set: {missing}"


@pytest.mark.parametrize("name", VALUES)
def test_rendered_manifests_validate_against_kubernetes_schemas(name, tmp_path):
    docs = render(VALUES[name])
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ConfigMap", "ServiceAccount"} <= kinds, kinds
    builtin = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    code, output = kubernetes_validate(write_docs(tmp_path, builtin, name))
    assert code == 0 and "ERROR" not in output, output
    assert "Couldn't find schema" not in output, output
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRD_KINDS:
            check_monitor(d, docs)


def test_schema_validation_catches_a_broken_daemonset(tmp_path):
    """The validation above is only worth something if a wrong manifest fails it."""
    docs = render(VALUES["default"])
    ds = daemonset(docs)
    ds["spec"]["template"]["spec"]["containers"][0]["capabilities"] = {"add": ["IPC_LOCK"]}  # misplaced
    code, output = kubernetes_validate(write_docs(tmp_path, [ds], "broken"))
    assert code != 0 and "capabilities" in output, output


def check_monitor(mon, docs):
    """What kubernetes-validate cannot check for prometheus-operator objects: they select the
    daemon's pods (or its metrics Service) and scrape the port the daemon declares."""
    ds = daemonset(docs)
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in container(docs)["ports"]}
    sel = mon["spec"]["selector"]["matchLabels"]
    if mon["kind"] == "PodMonitor":
        assert sel.items() <= pod_labels.items(), (sel, pod_labels)
        endpoints = mon["spec"]["podMetricsEndpoints"]
    else:
        (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics")]
        assert sel.items() <= svc["metadata"]["labels"].items()
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
        endpoints = mon["spec"]["endpoints"]
    for ep in endpoints:
        assert ep["port"] in ports and ep["path"].startswith("/"), ep


def test_examples_validate_and_use_the_daemon(tmp_path):
    torchrun = list(yaml.safe_load_all((EXAMPLES / "torchrun-job.yaml").read_text()))
    mpi = yaml.safe_load((EXAMPLES / "mpi-job.yaml").read_text())
    assert mpi["kind"] == "MPIJob" and mpi["apiVersion"] == "kubeflow.org/v2beta1"
    # The MPIJob CRD has no schema here: validate each replica's pod template as a PodTemplate.
    templates = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"mpi-{role.lower()}"},
                  "template": spec["template"]} for role, spec in mpi["spec"]["mpiReplicaSpecs"].items()]
    code, output = kubernetes_validate(write_docs(tmp_path, torchrun + templates, "example"))
    assert code == 0 and "ERROR" not in output and "Couldn't find schema" not in output, output

    (job,) = [d for d in torchrun if d["kind"] == "Job"]
    (script,) = [d for d in torchrun if d["kind"] == "ConfigMap"]
    assert 'init_process_group("commd")' in script["data"]["train.py"]
    assert "import commd.torch" in script["data"]["train.py"]
    worker = mpi["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    launcher = mpi["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert 'init_process_group("commd")' in " ".join(launcher["containers"][0]["command"])
    assert "COMMD_SOCKET=/run/commd/commd.sock" in launcher["containers"][0]["command"]
    for pod in (job["spec"]["template"]["spec"], worker):
        (c,) = pod["containers"]
        assert env_of(c)["COMMD_SOCKET"]["value"] == "/run/commd/commd.sock"
        vols = {v["name"]: v for v in pod["volumes"]}
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/run/commd")
        assert vols[mount["name"]]["hostPath"] == {"path": "/run/commd", "type": "Directory"}


def test_daemonset_defaults():
    docs = render(VALUES["default"])
    ds = daemonset(docs)
    pod = ds["spec"]["template"]["spec"]
    c = container(docs)
    env = env_of(c)
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostIPC" not in pod
    # Upgrades do not restart running daemons unless asked to.
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    # All GPUs through the NVIDIA runtime, none taken from the scheduler.
    assert pod["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    for section in ("requests", "limits"):
        assert not any("gpu" in k for k in c.get("resources", {}).get(section, {})), c["resources"]
    assert "limits" not in c["resources"], "no default limits (an OOM-killed daemon fails every job)"
    # Capabilities, not privileged.
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"IPC_LOCK", "SYS_RESOURCE"} <= set(sc["capabilities"]["add"])
    # The advertised address is the node's IP.
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["COMMD_ADVERTISE"]["value"] == "$(HOST_IP)"
    assert env["COMMD_PEER_LISTEN"]["value"] == "$(HOST_IP):7400"
    # The daemon serves /metrics on the node's IP; annotation-based scrapers find it.
    assert env["COMMD_METRICS_LISTEN"]["value"] == "$(HOST_IP):9478"
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9478"
    assert {"name": "metrics", "containerPort": 9478, "protocol": "TCP"} in c["ports"]
    # The socket directory is a host directory, and the daemon serves in it.
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["socket-dir"]["hostPath"] == {"path": "/run/commd", "type": "DirectoryOrCreate"}
    assert {"name": "socket-dir", "mountPath": "/run/commd"} in c["volumeMounts"]
    toml = config_toml(docs)
    assert 'socket = "/run/commd/commd.sock"' in toml
    # Probes run `commd health` with a timeout inside the probe's own.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["/usr/local/bin/commd", "health"], cmd
        assert int(cmd[cmd.index("--timeout-ms") + 1]) < c[probe]["timeoutSeconds"] * 1000
    assert c["args"] == ["serve", "--config", "/etc/commd/commd.toml"]
    assert env["COMMD_CONFIG"]["value"] == "/etc/commd/commd.toml"
    assert c["image"] == "registry.example.com/commd:0.1.0"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_daemonset_all_options():
    docs = render(VALUES["all-options"])
    ds = daemonset(docs)
    pod = ds["spec"]["template"]["spec"]
    c = container(docs)
    env = env_of(c)
    res = c["resources"]
    for name, count in (("rdma/hca", "1"), ("aliyun/erdma", "2")):
        assert res["requests"][name] == count and res["limits"][name] == count, res
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "10%", "maxSurge": 0}
    assert pod["priorityClassName"] == "system-node-critical" and pod["hostIPC"] is True
    assert env["COMMD_ADVERTISE"]["value"] == "192.168.10.5"
    assert env["COMMD_PEER_LISTEN"]["value"] == "0.0.0.0:7500"
    assert env["COMMD_METRICS_LISTEN"]["value"] == "$(HOST_IP):9500"
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9500"
    assert c["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK", "SYS_RESOURCE", "SYS_NICE"]
    assert {"name": "socket-dir", "mountPath": "/var/run/commd-sockets"} in c["volumeMounts"]
    assert 'socket = "/var/run/commd-sockets/daemon.sock"' in config_toml(docs)
    assert {d["kind"] for d in docs} >= {"Service", "ServiceMonitor", "PodMonitor"}


def config_toml(docs):
    (cm,) = by_kind(docs, "ConfigMap")
    return cm["data"]["commd.toml"]


@pytest.mark.parametrize("name", VALUES)
def test_rendered_config_is_accepted_by_the_daemon(name, tmp_path):
    docs = render(VALUES[name])
    cfg = tmp_path / "commd.toml"
    cfg.write_text(config_toml(docs))
    out = subprocess.run([COMMD, "config", "--config", str(cfg)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("COMMD_")})
    assert out.returncode == 0, f"{out.stderr}\n---\n{cfg.read_text()}"
    values = yaml.safe_load(VALUES[name].read_text()).get("config") or yaml.safe_load(
        (CHART / "values.yaml").read_text())["config"]
    for key, value in values.items():
        if value is None:
            continue
        line = next(x for x in out.stdout.splitlines() if x.split(" ")[0] == key)
        assert f"file {cfg}" in line and str(value) in line, line


@pytest.mark.parametrize("name", VALUES)
def test_daemon_serves_the_rendered_config_and_the_probe_passes(name, tmp_path):
    """The container's command and env (minus the host paths), then its probe command."""
    docs = render(VALUES[name])
    c = container(docs)
    cfg = tmp_path / "commd.toml"
    cfg.write_text(config_toml(docs))
    sock = tmp_path / "commd.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    for e in c["env"]:
        if "value" in e and "$(" not in e["value"]:
            env[e["name"]] = e["value"]
    env["COMMD_CONFIG"] = str(cfg)
    # The host socket directory is not ours to write: override the socket (flags beat the file).
    # Multi-node variables are passed too (a daemon without them must ignore them).
    env["COMMD_PEER_LISTEN"] = env.get("COMMD_PEER_LISTEN", "127.0.0.1:7400")
    env["COMMD_ADVERTISE"] = "127.0.0.1"
    env["COMMD_SOCKET"] = str(sock)
    args = [a if a != "/etc/commd/commd.toml" else str(cfg) for a in c["args"]]
    log = open(tmp_path / "commd.log", "wb")
    proc = subprocess.Popen([COMMD, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        probe = c["readinessProbe"]["exec"]["command"]
        probe = [COMMD, *probe[1:]]
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
            if out.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert out.returncode == 0, f"{out.stderr}\n{(tmp_path / 'commd.log').read_text()}"
        assert out.stdout.startswith("commd healthy:") and str(sock) in out.stdout, out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, (tmp_path / "commd.log").read_text()
    out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "unhealthy" in out.stderr, out


BAD_VALUES = [
    # (values file content, text the error must contain)
    ("image:\n  repository: ''\n", "image.repository is required"),
    ("{}\n", "image.repository is required"),
    ("config:\n  op_timout_ms: 5\n", "op_timout_ms"),
    ("config:\n  ring_entries: 100\n", "ring_entries"),
    ("config:\n  debug_subsys: INIT,NOPE\n", "debug_subsys"),
    ("config:\n  socket: /tmp/x.sock\n", "socket"),
    ("rdma:\n  resources:\n    rdma/hca: 0\n", "rdma/hca"),
    ("updateStrategy:\n  type: RollingUpdate\n  rollingUpdate:\n    maxSurge: 1\n", "maxSurge must be 0"),
    ("metrics:\n  enabled: false\n  serviceMonitor:\n    enabled: true\n", "need metrics.enabled=true"),
    ("metrics:\n  enabled: true\n  port: 7400\n", "the daemon needs two ports"),
    ("socket:\n  hostDir: run/commd\n", "socket.hostDir"),
    ("securityContext:\n  capabilities: [IPC_LOK]\n", "capabilities"),
    ("gpu:\n  enable: true\n", "enable"),
]


@pytest.mark.parametrize("content,message", BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_bad_values_fail_with_a_clear_message(content, message, tmp_path):
    bad = tmp_path / "bad.yaml"
    # The image is given unless the case is about the image.
    base = "" if "image" in content or content == "{}\n" else "image:\n  repository: registry.example.com/commd\n"
    bad.write_text(base + content)
    out = helm("template", "commd", str(CHART), "-f", str(bad), check=False)
    assert out.returncode != 0, f"rendered despite {content!r}:\n{out.stdout[:2000]}"
    assert message in out.stderr, out.stderr
    lint = helm("lint", "--strict", str(CHART), "-f", str(bad), check=False)
    # helm lint reports `required` failures without failing (its lint mode); it must name them.
    assert lint.returncode != 0 or message in lint.stderr, (lint.stdout, lint.stderr)


def test_image_build_copies_every_workspace_member():
    """The image's build stage copies the workspace's sources one folder at a time: a member it
    misses fails `cargo build` there (no CI machine builds images)."""
    import re
    root = Path(__file__).resolve().parents[2]
    members = re.search(r'members\s*=\s*\[([^\]]*)\]', (root / "Cargo.toml").read_text()).group(1)
    members = re.findall(r'"([^"]+)"', members)
    dockerfile = (root / "helm" / "image" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
    assert set(members) <= copied, f"not copied: {sorted(set(members) - copied)}"
