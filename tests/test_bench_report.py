"""bench/report.py: the results table, its ratios against the baseline and the strongest peer rows."""

from __future__ import annotations

from bench import report


def test_report_table_ratios_against_the_baseline_rows():
    def row(label, setup, tps, **extra):
        args = {"stages": 2, "micro_batch": 2, "grad_accum": 32, "attention": "torch_varlen", "kernels": "liger",
                "act_ckpt": 0, "docs": "packed", "hf_attention": "sdpa", "sliding_window": "default"}
        return {"label": label, "setup": setup, "tokens_per_s_per_gpu": tps, "mfu": tps / 20_000, "args": args,
                **extra}

    rows = [
        row("pipe", "pipeline", 12_000, bubble_share=[0.07, 0.01], analytic_bubble=1 / 33, peak_alloc_gib_max=89.5),
        row("hf_single_no_window", "hf_single", 8_000),
        row("hf_zero2", "hf_zero2", 6_000),
        row("hf_single", "hf_single", 7_500),
    ]
    lines = report.table(rows).splitlines()
    assert lines[2].startswith("| hf_single |")  # the baseline named after its setup comes first
    pipe = next(line for line in lines if line.startswith("| pipe |"))
    cells = [c.strip() for c in pipe.split("|")]
    assert cells[5] == "1.60" and cells[6] == "2.00"  # vs hf_single (7,500), not the no-window variant
    assert "7.0% / 1.0%" in pipe and "3.0%" in pipe



def test_report_ratio_against_the_best_strong_peer_and_checkpoint_stall():
    def row(label, setup, tps, docs, **extra):
        args = {"stages": 2, "micro_batch": 2, "grad_accum": 32, "attention": "auto", "kernels": "auto",
                "act_ckpt": 0, "docs": docs, "hf_attention": "sdpa", "sliding_window": "none",
                "grad_accum_dtype": "fp32", "hf_liger": True}
        return {"label": label, "setup": setup, "tokens_per_s_per_gpu": tps, "mfu": tps / 20_000, "args": args,
                **extra}

    rows = [
        row("trainer_causal", "trainer", 13_000, "causal",
            checkpoint={"save_stall_s": 40.0, "stall_share_at_every": 0.019, "checkpoint_every": 200}),
        row("zero2_causal", "hf_zero2", 10_000, "causal"),
        row("fsdp2_causal", "fsdp2", 10_400, "causal"),
        row("legacy_zero2_window_ckpt", "hf_zero2", 12_000, "causal"),  # never the peer to beat
        row("trainer_packed", "trainer", 14_000, "packed", doc_mfu=0.5),
        row("fsdp2_packed", "fsdp2", 7_000, "packed"),
    ]
    lines = report.table(rows).splitlines()

    def cells(label):
        return [c.strip() for c in next(x for x in lines if x.startswith(f"| {label} |")).split("|")]

    assert cells("trainer_causal")[13] == "1.25"  # 13,000 / FSDP2's 10,400, not the legacy 12,000
    assert cells("trainer_causal")[14] == "40.0 s (1.90% at 200)"
    assert cells("trainer_packed")[13] == "2.00" and cells("trainer_packed")[12] == "50.0%"
    assert "fp32 accum" in cells("trainer_causal")[2] and "liger" in cells("fsdp2_causal")[2]
