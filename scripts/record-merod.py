#!/usr/bin/env python3
"""Re-records merod's admin API answers that fleet-sidecar relies on, and says which differ in
shape from the committed recordings (fixtures/merod/).

  record-merod.py ADMIN_URL OUT_DIR --namespace ID --namespace ID --namespace ID
                  [--admitter-addr MULTIADDR] [--against DIR] [--quick]
  record-merod.py ADMIN_URL OUT_DIR --lab LAB_DIR [--against DIR] [--quick]

ADMIN_URL is the merod node the sidecar would manage (e.g. http://127.0.0.1:2639/): a mock-TEE
replica that holds no namespace yet (a fresh node: the first recordings are "before any join").
It needs three namespaces whose admission policy accepts it: the first is joined, listed and
left; the second is joined with `admitterAddrs` (and plainly when the core refuses that field),
so the listing has two pages of one; the third is never joined. `--admitter-addr` is the
verifier's swarm multiaddr with its /p2p/ PeerId. `--lab DIR` takes all of these from a lab
started by scripts/merod-lab.py (DIR/lab.json).

Each answer is written to OUT_DIR/<name>.json in the format of fixtures/merod/:
{"request": {method, path, content_type, body}, "response": {status, content_type, body},
 "elapsed_s", "note"}; an empty body is recorded as null. Then each recording is compared with
the committed one of the same name (--against, default: fixtures/merod/ beside this script) by
shape: the status, the content type, and the body's keys and value types (not the values).

Exit status: 0 when every shape matches, 1 when one differs or is new, 2 when recording failed.
--quick leaves out fleet-join-unknown-namespace (merod waits ~30 s for a verifier there).
Python 3 standard library only; no proxy is used.
"""
import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

UNKNOWN = "ab" * 32
NONCE = "5a" * 32
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Recorder:
    def __init__(self, admin_url, out):
        self.base = admin_url.rstrip("/") + "/admin-api"
        self.out = out
        self.names = []

    def call(self, method, path, body=None, content_type="application/json", timeout=120):
        data, headers = None, {}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            if content_type:
                headers["Content-Type"] = content_type
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        t0 = time.monotonic()
        try:
            with OPENER.open(req, timeout=timeout) as r:
                status, raw, hdrs = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, raw, hdrs = e.code, e.read(), e.headers
        elapsed = time.monotonic() - t0
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return status, parsed, hdrs.get("content-type"), elapsed

    def rec(self, name, method, path, body=None, content_type="application/json", note=""):
        status, parsed, ctype, elapsed = self.call(method, path, body, content_type)
        entry = {"request": {"method": method, "path": "/admin-api" + path,
                             "content_type": content_type if body is not None else None,
                             "body": body.decode() if isinstance(body, bytes) else body},
                 "response": {"status": status, "content_type": ctype, "body": parsed},
                 "elapsed_s": round(elapsed, 2), "note": note}
        with open(os.path.join(self.out, name + ".json"), "w") as f:
            json.dump(entry, f, indent=1)
        self.names.append(name)
        print(f"  {name}: {status} in {elapsed:.2f}s")
        return status, parsed


def shape(value):
    """The value's shape: object keys with their shapes, array element shapes, scalar types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = []
        for item in value:
            s = shape(item)
            if s not in shapes:
                shapes.append(s)
        return ["array of"] + shapes
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "string"


def response_shape(entry):
    r = entry["response"]
    ctype = r.get("content_type")
    essence = ctype.split(";")[0].strip().lower() if ctype else None
    return {"status": r.get("status"), "content_type": essence, "body": shape(r.get("body"))}


def differences(old, new, where=""):
    """Human-readable differences between two shapes."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            path = f"{where}.{k}" if where else k
            if k not in new:
                out.append(f"{path}: gone")
            elif k not in old:
                out.append(f"{path}: new ({json.dumps(new[k])})")
            else:
                out.extend(differences(old[k], new[k], path))
        return out
    if old == new:
        return []
    # An empty array has no element shape: it matches any array.
    if isinstance(old, list) and isinstance(new, list) and (old == ["array of"] or new == ["array of"]):
        return []
    return [f"{where}: was {json.dumps(old)}, now {json.dumps(new)}"]


