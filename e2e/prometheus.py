"""A real Prometheus (the server from Debian's package) as a host process, scraping the
real node's pods the way a Prometheus Operator would scrape the chart's PodMonitors.

The scrape configuration is translated from the PodMonitors `helm template` renders,
with the relabelling the Prometheus Operator generates for a PodMonitor (`job`,
`namespace`, `pod`, `container`, `endpoint`, then the PodMonitor's own relabelings), so
the chart's recording rules, alerts and dashboard queries see the labels they were written
for. The same translation writes the copyable scrape configuration in the chart's README.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.images import REPO_ROOT
from e2e.polling import wait_for

Manifest = dict[str, Any]

# A Prometheus duration, as the chart's values.schema.json accepts it.
DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 10.0
# The PodMonitor fields the translation understands; any other is refused rather than
# silently dropped (it would scrape something else than the Prometheus Operator does).
SELECTOR_FIELDS = {"matchLabels"}
ENDPOINT_FIELDS = {"port", "path", "interval", "relabelings", "scheme", "tlsConfig"}
TLS_CONFIG_FIELDS = {"ca", "serverName"}
# Where the Prometheus Operator mounts the Secrets a monitor's tlsConfig names.
OPERATOR_CERTS_DIR = "/etc/prometheus/certs"
RELABELING_FIELDS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}


class PrometheusError(RuntimeError):
    pass


class _ConfigDumper(yaml.SafeDumper):
    """Block mappings, lists of plain values on one line: `source_labels: [a, b]`."""


# Every module that defines a series shardq exports (server, operator, and the TLS
# expiry both export).
METRIC_SOURCES = (
    REPO_ROOT / "shard_server" / "metrics.py",
    REPO_ROOT / "operator" / "shardq_operator" / "metrics.py",
    REPO_ROOT / "shardq" / "metrics_http.py",
)


def exported_metric_names() -> set[str]:
    """The names shardq's metrics are exposed under: counters get _total, histograms
    _bucket/_sum/_count, Info _info."""
    exposed = set()
    for source in METRIC_SOURCES:
        for name in re.findall(r'"(shardq_[a-z_]+)"', source.read_text()):
            exposed |= {name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_info"}
    return exposed


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(not isinstance(item, dict | list) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_ConfigDumper.add_representer(list, _represent_list)


def dump_config(config: Manifest) -> str:
    return yaml.dump(config, Dumper=_ConfigDumper, sort_keys=False, width=120)


def _meta_label(name: str) -> str:
    """A Kubernetes label name as Prometheus's pod discovery spells it in meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _regex_literal(value: str) -> str:
    """`value` as an RE2 pattern matching only itself (label values rarely need it)."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", value)


def _refuse_unknown(what: str, given: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"{what}: {sorted(unknown)} are not translated to a scrape config")


def build_scrape_config(pod_monitor: Manifest, index: int) -> Manifest:
    """The scrape config the Prometheus Operator generates for endpoint `index` of a
    PodMonitor (same job name, target labels and relabelling order)."""
    metadata, spec = pod_monitor["metadata"], pod_monitor["spec"]
    namespace, name = metadata["namespace"], metadata["name"]
    endpoint = spec["podMetricsEndpoints"][index]
    _refuse_unknown(f"PodMonitor {name} endpoint {index}", endpoint, ENDPOINT_FIELDS)
    selector = spec.get("selector", {})
    _refuse_unknown(f"PodMonitor {name} selector", selector, SELECTOR_FIELDS)

    namespace_selector = spec.get("namespaceSelector", {})
    discovery: Manifest = {"role": "pod"}
    if not namespace_selector.get("any", False):
        # An empty namespaceSelector means the PodMonitor's own namespace.
        discovery["namespaces"] = {"names": list(namespace_selector.get("matchNames") or [namespace])}

    relabelings: list[Manifest] = [
        # Completed pods keep their IPs a while; nothing serves there any more.
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
    ]
    for label, value in sorted(selector.get("matchLabels", {}).items()):
        meta = _meta_label(label)
        relabelings.append(
            {
                "action": "keep",
                "source_labels": [f"__meta_kubernetes_pod_label_{meta}", f"__meta_kubernetes_pod_labelpresent_{meta}"],
                "regex": f"({_regex_literal(value)});true",
            }
        )
    relabelings += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{namespace}/{name}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    for relabeling in endpoint.get("relabelings", []):
        _refuse_unknown(f"PodMonitor {name} relabeling", relabeling, set(RELABELING_FIELDS))
        relabelings.append({RELABELING_FIELDS[key]: value for key, value in relabeling.items()})

    config: Manifest = {"job_name": f"podMonitor/{namespace}/{name}/{index}"}
    if "interval" in endpoint:
        config["scrape_interval"] = endpoint["interval"]
    config["metrics_path"] = endpoint.get("path", "/metrics")
    if "scheme" in endpoint:
        config["scheme"] = endpoint["scheme"]
    if "tlsConfig" in endpoint:
        config["tls_config"] = _tls_config(f"PodMonitor {name} endpoint {index}", namespace, endpoint["tlsConfig"])
    config["kubernetes_sd_configs"] = [discovery]
    config["relabel_configs"] = relabelings
    return config


def _tls_config(what: str, namespace: str, tls: Manifest) -> Manifest:
    """A PodMonitor endpoint's tlsConfig as the Prometheus Operator writes it: a CA from a
    Secret (of the monitor's namespace) becomes the file it mounts that key at."""
    _refuse_unknown(f"{what} tlsConfig", tls, TLS_CONFIG_FIELDS)
    config: Manifest = {}
    if "ca" in tls:
        _refuse_unknown(f"{what} tlsConfig.ca", tls["ca"], {"secret"})
        secret = tls["ca"]["secret"]
        config["ca_file"] = f"{OPERATOR_CERTS_DIR}/secret_{namespace}_{secret['name']}_{secret['key']}"
    if "serverName" in tls:
        config["server_name"] = tls["serverName"]
    return config


def build_scrape_configs(manifests: Sequence[Manifest]) -> list[Manifest]:
    """One scrape config per endpoint of every PodMonitor among `manifests`."""
    return [
        build_scrape_config(manifest, index)
        for manifest in manifests
        if manifest["kind"] == "PodMonitor"
        for index in range(len(manifest["spec"]["podMetricsEndpoints"]))
    ]


def rule_groups(manifests: Sequence[Manifest]) -> list[Manifest]:
    """The rule groups of every PrometheusRule among `manifests` (a rule file's content)."""
    return [group for m in manifests if m["kind"] == "PrometheusRule" for group in m["spec"]["groups"]]


def build_config(
    scrape_configs: Sequence[Manifest],
    *,
    rule_file: Path,
    interval: str,
    kubeconfig: Path,
    certs_dir: Path | None = None,
) -> Manifest:
    """A whole prometheus.yml: the scrape configs discovering pods through `kubeconfig`'s
    API server (Prometheus runs outside the cluster), rules evaluated every `interval`.
    Files the Prometheus Operator would mount under OPERATOR_CERTS_DIR (a tlsConfig's CA)
    are looked for in `certs_dir`, under the same names."""
    if not DURATION.match(interval):
        raise ValueError(f"not a Prometheus duration: {interval!r}")
    jobs = []
    for scrape in scrape_configs:
        job = json.loads(json.dumps(scrape))
        for discovery in job["kubernetes_sd_configs"]:
            discovery["kubeconfig_file"] = str(kubeconfig)
        tls = job.get("tls_config", {})
        if "ca_file" in tls:
            if certs_dir is None:
                raise ValueError(f"{job['job_name']} needs {tls['ca_file']}: give certs_dir")
            tls["ca_file"] = str(certs_dir / Path(tls["ca_file"]).relative_to(OPERATOR_CERTS_DIR))
        jobs.append(job)
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(rule_file)],
        "scrape_configs": jobs,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Prometheus:
    """A running Prometheus: its HTTP API on 127.0.0.1, its log file, its process."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=HTTP_TIMEOUT_S) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            raise PrometheusError(
                f"GET {path} {params}: {error.code} {error.read().decode(errors='replace')}"
            ) from None
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[Manifest]:
        """An instant query: the series of the result vector (each `metric` and `value`)."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: a {data['resultType']}, not a vector")
        result: list[Manifest] = data["result"]
        return result

    def query_range(self, expr: str, *, start: float, end: float, step: float) -> list[Manifest]:
        """A range query (what a Grafana panel asks): each series' `metric` and `values`."""
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        result: list[Manifest] = data["result"]
        return result

    def targets(self) -> list[Manifest]:
        """The active targets (each with `labels`, `health`, `lastError`, `scrapePool`)."""
        data = self._get("/api/v1/targets", state="active")
        targets: list[Manifest] = data["activeTargets"]
        return targets

    def alerts(self) -> list[Manifest]:
        """Alerts pending or firing now (each with `labels`, `state`, `activeAt`)."""
        alerts: list[Manifest] = self._get("/api/v1/alerts")["alerts"]
        return alerts

    def rules(self) -> list[Manifest]:
        groups: list[Manifest] = self._get("/api/v1/rules")["groups"]
        return groups

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=HTTP_TIMEOUT_S) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def logs(self, *, tail: int = 40) -> str:
        """The last warnings and errors of its log (the whole log stays in `log`)."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if "level=INFO" not in line]
        return "\n".join(lines[-tail:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self.process.returncode}:\n{self.logs()}")


def stop(prometheus: Prometheus) -> None:
    """SIGTERM the process (it flushes its head block), SIGKILL it after a grace period."""
    process = prometheus.process
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def running_prometheus(
    binary: Path, *, workdir: Path, config: Manifest, rules: Sequence[Manifest]
) -> Iterator[Prometheus]:
    """Prometheus with `config` and the rule file `rules` (written where the config says),
    its TSDB and log under `workdir`; stopped by its PID when the block ends. The log is
    kept in `workdir` for a failure's post-mortem."""
    workdir.mkdir(parents=True, exist_ok=True)
    (rule_file,) = config["rule_files"]
    Path(rule_file).write_text(yaml.safe_dump({"groups": list(rules)}, sort_keys=False))
    config_file = workdir / "prometheus.yml"
    config_file.write_text(dump_config(config))
    port = _free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    prometheus = Prometheus(url=f"http://127.0.0.1:{port}", process=process, log=log)
    try:
        wait_for(
            prometheus.ready,
            timeout=STARTUP_TIMEOUT_S,
            what=f"prometheus ready on {prometheus.url}",
            interval=0.2,
            check=prometheus.check_alive,
        )
        yield prometheus
    finally:
        stop(prometheus)


