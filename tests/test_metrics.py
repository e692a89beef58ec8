"""Prometheus exposition of the cache's metrics, and the /metrics server on 127.0.0.1."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.core.metrics import Histogram, Levels, Metrics
from hicache.errors import ConfigError, MisuseError
from hicache.metrics_http import MetricsServer
from tests.threads import settle

EVICTIONS = {"L1": 5, "L2": 1, "L3": 0}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_counts_are_counters_latencies_histograms_levels_gauges() -> None:
    """Every family parses; monotonic counts are counters, latencies histograms, levels gauges."""
    m = Metrics()
    levels = Levels({"L1": 3, "L2": 9, "L3": 0}, {"L1": 8, "L2": 16, "L3": 0}, 2, 1, 4)
    fams = {f.name: f.type for f in text_string_to_metric_families(m.prometheus(EVICTIONS, levels=levels))}
    histograms = {"hicache_restore_seconds", "hicache_transfer_seconds", "hicache_time_to_first_token_seconds"}
    gauges = {"hicache_free_pages", "hicache_capacity_pages", "hicache_pending_transfers", "hicache_requests"}
    assert {n for n, t in fams.items() if t == "histogram"} == histograms
    assert {n for n, t in fams.items() if t == "gauge"} == gauges
    assert {n for n, t in fams.items() if t not in ("histogram", "gauge")} == {
        n for n, t in fams.items() if t == "counter"
    }
    assert {"hicache_hit_tokens", "hicache_restores", "hicache_transfers", "hicache_fallbacks"} <= set(fams)


def test_counter_samples_carry_the_total_suffix_and_the_values() -> None:
    """Counter samples are named ``*_total`` and carry the dataclass fields' values."""
    m = Metrics()
    m.hit_tokens["L2"] = 48
    m.recomputed_tokens = 7
    m.directions["D2H"].count = 3
    m.directions["D2H"].bytes = 4096
    s = samples(m.prometheus(EVICTIONS))
    assert s[("hicache_hit_tokens_total", (("tier", "L2"),))] == 48
    assert s[("hicache_recomputed_tokens_total", ())] == 7
    assert s[("hicache_transfers_total", (("direction", "D2H"),))] == 3
    assert s[("hicache_transfer_bytes_total", (("direction", "D2H"),))] == 4096
    assert s[("hicache_evicted_pages_total", (("tier", "L1"),))] == 5


