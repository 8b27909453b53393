#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/ from the project's
own examples: proto/, fixtures/merod/ (recorded merod answers), fixtures/tdx/ (public TDX
vectors), packaging/fleet-sidecar.toml, and a few hand-made edge cases. Run from the repo
root before a first `cargo fuzz run`; the fuzzer then grows and `cmin` minimizes the corpus."""
import hashlib
import json
import pathlib
import struct

root = pathlib.Path(__file__).resolve().parent.parent
corpus = root / "fuzz" / "corpus"
A = "38069a4cc4285c4245c84587ac60084ba53502a8b91c9b108bca40f10ec4d3df"
B = "ab" * 32


def put(target, data):
    if isinstance(data, str):
        data = data.encode()
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


def recorded(name):
    return json.loads((root / "fixtures/merod" / name).read_text())["response"]


# should-join answers
put("should_join", (root / "proto/mdma-should-join.response.json").read_bytes())
for body in [
    {"assignments": []},
    {"assignments": [{"group_id": A}], "retain": [B]},
    {"assignments": [{"group_id": A}, {"group_id": B}], "retain": []},
]:
    put("should_join", json.dumps(body))
put("should_join", '{"assignments":[{"group_id":"%s"}],"retain":[],"assignments":[]}' % A)
put("should_join", '{"assignments":[{"group_id":"%s","group_id":"%s"}]}' % (A, B))

# fleet-join and namespace-get answers: the recorded bodies
for f in sorted((root / "fixtures/merod").glob("*.json")):
    resp = json.loads(f.read_text())["response"]
    body = resp["body"] if isinstance(resp["body"], str) else json.dumps(resp["body"])
    if f.name.startswith("fleet-join"):
        put("fleet_join", body)
    if f.name.startswith("namespace"):
        put("namespace_get", struct.pack(">H", resp["status"]) + body.encode())
put("fleet_join", '{"data":{"admitted":true,"status":"joined"}}')
put("namespace_get", struct.pack(">H", 200) + json.dumps({"data": {"namespaceId": A}}).encode())

# state files
put("state_file", (root / "proto/state-v2.json").read_bytes())
put("state_file", json.dumps([A, B]))
put("state_file", json.dumps({"version": 1, "confirmed": [A]}))
put("state_file", json.dumps({"version": 3}))

# configs
put("sidecar_config", (root / "packaging/fleet-sidecar.toml").read_bytes())
put("sidecar_config", 'mdma_url = "http://127.0.0.1:1"\npoll_interval = "1ms"\n[merod]\nadmin_url = "http://[::1]:2528"\n')
put("merod_config", '[identity]\npeer_id = "12D3KooWJ6X2tBZEd8qKWvJyhtH2v2XyP4eQ9dcU2xZ8Y6YrjcVk"\nkeypair = "x"\n\n[server]\nlisten = ["/ip4/127.0.0.1/tcp/2528"]\n')
put("merod_config", '[server]\nlisten = ["/ip6/::/tcp/2528", "/dns4/node.local/tcp/1"]\n')

# MRTD sources
mrtd = bytes(range(48))
put("sysfs_mrtd", mrtd)
put("sysfs_mrtd", mrtd.hex() + "\n")
put("sysfs_mrtd", b"\x00" * 48)
for f in sorted((root / "fixtures/tdx").glob("*")):
    if f.name.startswith("tdreport"):
        put("tdreport", f.read_bytes())
    elif f.name.startswith("quote"):
        put("quote", f.read_bytes())
report = bytearray(1024)
report[0] = 0x81
report[528:576] = mrtd
put("tdreport", bytes(report))
