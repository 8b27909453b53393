#!/usr/bin/env python3
"""A two-node merod lab on loopback, for trying the sidecar against a real merod and for
re-recording fixtures/merod/ (scripts/record-merod.py) and the real-merod test
(tests/real_merod.rs).

Node A owns the namespaces and verifies admissions; node B is a mock-TEE replica, the node the
sidecar manages. Needs a merod built with the `mock-attestation` feature, named by MEROD_BIN
(or --merod). Python 3 standard library only.

  merod-lab.py up DIR [--namespaces N] [--ports A_RPC,A_SWARM,B_RPC,B_SWARM | --ports auto]
      init (first time) and start both nodes, create N namespaces (default 3) on A with a TEE
      admission policy accepting the mock quote (all-zero MRTD), and write DIR/lab.json:
      a_rpc, a_swarm, b_rpc, b_swarm, home, pids, namespaces, a_peer_id, b_peer_id, b_config,
      b_admin_url and admitter_addr (A's swarm multiaddr with its /p2p/ PeerId).
      Default ports 2638,2438,2639,2439; `auto` picks free loopback ports. A DIR that was up
      before keeps the ports it was initialised with. If anything fails, the nodes it started
      are stopped again.
  merod-lab.py down DIR
      stop both nodes (SIGTERM to each node's process group, SIGKILL after 10 s).

Every dial stays on loopback: `init` adds public bootstrap nodes, which are removed.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEFAULT_PORTS = (2638, 2438, 2639, 2439)
MOCK_MRTD = "0" * 96


def http(method, url, body=None, timeout=120):
    """(status, parsed JSON body or text) of one request; no proxy, even from the environment."""
    data, headers = None, {}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with opener.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, (json.loads(raw) if raw else None)
    except ValueError:
        return status, raw.decode(errors="replace")


def merod_bin(args):
    path = args.merod or os.environ.get("MEROD_BIN")
    if not path:
        raise SystemExit("merod-lab: set MEROD_BIN (or --merod) to a mock-attestation merod")
    return path


def merod(binary, home, node, *argv):
    r = subprocess.run([binary, "--home", home, "--node", node, *argv],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"merod-lab: merod {node} {' '.join(argv)} failed:\n{r.stderr[-2000:]}")
    return r


def peer_id(home, node):
    with open(os.path.join(home, node, "config.toml")) as f:
        for line in f:
            if line.startswith("peer_id"):
                return line.split('"')[1]
    raise SystemExit(f"merod-lab: no peer_id in {node}/config.toml")


def set_bootstrap(home, node, nodes):
    path = os.path.join(home, node, "config.toml")
    with open(path) as f:
        text = f.read()
    listed = "".join(f'    "{n}",\n' for n in nodes)
    text, count = re.subn(r"\[bootstrap\]\nnodes = \[\n(?:    \".*\",\n)*\]",
                          "[bootstrap]\nnodes = [\n" + listed + "]", text)
    if count != 1:
        raise SystemExit(f"merod-lab: no [bootstrap] nodes list in {path}")
    with open(path, "w") as f:
        f.write(text)


def free_port():
    """A port free on loopback for both TCP and UDP (the swarm listens on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                    u.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def pick_ports(spec):
    if spec is None:
        return DEFAULT_PORTS
    if spec == "auto":
        ports = []
        while len(ports) < 4:
            p = free_port()
            if p not in ports:
                ports.append(p)
        return tuple(ports)
    parts = spec.split(",")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise SystemExit("merod-lab: --ports takes A_RPC,A_SWARM,B_RPC,B_SWARM or auto")
    return tuple(int(p) for p in parts)


def wait_until(what, secs, check):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"merod-lab: {what} within {secs} s: no")


