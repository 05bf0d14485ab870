"""Reading a server's /metrics as Prometheus would: samples by name and labels."""

from __future__ import annotations

import ssl
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.clusters import SERVERS, Cluster

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(url: str, ca_file: str | None = None) -> str:
    """The exposition at `url`; an https URL is checked against `ca_file`."""
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        text: str = response.read().decode()
    return text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of one exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def values(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> list[float]:
    """Values of every sample called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return [value for (sample, have), value in found.items() if sample == name and wanted <= have]


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    matching = values(found, name, **labels)
    assert len(matching) == 1, f"expected one {name}{labels}, found {len(matching)}"
    return matching[0]


def scraped_total(url: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` whose labels include `labels`, scraped now."""
    return sum(values(samples(scrape_text(url)), name, **labels))


def scrape_all(cluster: Cluster) -> dict[str, Samples]:
    """Each of the cluster's servers s1..s3, scraped now (URLError while one starts)."""
    return {server: samples(scrape_text(cluster.metrics_url(server))) for server in SERVERS}


def leaders_by_shard(scraped: dict[str, Samples]) -> dict[str, list[str]]:
    """The servers whose `shardq_shard_leader` is 1, by shard label."""
    leaders: dict[str, list[str]] = {}
    for server, found in scraped.items():
        for (name, labels), flag in found.items():
            if name == "shardq_shard_leader" and flag == 1:
                leaders.setdefault(dict(labels)["shard"], []).append(server)
    return leaders
