#!/usr/bin/env python3
"""Plots CPU per idle cycle against namespaces (log-log), daemon vs the Bash reference, from
bench/cpu-vs-namespaces.tsv (written by scripts/bench-vs-reference.sh) to
bench/cpu-vs-namespaces.svg. Standard library only: the SVG is written by hand.

Usage: python3 bench/plot.py [TSV] [SVG]
"""
import csv
import math
import sys

src = sys.argv[1] if len(sys.argv) > 1 else "bench/cpu-vs-namespaces.tsv"
dst = sys.argv[2] if len(sys.argv) > 2 else "bench/cpu-vs-namespaces.svg"

rows = list(csv.DictReader(open(src), delimiter="\t"))
series = [
    ("fleet-sidecar (release)", "daemon_cpu_ms_per_poll", "#1f77b4"),
    ("Bash reference (curl + python3)", "reference_cpu_ms_per_poll", "#d62728"),
]
points = {
    name: [(int(r["namespaces"]), float(r[key])) for r in rows if float(r[key]) > 0]
    for name, key, _ in series
}
xs = [x for pts in points.values() for x, _ in pts]
ys = [y for pts in points.values() for _, y in pts]
x0, x1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
W, H, L, R, T, B = 640, 420, 70, 20, 40, 60


def px(x):
    return L + (math.log10(x) - x0) / max(x1 - x0, 1) * (W - L - R)


def py(y):
    return H - B - (math.log10(y) - y0) / max(y1 - y0, 1) * (H - T - B)


out = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
    f'<rect width="{W}" height="{H}" fill="white"/>',
    f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">CPU per idle cycle vs namespaces (log-log)</text>',
]
for e in range(x0, x1 + 1):
    x = px(10**e)
    out.append(f'<line x1="{x}" y1="{T}" x2="{x}" y2="{H - B}" stroke="#ddd"/>')
    out.append(f'<text x="{x}" y="{H - B + 16}" text-anchor="middle">{10**e:,}</text>')
for e in range(y0, y1 + 1):
    y = py(10**e)
    out.append(f'<line x1="{L}" y1="{y}" x2="{W - R}" y2="{y}" stroke="#ddd"/>')
    out.append(f'<text x="{L - 6}" y="{y + 4}" text-anchor="end">{10.0**e:g}</text>')
out.append(f'<text x="{W / 2}" y="{H - 20}" text-anchor="middle">namespaces confirmed</text>')
out.append(
    f'<text x="16" y="{H / 2}" text-anchor="middle" transform="rotate(-90 16 {H / 2})">CPU ms per poll</text>'
)
for i, (name, _, color) in enumerate(series):
    pts = points[name]
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
    for x, y in pts:
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{color}"/>')
        out.append(f'<text x="{px(x) + 6:.1f}" y="{py(y) - 6:.1f}" font-size="10">{y:g}</text>')
    out.append(f'<rect x="{L + 10}" y="{T + 8 + i * 18}" width="12" height="3" fill="{color}"/>')
    out.append(f'<text x="{L + 28}" y="{T + 13 + i * 18}">{name}</text>')
out.append("</svg>")
open(dst, "w").write("\n".join(out) + "\n")
print(f"wrote {dst}")