def wait_for_alert(
    prometheus: Prometheus, alert: str, *, state: str | None, timeout: float, matching: Mapping[str, str]
) -> Manifest | None:
    """Wait until `alert` with labels `matching` is in `state` (pending, firing), or, with
    state None, until it is neither; returns the alert (None when it went)."""

    def found() -> Manifest | None:
        for active in prometheus.alerts():
            labels = active["labels"]
            if labels.get("alertname") == alert and all(labels.get(k) == v for k, v in matching.items()):
                return active
        return None

    if state is None:
        wait_for(lambda: found() is None, timeout=timeout, what=f"{alert} {dict(matching)} resolved", interval=1.0)
        return None

    def in_state() -> Manifest | None:
        active = found()
        return active if active is not None and active["state"] == state else None

    result: Manifest = wait_for(
        in_state,
        timeout=timeout,
        what=f"{alert} {dict(matching)} {state}",
        interval=1.0,
        check=prometheus.check_alive,
    )
    return result


# The README's copy of the scrape configuration: the chart's PodMonitors for a release
# named `shardq` in `shardq-system`, as rendered with the chart's defaults.
README_RELEASE = "shardq"
README_NAMESPACE = "shardq-system"
README_VALUES = ("monitoring.podMonitor.enabled=true",)
# ...and the servers' jobs when the chart's cluster serves TLS (the README's https variant).
README_TLS_VALUES = (*README_VALUES, "cluster.tls.secretName=shardq-tls")


def readme_scrape_config(manifests: Sequence[Manifest]) -> str:
    """The `scrape_configs:` block the chart's README shows (in-cluster discovery)."""
    return dump_config({"scrape_configs": build_scrape_configs(manifests)})


def readme_tls_scrape_config(manifests: Sequence[Manifest]) -> str:
    """The README's https variant: the servers' scrape configs only (the operator's job is
    the same either way)."""
    servers = [config for config in build_scrape_configs(manifests) if "-servers/" in config["job_name"]]
    return dump_config({"scrape_configs": servers})


def main() -> None:
    """Print the README's scrape configuration block (e2e/controlplane/build.sh's helm);
    with --tls, its https variant."""
    import sys

    from e2e.binaries import locate_binaries
    from e2e.helm import render

    if sys.argv[1:] == ["--tls"]:
        manifests = render(locate_binaries(), *README_TLS_VALUES, namespace=README_NAMESPACE, release=README_RELEASE)
        print(readme_tls_scrape_config(manifests), end="")
        return
    manifests = render(locate_binaries(), *README_VALUES, namespace=README_NAMESPACE, release=README_RELEASE)
    print(readme_scrape_config(manifests), end="")


if __name__ == "__main__":
    main()
