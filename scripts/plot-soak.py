#!/usr/bin/env python3
"""Plots the soak samples (CSV: cycle,seconds,rss_kib,fds) as a small hand-written SVG:
RSS in MiB (left axis, blue) and open fds (right axis, orange) against the cycle count."""
import csv
import sys

src, dst = sys.argv[1], sys.argv[2]
rows = [r for r in csv.DictReader(open(src))]
xs = [int(r["cycle"]) for r in rows]
rss = [int(r["rss_kib"]) / 1024 for r in rows]
fds = [int(r["fds"]) for r in rows]
W, H, L, R, T, B = 640, 320, 60, 50, 30, 40
xmax = max(xs)
rlo, rhi = 0, max(rss) * 1.2
fhi = max(fds) * 1.5


def px(x):
    return L + (W - L - R) * x / xmax


def py(v, hi):
    return H - B - (H - T - B) * v / hi


def path(vals, hi):
    return " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(v, hi):.1f}" for i, (x, v) in enumerate(zip(xs, vals)))


out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W/2}" y="18" text-anchor="middle" font-size="13">fleet-sidecar soak: RSS and open fds per 1,000 cycles</text>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{W-R}" y1="{T}" x2="{W-R}" y2="{H-B}" stroke="black"/>']
for i in range(6):
    v = rhi * i / 5
    out.append(f'<text x="{L-5}" y="{py(v, rhi)+4:.1f}" text-anchor="end">{v:.0f}</text>')
    f = fhi * i / 5
    out.append(f'<text x="{W-R+5}" y="{py(f, fhi)+4:.1f}">{f:.0f}</text>')
    x = xmax * i / 5
    out.append(f'<text x="{px(x):.1f}" y="{H-B+15}" text-anchor="middle">{x:,.0f}</text>')
out.append(f'<text x="{W/2}" y="{H-5}" text-anchor="middle">cycles</text>')
out.append(f'<text x="15" y="{H/2}" transform="rotate(-90 15 {H/2})" text-anchor="middle" fill="#1f77b4">RSS (MiB)</text>')
out.append(f'<text x="{W-10}" y="{H/2}" transform="rotate(90 {W-10} {H/2})" text-anchor="middle" fill="#ff7f0e">open fds</text>')
out.append(f'<path d="{path(rss, rhi)}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
out.append(f'<path d="{path(fds, fhi)}" fill="none" stroke="#ff7f0e" stroke-width="2"/>')
out.append("</svg>")
open(dst, "w").write("\n".join(out) + "\n")