def test_observations_land_in_cumulative_buckets() -> None:
    """A restore of 3 ms and one of 2 s: le=0.005 counts 1, le=+Inf counts 2, sum 2.003;
    the restore counters move with them."""
    m = Metrics()
    m.observe_restore(0.003, 0.001)
    m.observe_restore(2.0, 5.0)  # overlap is capped at the restore's own time
    m.observe_transfer("H2D", 0.0001)
    m.observe_ttft(0.5)
    s = samples(m.prometheus(EVICTIONS))
    assert s[("hicache_restore_seconds_bucket", (("le", "0.001"),))] == 0
    assert s[("hicache_restore_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("hicache_restore_seconds_bucket", (("le", "+Inf"),))] == 2
    assert s[("hicache_restore_seconds_count", ())] == 2
    assert s[("hicache_restore_seconds_sum", ())] == pytest.approx(2.003)
    assert m.restores == 2 and m.restore_s == pytest.approx(2.003)
    assert m.restore_overlapped_s == pytest.approx(2.001)
    assert s[("hicache_transfer_seconds_bucket", (("direction", "H2D"), ("le", "0.0005")))] == 1
    assert s[("hicache_transfer_seconds_count", (("direction", "D2H"),))] == 0
    assert s[("hicache_time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1  # le is inclusive


def test_levels_are_exported_as_given() -> None:
    """Free pages, capacity, pending transfers and requests appear as gauges with labels."""
    levels = Levels({"L1": 3, "L2": 9, "L3": 0}, {"L1": 8, "L2": 16, "L3": 0}, 2, 1, 4)
    s = samples(Metrics().prometheus(EVICTIONS, levels=levels))
    assert s[("hicache_free_pages", (("tier", "L2"),))] == 9
    assert s[("hicache_capacity_pages", (("tier", "L1"),))] == 8
    assert s[("hicache_pending_transfers", (("kind", "backup"),))] == 2
    assert s[("hicache_pending_transfers", (("kind", "restore"),))] == 1
    assert s[("hicache_requests", ())] == 4


HELP = {
    "hicache_hit_tokens": "Prompt tokens served from each tier",
    "hicache_evicted_pages": "Pages evicted from each tier",
    "hicache_restore_seconds": "Seconds from a restore's start to its publication",
    "hicache_transfer_seconds": "Seconds from issuing a transfer to seeing it complete",
    "hicache_time_to_first_token_seconds": "Seconds from arrival to first token",
    "hicache_free_pages": "Free pages per tier",
    "hicache_capacity_pages": "Pages per tier",
    "hicache_pending_transfers": "Transfers in flight",
    "hicache_requests": "Requests admitted and not released",
}
"""The HELP text operators read for the families the collector describes itself."""


def test_every_family_has_its_help_text() -> None:
    """Each family carries a HELP line; the collector's own ones read exactly as above."""
    levels = Levels({"L1": 3, "L2": 9, "L3": 0}, {"L1": 8, "L2": 16, "L3": 0}, 2, 1, 4)
    text = Metrics().prometheus(EVICTIONS, levels=levels)
    docs = {f.name: f.documentation for f in text_string_to_metric_families(text)}
    assert all(docs.values())
    assert {name: docs.get(name) for name in HELP} == HELP


def test_to_dict_stays_json_serializable_with_histograms() -> None:
    """``to_dict`` (the status' metrics) keeps the old keys and serializes with json."""
    import json

    m = Metrics()
    m.observe_ttft(0.1)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["directions"]["H2D"]["gib_per_s"] == 0.0 and d["ttft_seconds"]["sum"] == pytest.approx(0.1)


def test_histogram_bounds_must_increase() -> None:
    """Unsorted or repeated bucket bounds are a configuration error."""
    with pytest.raises(ConfigError, match="increasing"):
        Histogram((0.1, 0.01))


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def test_server_serves_the_latest_published_text_on_loopback() -> None:
    """A scrape of 127.0.0.1:PORT/metrics returns the latest text published; other paths 404."""
    m = Metrics()
    with MetricsServer(port=0) as server:
        assert server.port > 0
        m.recomputed_tokens = 11
        server.publish(m.prometheus(EVICTIONS))
        status, ctype, body = get(f"http://127.0.0.1:{server.port}/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert samples(body)[("hicache_recomputed_tokens_total", ())] == 11
        m.recomputed_tokens = 12
        server.publish(m.prometheus(EVICTIONS))
        assert samples(get(f"http://127.0.0.1:{server.port}/metrics")[2])[("hicache_recomputed_tokens_total", ())] == 12
        assert get(f"http://127.0.0.1:{server.port}/other")[0] == 404
        assert server._server is not None and server._server.server_address[0] == "127.0.0.1"


def test_head_answers_with_the_headers_of_a_scrape_and_no_body() -> None:
    """A liveness probe's HEAD /metrics: 200, the content type and the length GET would
    send, no body; other paths 404."""
    import http.client

    with MetricsServer(port=0) as server:
        server.publish(Metrics().prometheus(EVICTIONS))
        size = len(get(f"http://127.0.0.1:{server.port}/metrics")[2])
        for path, status in (("/metrics", 200), ("/other", 404)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request("HEAD", path)
                reply = conn.getresponse()
                assert reply.status == status and reply.read() == b""
                if status == 200:
                    assert reply.getheader("Content-Type", "").startswith("text/plain")
                    assert int(reply.getheader("Content-Length", "-1")) == size
            finally:
                conn.close()


def test_stop_joins_the_thread_and_frees_the_port() -> None:
    """After ``stop`` no server thread is left and the port refuses connections."""
    settle()
    before = {t.ident for t in threading.enumerate()}
    server = MetricsServer(port=0)
    port = server.start()
    get(f"http://127.0.0.1:{port}/metrics")
    server.stop()
    server.stop()  # idempotent
    assert {t.ident for t in threading.enumerate()} <= before
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_server_misuse_and_bad_ports() -> None:
    """Starting twice, asking the port before start, or a port out of range raise typed errors."""
    with pytest.raises(ConfigError, match="port"):
        MetricsServer(port=70000)
    server = MetricsServer()
    with pytest.raises(MisuseError, match="not running"):
        _ = server.port
    server.start()
    try:
        with pytest.raises(MisuseError, match="already running"):
            server.start()
        server.publish("a 1\n")
        with pytest.raises(MisuseError, match="encodes to UTF-8"):
            server.publish("b \ud800\n")  # and the last text published stays
        assert get(f"http://127.0.0.1:{server.port}/metrics")[2] == "a 1\n"
    finally:
        server.stop()


@pytest.mark.parametrize("counts", [[1, 2], [0, 0, 0, 0], [1, -1, 0], [0, 1.5, 0], [True, 0, 0]], ids=str)
def test_histogram_refuses_counts_that_do_not_fit_its_bounds(counts: list[int]) -> None:
    """Counts given at construction must be one non-negative int per bound plus +Inf: a
    wrong length used to pass and break ``observe``/``cumulative`` later."""
    with pytest.raises(ConfigError, match=r"must be 3 non-negative ints"):
        Histogram((0.1, 1.0), counts)


def test_histogram_keeps_counts_that_fit() -> None:
    """A fitting list is kept as given and accumulates from there."""
    h = Histogram((0.1, 1.0), [1, 0, 2])
    h.observe(0.5)
    assert h.counts == [1, 1, 2] and h.cumulative() == [("0.1", 1.0), ("1.0", 2.0), ("+Inf", 4.0)]


@pytest.mark.parametrize("text", [b"hicache_x 1\n", None, 3])
def test_publish_takes_only_the_exposition_text(text: object) -> None:
    """Bytes or None were an AttributeError from inside publish; now a MisuseError, and the
    text served before stays."""
    server = MetricsServer()
    server.publish("a 1\n")
    with pytest.raises(MisuseError, match="publish takes the exposition text"):
        server.publish(text)  # type: ignore[arg-type]
    assert server._latest() == b"a 1\n"


@pytest.mark.parametrize("seconds", [-100.0, float("nan"), float("inf"), True, "0.5", 1e300])
def test_a_ttft_that_is_no_duration_is_refused_and_changes_nothing(seconds: object) -> None:
    """A negative TTFT lowered the histogram's sum, a NaN spoiled it for good."""
    m = Metrics()
    m.observe_ttft(0.5)
    with pytest.raises(MisuseError, match="observe_ttft: seconds must be a number"):
        m.observe_ttft(seconds)  # type: ignore[arg-type]
    assert (m.ttft_seconds.count, m.ttft_seconds.sum) == (1, 0.5)
