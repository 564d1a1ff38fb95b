"""Render the benchmark's JSON results (one file per row, from train_throughput.py) as a markdown
table with ratios against the two baselines of the same run. Usage: ``report.py DIR [DIR...]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_rows(dirs: list[str]) -> list[dict]:
    rows = []
    for d in dirs:
        for f in sorted(Path(d).glob("row_*.json")):
            rows.append(json.loads(f.read_text()))
    return rows


def fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def settings_of(r: dict) -> str:
    a = r["args"]
    if r["setup"] in ("pipeline", "trainer"):
        s = (f"{a['stages']} stages, mb {a['micro_batch']} × m {a['grad_accum']}, attn {a['attention']}, "
             f"kernels {a['kernels']}, ckpt {a['act_ckpt']}, {a['docs']} docs")
        if r["setup"] == "trainer":
            s += f", {a.get('grad_accum_dtype', 'fp32')} accum"
    else:
        s = (f"mb {a['micro_batch']}{' × ' + str(a['grad_accum']) if a['grad_accum'] > 1 else ''}, "
             f"{a['hf_attention']}, window {a['sliding_window']}, ckpt {a['act_ckpt']}"
             f"{', liger' if a.get('hf_liger') else ''}, {a.get('docs', 'packed')} docs")
    return s


def checkpoint_cell(c: dict | None) -> str:
    if not c:
        return "–"
    return f"{c['save_stall_s']:.1f} s ({c['stall_share_at_every']:.2%} at {c['checkpoint_every']})"


def table(rows: list[dict]) -> str:
    # ratios against the baseline rows named after their setup (first one of each setup otherwise)
    base: dict[str, float] = {}
    for r in sorted(rows, key=lambda r: r["label"] != r["setup"]):
        if r["setup"] in ("hf_single", "hf_zero2"):
            base.setdefault(r["setup"], r["tokens_per_s_per_gpu"])
    # issue 16's ratio: against the best strong peer (ZeRO-2 / FSDP2, not a legacy row) on the same docs
    peers: dict[str, float] = {}
    for r in rows:
        if r["setup"] in ("hf_zero2", "fsdp2") and not r["label"].startswith("legacy"):
            docs = r["args"].get("docs", "packed")
            peers[docs] = max(peers.get(docs, 0.0), r["tokens_per_s_per_gpu"])
    # baselines first, then the pipeline rows from fastest to slowest
    rows = sorted(rows, key=lambda r: (r["setup"] in ("pipeline", "trainer"), r["label"] != r["setup"],
                                       -r["tokens_per_s_per_gpu"]))
    head = ("| setup | settings | tok/s/GPU | MFU | × 1-GPU HF | × ZeRO-2 HF | peak alloc GiB/GPU | tokens/kJ "
            "| bubble+comm share (stage 0/1) | analytic bubble | data-load share (GPU) | doc-aware MFU "
            "| × best ZeRO-2/FSDP2 | ckpt save stall (share at every) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tps = r["tokens_per_s_per_gpu"]
        peak = r.get("peak_alloc_gib_max")
        bub = r.get("bubble_share")
        stall = r.get("data_stall_share")
        lines.append(
            f"| {r['label']} | {settings_of(r)} | {tps:,.0f} | {r['mfu']:.1%} "
            f"| {fmt(tps / base['hf_single'] if 'hf_single' in base else None, '.2f')} "
            f"| {fmt(tps / base['hf_zero2'] if 'hf_zero2' in base else None, '.2f')} "
            f"| {fmt(peak, '.1f')} | {fmt(r.get('tokens_per_kj'), ',.0f')} "
            f"| {' / '.join(f'{b:.1%}' for b in bub) if bub else '–'} "
            f"| {fmt(r.get('analytic_bubble'), '.1%')} "
            f"| {' / '.join(f'{s:.2%}' for s in stall) if stall else '–'} "
            f"| {fmt(r.get('doc_mfu'), '.1%')} "
            f"| {fmt(tps / peers[docs] if (docs := r['args'].get('docs', 'packed')) in peers else None, '.2f')} "
            f"| {checkpoint_cell(r.get('checkpoint'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    rows = load_rows(argv)
    if not rows:
        print("no row_*.json results found")
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
