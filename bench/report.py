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
            s += f", {a.get('grad_accum_dtype', 'fp32')} accum, seq {a.get('seq_len', '?')}, window {a['sliding_window']}"
            res = r.get("settings", {}).get("extra", {}).get("resolved", {})
            if res.get("recompute"):
                every = f" {res['recompute_every']}" if res["recompute"] == "every_n" else ""
                s += f", recompute {a.get('recompute')}→{res['recompute']}{every} (est. {res.get('estimated_stage_gib')} GiB)"
    else:
        s = (f"mb {a['micro_batch']}{' × ' + str(a['grad_accum']) if a['grad_accum'] > 1 else ''}, "
             f"{a['hf_attention']}, window {a['sliding_window']}, ckpt {a['act_ckpt']}"
             f"{', liger' if a.get('hf_liger') else ''}, {a.get('docs', 'packed')} docs")
    return s


def checkpoint_cell(c: dict | None) -> str:
    if not c:
        return "–"
    first = f"first {c['first_save_stall_s']:.1f} s, then " if "first_save_stall_s" in c else ""
    return f"{first}{c['save_stall_s']:.1f} s ({c['stall_share_at_every']:.2%} at {c['checkpoint_every']})"


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


def one_gpu_table(rows: list[dict]) -> str:
    """Issue 17's view: each row against the two single-GPU HF loops of the same micro-batch shape
    (pure bf16: ``--master bf16``; fp32 master weights: ``--master fp32``), same run."""
    def shape(r):
        return r["args"]["micro_batch"], r["args"]["grad_accum"]

    base = {}
    for r in rows:
        if r["setup"] == "hf_single":
            base.setdefault((r["args"]["master"], shape(r)), r["tokens_per_s_per_gpu"])
    lines = ["| row | mb × m | tok/s | MFU | × HF pure bf16 | × HF fp32 master | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (shape(r), r["setup"] != "hf_single", -r["tokens_per_s_per_gpu"])):
        tps = r["tokens_per_s_per_gpu"]
        b16, b32 = base.get(("bf16", shape(r))), base.get(("fp32", shape(r)))
        lines.append(f"| {r['label']} | {shape(r)[0]} × {shape(r)[1]} | {tps:,.0f} | {r['mfu']:.1%} "
                     f"| {fmt(tps / b16 if b16 else None, '.3f')} | {fmt(tps / b32 if b32 else None, '.3f')} "
                     f"| {fmt(r.get('peak_alloc_gib_max'), '.1f')} |")
    return "\n".join(lines)


def moving_mean(x: list[float], window: int) -> list[float]:
    """Trailing means over ``window`` steps (one value per full window)."""
    return [sum(x[i - window + 1:i + 1]) / window for i in range(window - 1, len(x))]


def parity_table(rows: list[dict], floor: float = 0.5, window: int = 10) -> str:
    """Loss parity of long rows (>= 100 steps, e.g. FP8 vs bf16), against the bf16 row (``fp8`` off) of
    the same slice and data, step by step and over ``window``-step moving means: the mean and largest
    relative difference over the steps where the bf16 loss is still >= ``floor`` (a curve that falls
    to ~0 makes later ratios meaningless), the mean over the last 50 steps, and the last loss."""
    long = [r for r in rows if len(r.get("losses") or []) >= 100]

    def key(r):
        return r["args"]["layers"], r["args"].get("data")

    ref = {key(r): r["losses"] for r in long if r["args"].get("fp8", "off") == "off"}
    if not long or not ref:
        return ""
    lines = [f"| row | steps | first loss | rel. diff per step while bf16 >= {floor} (mean / max) "
             f"| {window}-step means (mean / max) | last 50 steps (mean) | last loss |",
             "|---|---|---|---|---|---|---|"]
    for r in long:
        loss, base = r["losses"], ref.get(key(r)) or []
        n = min(len(loss), len(base))
        steps = [i for i in range(n) if base[i] >= floor]
        rel = [(loss[i] - base[i]) / base[i] for i in steps]
        sl, sb = moving_mean(loss[:n], window), moving_mean(base[:n], window)
        srel = [(a - b) / b for a, b in zip(sl, sb, strict=True) if b >= floor]
        last = [(loss[i] - base[i]) / base[i] for i in range(max(0, n - 50), n) if base[i] >= floor]

        def mm(v):
            return f"{sum(v) / len(v):+.2%} / {max(v, key=abs):+.2%}" if v else "–"

        lines.append(f"| {r['label']} | {len(loss)} | {loss[0]:.4f} | {mm(rel)} | {mm(srel)} "
                     f"| {f'{sum(last) / len(last):+.2%}' if last else '–'} | {loss[-1]:.4f} |")
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
    print()
    print(one_gpu_table(rows))
    parity = parity_table(rows)
    if parity:
        print()
        print(parity)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