def compare(out, against, names):
    """Prints the shape comparison; returns True when every recording matches a committed one."""
    same = True
    print(f"\nShapes against {against}:")
    for name in names:
        with open(os.path.join(out, name + ".json")) as f:
            new = response_shape(json.load(f))
        committed = os.path.join(against, name + ".json")
        if not os.path.exists(committed):
            print(f"  NEW      {name} (no committed recording)")
            same = False
            continue
        with open(committed) as f:
            old = response_shape(json.load(f))
        diffs = differences(old, new)
        if diffs:
            same = False
            print(f"  DIFFERS  {name}")
            for d in diffs:
                print(f"             {d}")
        else:
            print(f"  same     {name}")
    for file in sorted(os.listdir(against)):
        stem, ext = os.path.splitext(file)
        if ext == ".json" and stem not in names:
            print(f"  missing  {stem} (committed, not recorded by this run)")
    return same


def record(r, ns, admitter, quick):
    first, second, never = ns
    s, listed, _, _ = r.call("GET", "/namespaces")
    if s != 200 or not isinstance(listed, dict) or listed.get("data"):
        raise SystemExit(f"record-merod: the node must hold no namespace yet (GET /namespaces: {s} {listed})")

    r.rec("health", "GET", "/health")
    r.rec("ready", "GET", "/ready")
    r.rec("peers", "GET", "/peers")
    r.rec("identity-before-join", "GET", "/identity",
          note="before the node takes part in any namespace")
    r.rec("namespaces-list-empty", "GET", "/namespaces")
    r.rec("namespace-get-never-joined", "GET", f"/namespaces/{first}")
    r.rec("group-members-never-joined", "GET", f"/groups/{first}/members?offset=0&limit=1000",
          note="the member list of a namespace this node is not in")
    r.rec("group-contexts-never-joined", "GET", f"/groups/{first}/contexts?offset=0&limit=1000",
          note="the contexts of a namespace this node is not in")
    r.rec("attest", "POST", "/tee/attest", {"nonce": NONCE},
          note="the public quote route; report data is the nonce then 32 zero bytes")
    r.rec("attest-short-nonce", "POST", "/tee/attest", {"nonce": "abcd"})
    r.rec("registration-attest", "POST", "/tee/registration-attest", {"nonce": NONCE},
          note="404 on a core without the route: the caller falls back to /tee/attest")

    s, body = r.rec("fleet-join-admitted", "POST", "/tee/fleet-join", {"groupId": first},
                    note="first admission of a mock-TEE replica; the verifier's policy accepts the mock MRTD")
    if s != 200 or not (isinstance(body, dict) and body.get("admitted") is True):
        raise SystemExit(f"record-merod: the first namespace was not admitted ({s} {body}): "
                         "does its admission policy accept this node's quote?")
    r.rec("fleet-join-already-admitted", "POST", "/tee/fleet-join", {"groupId": first},
          note="an already-admitted namespace answers at once")
    r.rec("identity-after-join", "GET", "/identity")
    r.rec("namespace-get-member", "GET", f"/namespaces/{first}")
    r.rec("group-members-member", "GET", f"/groups/{first}/members?offset=0&limit=1000",
          note="the member list of a namespace this node was admitted to")
    # The context inventory's walk: subgroups, contexts, the node's capabilities, usage.
    _, ident, _, _ = r.call("GET", "/identity")
    account = ((ident or {}).get("data") or {}).get("accountId", "") if isinstance(ident, dict) else ""
    r.rec("group-subgroups-member", "GET", f"/groups/{first}/subgroups",
          note="the direct subgroups of a namespace this node was admitted to (unpaged)")
    r.rec("group-contexts-member", "GET", f"/groups/{first}/contexts?offset=0&limit=1000",
          note="the contexts of a namespace this node was admitted to")
    r.rec("group-capabilities-member", "GET", f"/groups/{first}/members/{account}/capabilities",
          note="this node's capability bits in a namespace it was admitted to")
    r.rec("usage-member", "GET", "/usage",
          note="the storage of every namespace held, one row each")
    # The recovery envelopes: the accounts' devices, and the seal route (0.11.0-rc.34 on).
    r.rec("group-member-devices-member", "GET", f"/groups/{first}/member-devices?offset=0&limit=1000",
          note="the devices a member (not an admin) sees: its own account's only")
    r.rec("seal-member", "POST", f"/groups/{first}/accounts/{account}/seal", {"plaintext": "7b7d"},
          note="sealing to the node's own account: 404 with no body on a core without the route")

    join = {"groupId": second, "admitterAddrs": [admitter] if admitter else []}
    s, body = r.rec("fleet-join-admitter-addrs", "POST", "/tee/fleet-join", join,
                    note="fleet-join naming the verifier to ask first")
    if not (s == 200 and isinstance(body, dict) and body.get("admitted") is True):
        s, body, _, _ = r.call("POST", "/tee/fleet-join", {"groupId": second})
        print(f"  (joined the second namespace without admitterAddrs: {s})")
    r.rec("namespaces-list-member", "GET", "/namespaces")
    r.rec("namespaces-list-page-1", "GET", "/namespaces?offset=0&limit=1",
          note="two namespaces held, one a page")
    r.rec("namespaces-list-page-2", "GET", "/namespaces?offset=1&limit=1")
    r.rec("namespaces-list-page-end", "GET", "/namespaces?offset=2&limit=1",
          note="past the end: an empty page ends the listing")

    r.rec("fleet-join-snake-case-body", "POST", "/tee/fleet-join", {"group_id": first},
          note="the body field is camelCase groupId; snake_case is refused")
    r.rec("fleet-join-short-id", "POST", "/tee/fleet-join", {"groupId": "abcd"})
    r.rec("fleet-join-non-hex-id", "POST", "/tee/fleet-join", {"groupId": "zz" * 32})
    r.rec("fleet-join-no-content-type", "POST", "/tee/fleet-join",
          json.dumps({"groupId": first}).encode(), content_type=None)

    r.rec("namespace-leave-member", "POST", f"/namespaces/{first}/leave", b"", content_type=None,
          note="self-leave of a ReadOnlyTee replica: MemberLeft published, keys purged")
    r.rec("namespace-leave-again", "POST", f"/namespaces/{first}/leave", b"", content_type=None,
          note="already left")
    r.rec("namespace-get-after-leave", "GET", f"/namespaces/{first}")
    r.rec("namespaces-list-after-leave", "GET", "/namespaces",
          note="the second namespace is still held")
    r.rec("group-members-after-leave", "GET", f"/groups/{first}/members?offset=0&limit=1000")
    r.rec("identity-after-leave", "GET", "/identity")
    r.rec("namespace-leave-never-joined", "POST", f"/namespaces/{never}/leave", b"", content_type=None)
    r.rec("namespace-leave-bad-id", "POST", "/namespaces/xyz/leave", b"", content_type=None)
    r.rec("namespace-leave-unknown", "POST", f"/namespaces/{UNKNOWN}/leave", b"", content_type=None)
    if not quick:
        r.rec("fleet-join-unknown-namespace", "POST", "/tee/fleet-join", {"groupId": UNKNOWN},
              note="a well-formed id no verifier answers for: after merod's admission wait")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("admin_url")
    p.add_argument("out_dir")
    p.add_argument("--namespace", action="append", default=[])
    p.add_argument("--admitter-addr")
    p.add_argument("--lab")
    p.add_argument("--against", default=os.path.join(here, "..", "fixtures", "merod"))
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    namespaces, admitter = args.namespace, args.admitter_addr
    if args.lab:
        with open(os.path.join(args.lab, "lab.json")) as f:
            lab = json.load(f)
        namespaces = namespaces or lab["namespaces"]
        admitter = admitter or lab.get("admitter_addr")
    if len(namespaces) < 3:
        p.error("three namespaces are needed (--namespace three times, or --lab)")
    os.makedirs(args.out_dir, exist_ok=True)
    r = Recorder(args.admin_url, args.out_dir)
    print(f"Recording {args.admin_url} into {args.out_dir}:")
    try:
        record(r, namespaces[:3], admitter, args.quick)
    except (OSError, urllib.error.URLError) as e:
        print(f"record-merod: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if compare(args.out_dir, os.path.abspath(args.against), r.names) else 1)


if __name__ == "__main__":
    main()
