"""Server-side tools reach only what the operator allows: URL prefixes and blocked networks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig, ToolNetworkConfig
from serve_apps.orchestrator import tool_network
from serve_apps.orchestrator.models import ToolSpec
from serve_apps.orchestrator.tool_network import Destination, ToolNetworkPolicy
from serve_apps.orchestrator.tools import run_http_tool

DEFAULT = ToolNetworkPolicy(ToolNetworkConfig())


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # AWS, GCP, Azure metadata
    "http://[fd00:ec2::254]/latest/meta-data/",  # AWS over IPv6
    "http://100.100.100.200/latest/meta-data/",  # Alibaba
    "http://[fe80::1]:8080/x",
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
])
def test_metadata_and_link_local_addresses_are_refused_by_default(url):
    refusal = DEFAULT.check_url(url)
    assert refusal is not None and "tool_network.blocked_networks" in refusal


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000/tool", "https://tools.internal/lookup", "http://10.0.0.7/x"])
def test_other_addresses_and_names_pass_the_default(url):
    assert DEFAULT.check_url(url) is None


def test_allowed_prefixes_are_whole_url_prefixes():
    policy = ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=["https://tools.internal/"]))
    assert policy.check_url("https://tools.internal/lookup") is None
    for url in ("https://tools.internal.evil.com/x", "http://tools.internal/x", "https://other/x"):
        assert "allowed_url_prefixes" in policy.check_url(url)


@pytest.mark.parametrize("prefix, url", [
    ("http://tools.internal", "http://tools.internal@evil.com/"),  # userinfo: the host is evil.com
    ("http://tools.internal", "http://tools.internal\\@evil.com/"),
    ("http://tools.internal", "http://tools.internal.evil.com/"),
    ("http://tools.internal:8080", "http://tools.internal:8080@evil.com/"),
    ("http://tools.internal:8080", "http://tools.internal:8081/"),
    ("https://tools.internal/api/", "https://tools.internal/api/../admin"),  # the client would send /admin
    ("https://tools.internal/api/", "https://tools.internal/api/%2e%2e/admin"),
    ("https://tools.internal/api/", "https://tools.internal/api/./../../x"),
    ("https://tools.internal/api", "https://tools.internal/apix"),
    # What some servers read as `..` or a path separator (Tomcat and Spring: `..;`; others decode `%2f`, fold `\`).
    ("https://tools.internal/api/", "https://tools.internal/api/..;/admin"),
    ("https://tools.internal/api/", "https://tools.internal/api/..%2fadmin"),
    ("https://tools.internal/api/", "https://tools.internal/api/..%5cadmin"),
    ("https://tools.internal/api/", "https://tools.internal/api/..\\admin"),
])
def test_a_prefix_admits_its_own_host_port_and_path_only(prefix, url):
    policy = ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=[prefix]))
    assert policy.check_url(url) is not None, url


@pytest.mark.parametrize("prefix, url", [
    ("http://tools.internal", "http://tools.internal/x"),
    ("http://tools.internal", "http://TOOLS.internal:80/x"),  # same host and default port
    ("https://tools.internal/api", "https://tools.internal/api"),
    ("https://tools.internal/api", "https://tools.internal/api/lookup?q=1"),
    ("https://tools.internal/api/", "https://user:pw@tools.internal/api/x"),
    # No path is `/`, which the HTTP client requests: refused as outside `https://tools.internal/`.
    ("https://tools.internal/", "https://tools.internal"),
    ("https://tools.internal/", "https://tools.internal?op=lookup"),
])
def test_a_prefix_admits_urls_under_it(prefix, url):
    assert ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=[prefix])).check_url(url) is None


@pytest.mark.parametrize("url", [
    "http://[::169.254.169.254]/",  # IPv4-compatible
    "http://[::ffff:0:a9fe:a9fe]/",  # IPv4-translated
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64
    "http://[64:ff9b:1::a9fe:a9fe]/",  # local-use NAT64, /96
    "http://[64:ff9b:1:0:a9:fea9:fe00:0]/",  # local-use NAT64, /64 (byte 8 is the zero "u" octet)
    "http://[64:ff9b:1:a9fe:a9:fe00::]/",  # local-use NAT64, /48
    "http://[2002:a9fe:a9fe::]/",  # 6to4
])
def test_an_ipv6_address_embedding_a_blocked_ipv4_one_is_refused(url):
    refusal = DEFAULT.check_url(url)
    assert refusal is not None and "169.254.169.254" in refusal


@pytest.mark.parametrize("url", [
    "http://0.0.0.0:9/", "http://0:9/", "http://[::]:9/",
    # Embedded in IPv6 (Linux connects ::ffff:0.0.0.0 to 127.0.0.1), NAT64 alike.
    "http://[::ffff:0.0.0.0]:9/", "http://[64:ff9b::0.0.0.0]:9/",
])
def test_an_unspecified_address_counts_as_this_hosts_loopback(url):
    policy = ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=["127.0.0.0/8", "::1/128"]))
    assert "blocked network" in asyncio.run(policy.check_destination(url))
    assert DEFAULT.check_url(url) is None  # loopback is not blocked by default


@pytest.mark.parametrize("url", [
    "http://example.com:99999/", "http://localhost:-1/", "http://localhost:abc/", "http://a..b/", "http://.a/",
    f"http://{'a' * 64}.example/", "http://[1.2.3.4]/", "http://[zz]/", "http://[::1/", "http://x]/",
])
def test_a_url_the_check_cannot_read_is_refused_never_raised(url):
    assert isinstance(DEFAULT.check_url(url) or asyncio.run(DEFAULT.check_destination(url)), str)


def test_a_name_is_refused_when_it_resolves_into_a_blocked_network():
    policy = ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=["127.0.0.0/8", "::1/128"]))
    assert policy.check_url("http://localhost:1/x") is None  # a name: not resolved when the session is created
    refusal = asyncio.run(policy.check_destination("http://localhost:1/x"))
    assert refusal is not None and "blocked network" in refusal
    destination = asyncio.run(DEFAULT.check_destination("http://localhost:1/x"))
    assert isinstance(destination, Destination) and set(destination.addresses) <= {"127.0.0.1", "::1"}
    assert destination.addresses
    # An address needs no lookup, and without blocked networks nothing is looked up.
    assert asyncio.run(DEFAULT.check_destination("http://10.0.0.7/x")) == Destination("http://10.0.0.7/x")
    open_policy = ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=[]))
    assert asyncio.run(open_policy.check_destination("http://localhost:1/x")) == Destination("http://localhost:1/x")


@pytest.mark.parametrize("field, value", [
    ("blocked_networks", ["not-a-network"]),
    ("allowed_url_prefixes", ["tools.internal/"]),
    ("allowed_url_prefixes", ["https://"]),
    ("allowed_url_prefixes", ["http://tools.internal:99999/"]),
])
def test_bad_settings_are_refused_at_the_edge(field, value):
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"tool_network": {field: value}})


class _CountingHandler(BaseHTTPRequestHandler):
    num_requests = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        type(self).num_requests += 1
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_a_blocked_tool_is_an_error_result_and_no_request_is_sent():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://localhost:{server.server_address[1]}/tool"
        spec = ToolSpec(name="lookup", parameters={"type": "object"}, execution={"kind": "http", "url": url})
        blocked = ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=["127.0.0.0/8", "::1/128"]))
        outcome = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=blocked))
        assert outcome.status == "error" and "blocked network" in json.loads(outcome.content)["error"]
        assert _CountingHandler.num_requests == 0
        allowed = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=DEFAULT))
        assert allowed.status == "ok" and _CountingHandler.num_requests == 1
    finally:
        server.shutdown()
        server.server_close()


class _HostRecordingHandler(BaseHTTPRequestHandler):
    hosts: list[str] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        type(self).hosts.append(self.headers["host"])
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_a_call_connects_to_the_address_that_was_checked_not_to_a_later_dns_answer(monkeypatch):
    """DNS rebinding: the name resolves to an allowed address for the check, then to a blocked one."""
    answers = [[("127.0.0.1", 0)], [("169.254.169.254", 0)]]

    def getaddrinfo(host, port):
        assert host == "tool.rebind.test"
        address = answers.pop(0) if len(answers) > 1 else answers[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a, _ in address]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    _HostRecordingHandler.hosts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostRecordingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://tool.rebind.test:{server.server_address[1]}/tool"
        spec = ToolSpec(name="lookup", parameters={"type": "object"}, execution={"kind": "http", "url": url})
        outcome = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=DEFAULT))
        # The name resolves nowhere outside this test: only the checked address could have answered.
        assert outcome.status == "ok", outcome.content
        assert _HostRecordingHandler.hosts == [f"tool.rebind.test:{server.server_address[1]}"]
        # The next call's check sees the new answer and sends nothing.
        again = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=DEFAULT))
        assert again.status == "error" and "blocked network" in json.loads(again.content)["error"]
        assert len(_HostRecordingHandler.hosts) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_pinned_https_call_keeps_the_name_for_host_sni_and_the_certificate(monkeypatch):
    def getaddrinfo(host, port):
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::7", port, 0, 0))]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    seen: list[httpx.Request] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    spec = ToolSpec(name="lookup", parameters={"type": "object"},
                    execution={"kind": "http", "url": "https://tools.example:8443/lookup?v=1"})

    async def call():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await run_http_tool(spec, "{}", 5.0, 4096, client=client, network=DEFAULT)

    assert asyncio.run(call()).status == "ok"
    (request,) = seen
    assert str(request.url) == "https://[2001:db8::7]:8443/lookup?v=1"
    assert request.headers["host"] == "tools.example:8443"
    assert request.extensions["sni_hostname"] == "tools.example"


@pytest.mark.parametrize("network", [DEFAULT, ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=[]))],
                         ids=["pinned", "unpinned"])
@pytest.mark.parametrize("host", ["xn--ls8h.la", "xn--zz.tools.example"])
def test_a_host_whose_a_label_idna_2008_refuses_is_called_by_that_name(monkeypatch, network, host):
    """An emoji domain (`xn--ls8h.la`, 💩.la) or a malformed A-label passes the URL check at creation, and httpx's
    `URL.host` (read for SNI) and its own Host header decode it, raising: the turn failed `internal`, every time."""
    monkeypatch.setattr(tool_network, "_getaddrinfo",
                        lambda h, port: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.9", port))])
    seen: list[httpx.Request] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    spec = ToolSpec(name="lookup", parameters={"type": "object"},
                    execution={"kind": "http", "url": f"https://{host}/lookup"})

    async def call():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await run_http_tool(spec, "{}", 5.0, 4096, client=client, network=network)

    assert asyncio.run(call()).status == "ok"
    (request,) = seen
    assert request.headers["host"] == host and request.extensions["sni_hostname"] == host


def test_a_call_tries_the_next_checked_address_when_one_refuses_the_connection(monkeypatch):
    # The name resolves to two loopback addresses; only the second has a server. Nothing reached the
    # first, so trying the second cannot repeat a call. When every address refuses, the call is an error.
    def getaddrinfo(host, port):
        assert host == "tool.pair.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in ("127.0.0.2", "127.0.0.1")]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    _HostRecordingHandler.hosts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostRecordingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    spec = ToolSpec(name="lookup", parameters={"type": "object"},
                    execution={"kind": "http", "url": f"http://tool.pair.test:{port}/tool"})
    try:
        destination = asyncio.run(DEFAULT.check_destination(spec.execution.url))
        assert destination == Destination(spec.execution.url, ("127.0.0.2", "127.0.0.1"))
        outcome = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=DEFAULT))
        assert outcome.status == "ok", outcome.content
        assert _HostRecordingHandler.hosts == [f"tool.pair.test:{port}"]
    finally:
        server.shutdown()
        server.server_close()
    refused = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=DEFAULT))
    assert refused.status == "error" and "ConnectError" in json.loads(refused.content)["error"]


@pytest.mark.parametrize("blocked, url", [
    (["127.0.0.0/8"], "http://[::1]:8265/api/jobs/x/stop"),
    (["::1/128"], "http://127.0.0.1:8265/api/jobs/x/stop"),
    (["127.0.0.0/8"], "http://[::ffff:127.0.0.1]:8265/"),
])
def test_either_familys_loopback_blocks_the_other(blocked, url):
    policy = ToolNetworkPolicy(ToolNetworkConfig(blocked_networks=blocked))
    assert "blocked network" in policy.check_url(url)


@pytest.mark.parametrize("url", ["http://[::1]8265/api/x", "http://[fd00::10]6379/api/x"])
def test_a_url_whose_port_the_http_client_reads_otherwise_is_refused(url):
    """`urlsplit` reads no port after `]` without a colon; httpx reads the digits as one: a prefix pinned
    to port 80 would admit a call to another port."""
    host = url.split("]")[0] + "]"
    policy = ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=[f"{host}/api/"], blocked_networks=[]))
    assert "ambiguous" in policy.check_url(url)
    assert policy.check_url(f"{host}/api/x") is None


@pytest.mark.parametrize("url, network", [
    ("https://svc:S3CRET@orders.no-such-host.invalid/lookup?api_key=sk-LIVE-1", DEFAULT),
    ("http://svc:S3CRET@169.254.169.254/latest?api_key=sk-LIVE-1", DEFAULT),
    ("https://svc:S3CRET@tools.internal/x?api_key=sk-LIVE-1",
     ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=["https://tools.example/"]))),
])
def test_a_refused_tool_url_is_shown_without_its_password_or_query(url, network):
    """The refusal reaches the model, the transcript and logs; the trace gets a fixed reason."""
    spec = ToolSpec(name="lookup", parameters={"type": "object"}, execution={"kind": "http", "url": url})
    outcome = asyncio.run(run_http_tool(spec, "{}", 5.0, 4096, network=network))
    said = json.loads(outcome.content)["error"]
    assert outcome.status == "error" and "tool URL " in said and "***@" in said
    for secret in ("S3CRET", "sk-LIVE-1", "svc"):
        assert secret not in said and secret not in outcome.reason
    assert outcome.reason == "destination refused by tool_network"
    assert "S3CRET" not in (network.check_url(url) or "")


@pytest.mark.parametrize("url", [
    "http://svc:pa/S3CRET@tools.internal/x",  # parsers read host `svc`, port `pa`
    "http://svc:S3CRET?x@tools.internal/x",
    "http://svc:S3CRET#x@tools.internal/x",
    "http://svc/S3CRET:pw@tools.internal/x",  # host `svc`, the rest a path
    "http://svc:S3/CRET@tools.internal/x",
    "http://svc:S3/C?RET@tools.internal/x",  # a '/' and a '?': the query's mark came first
    "http://svc:12/S3?CRET@tools.internal/x",  # read as port 12, path /S3
])
def test_a_password_that_cuts_the_url_short_is_not_shown(url):
    """A password with a `/`, `?` or `#` in it ends the URL's authority early: its pieces read as a port (quoted by
    the parse error) or a path; the refusal showed them."""
    policy = ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=["https://tools.example/"]))
    refusal = policy.check_url(url)
    assert refusal is not None and refusal.startswith("tool URL http://***")
    for piece in ("S3", "CRET", "pa", "pw", "12"):
        assert piece not in refusal.split(" ", 3)[2] and f"'{piece}'" not in refusal


def test_a_unicode_host_is_resolved_as_the_http_client_sends_it(monkeypatch):
    """The socket module's IDNA 2003 looked up `strasse.de` for `straße.de` (IDNA 2008: `xn--strae-oqa.de`, the
    name in Host and SNI): the call went to another domain's owner, arguments and URL credentials with it."""
    looked_up = []

    def getaddrinfo(host, port):
        looked_up.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.9", port))]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    destination = asyncio.run(DEFAULT.check_destination("https://straße.de/api"))
    assert looked_up == ["xn--strae-oqa.de"] and destination.addresses == ("203.0.113.9",)
    policy = ToolNetworkPolicy(ToolNetworkConfig(allowed_url_prefixes=["https://xn--strae-oqa.de/api"]))
    assert isinstance(asyncio.run(policy.check_destination("https://straße.de/api/x")), Destination)