def stop(pids, grace=10.0):
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def up(args):
    binary = merod_bin(args)
    d = os.path.abspath(args.dir)
    home = os.path.join(d, "home")
    ports_file = os.path.join(d, "ports.json")
    os.makedirs(home, exist_ok=True)
    if not os.path.exists(os.path.join(home, "a", "config.toml")):
        a_rpc, a_swarm, b_rpc, b_swarm = pick_ports(args.ports)
        merod(binary, home, "a", "init", "--server-host", "127.0.0.1", "--server-port", str(a_rpc),
              "--swarm-host", "127.0.0.1", "--swarm-port", str(a_swarm))
        merod(binary, home, "b", "init", "--server-host", "127.0.0.1", "--server-port", str(b_rpc),
              "--swarm-host", "127.0.0.1", "--swarm-port", str(b_swarm))
        set_bootstrap(home, "a", [])
        set_bootstrap(home, "b", [f"/ip4/127.0.0.1/tcp/{a_swarm}/p2p/{peer_id(home, 'a')}"])
        with open(ports_file, "w") as f:
            json.dump([a_rpc, a_swarm, b_rpc, b_swarm], f)
    with open(ports_file) as f:
        a_rpc, a_swarm, b_rpc, b_swarm = json.load(f)
    pids = {}
    try:
        for node, extra in (("a", []), ("b", ["--mock-tee"])):
            with open(os.path.join(d, f"{node}.log"), "a") as log:
                p = subprocess.Popen([binary, "--home", home, "--node", node, "run", *extra],
                                     stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            pids[node] = p.pid
        # Written at once, so `down` can stop the nodes even if the rest fails.
        with open(os.path.join(d, "pids.json"), "w") as f:
            json.dump(pids, f)
        for port in (a_rpc, b_rpc):
            wait_until(f"merod on {port} healthy", 120,
                       lambda port=port: http("GET", f"http://127.0.0.1:{port}/admin-api/health",
                                              timeout=2)[0] == 200)
        wait_until("B connected to A", 60, lambda: (lambda r: r[0] == 200 and r[1].get("count", 0) >= 1)(
            http("GET", f"http://127.0.0.1:{b_rpc}/admin-api/peers", timeout=2)))
        a = f"http://127.0.0.1:{a_rpc}/admin-api"
        wasm = os.path.join(d, "dummy.wasm")
        with open(wasm, "wb") as f:
            f.write(b"\x00asm\x01\x00\x00\x00")
        s, body = http("POST", f"{a}/install-dev-application", {"path": wasm, "metadata": []})
        if s != 200:
            raise SystemExit(f"merod-lab: install-dev-application: {s} {body}")
        app = body["data"]["applicationId"]
        namespaces = []
        for i in range(args.namespaces):
            s, body = http("POST", f"{a}/namespaces", {"applicationId": app, "name": f"fleet-{i}"})
            if s != 200:
                raise SystemExit(f"merod-lab: create namespace: {s} {body}")
            ns = body["data"]["namespaceId"]
            s, body = http("PUT", f"{a}/groups/{ns}/settings/tee-admission-policy",
                           {"allowedMrtd": [MOCK_MRTD], "acceptMock": True})
            if s != 200:
                raise SystemExit(f"merod-lab: admission policy of {ns}: {s} {body}")
            namespaces.append(ns)
    except BaseException:
        stop(pids.values())
        raise
    a_peer = peer_id(home, "a")
    lab = {"a_rpc": a_rpc, "a_swarm": a_swarm, "b_rpc": b_rpc, "b_swarm": b_swarm, "home": home,
           "pids": pids, "namespaces": namespaces, "a_peer_id": a_peer,
           "b_peer_id": peer_id(home, "b"), "b_config": os.path.join(home, "b", "config.toml"),
           "b_admin_url": f"http://127.0.0.1:{b_rpc}/",
           "admitter_addr": f"/ip4/127.0.0.1/tcp/{a_swarm}/p2p/{a_peer}"}
    with open(os.path.join(d, "lab.json"), "w") as f:
        json.dump(lab, f, indent=1)
    print(json.dumps(lab, indent=1))


def down(args):
    d = os.path.abspath(args.dir)
    path = os.path.join(d, "pids.json")
    if not os.path.exists(path):
        print(f"merod-lab: nothing started in {d}", file=sys.stderr)
        return
    with open(path) as f:
        stop(json.load(f).values())
    os.remove(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--merod", help="the merod binary (default: $MEROD_BIN)")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("dir")
    u.add_argument("--namespaces", type=int, default=3)
    u.add_argument("--ports")
    dn = sub.add_parser("down")
    dn.add_argument("dir")
    args = p.parse_args()
    {"up": up, "down": down}[args.cmd](args)


if __name__ == "__main__":
    main()