def test_tool_hosts_are_looked_up_on_threads_of_their_own(monkeypatch):
    """On the loop's default pool (six threads on two cores), names whose servers never answer could hold every
    thread the replica's own lookups (Redis reconnecting) need: a cancelled call does not stop its lookup."""
    threads = []

    def getaddrinfo(host, port):
        threads.append(threading.current_thread().name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.9", port))]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    asyncio.run(DEFAULT.check_destination("https://tools.example/api"))
    assert len(threads) == 1 and threads[0].startswith("tool-dns")


async def _timed_check(host: str, seconds: float):
    """The destination check of a tool on `host`, or "timed out" after `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            return await DEFAULT.check_destination(f"http://{host}:9000/tool")
    except TimeoutError:
        return "timed out"


def test_calls_to_a_host_whose_lookup_hangs_share_one_lookup_thread(monkeypatch):
    """Turns aimed at a name whose DNS server never answers must not take every lookup thread: other sessions'
    tools still resolve while those calls time out, and the waiting calls are answered by the one lookup."""
    release = threading.Event()
    started: list[str] = []

    def getaddrinfo(host, port):
        started.append(host)
        if host == "black.hole.test":
            release.wait(10)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)

    async def scenario():
        stuck = [asyncio.create_task(_timed_check("black.hole.test", 0.2)) for _ in range(tool_network._TOOL_LOOKUPS._max_workers + 2)]
        assert set(await asyncio.gather(*stuck)) == {"timed out"}
        other = await _timed_check("tools.elsewhere.test", 2.0)
        waiting = asyncio.create_task(_timed_check("black.hole.test", 5.0))
        await asyncio.sleep(0)
        release.set()
        return other, await waiting

    try:
        other, waited = asyncio.run(scenario())
    finally:
        release.set()
    assert other == Destination("http://tools.elsewhere.test:9000/tool", ("127.0.0.1",))
    assert waited == Destination("http://black.hole.test:9000/tool", ("127.0.0.1",))
    assert started.count("black.hole.test") == 1


def test_lookups_every_caller_left_do_not_queue_ahead_of_other_sessions(monkeypatch):
    """Distinct names under a zone whose server never answers: each lookup held a thread for the resolver's
    whole timeout, and those queued behind them ran after their calls had timed out, ahead of every other
    session's tool. Cancelled while queued, they never run; the failure of one that ran unread is not logged."""
    release = threading.Event()
    started: list[str] = []

    def getaddrinfo(host, port):
        started.append(host)
        if host.endswith(".black.hole.test"):
            release.wait(10)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(tool_network, "_getaddrinfo", getaddrinfo)
    num_threads = tool_network._TOOL_LOOKUPS._max_workers

    async def scenario():
        names = [f"n{i}.black.hole.test" for i in range(num_threads + 8)]
        stuck = [asyncio.create_task(_timed_check(name, 0.2)) for name in names]
        assert set(await asyncio.gather(*stuck)) == {"timed out"}
        release.set()  # the running lookups end; the queued ones were cancelled as their callers left
        return await _timed_check("tools.elsewhere.test", 5.0)

    try:
        other = asyncio.run(scenario())
    finally:
        release.set()
    assert other == Destination("http://tools.elsewhere.test:9000/tool", ("127.0.0.1",))
    assert len([host for host in started if host.endswith(".black.hole.test")]) == num_threads
    assert not tool_network._LOOKUP_WAITERS  # every caller left or was answered
