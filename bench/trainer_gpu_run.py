"""The user's path on one GPU, end to end: ``training/train.py`` itself (torchrun, the repo's own
ds_config.json and defaults), on a Mistral-7B-width model with fewer layers, packed rows, a
checkpoint, a SIGKILL and a resume, the export, and ``AutoModelForCausalLM.from_pretrained`` of it.
A second run measures the same without fp32 gradient accumulation.

    python bench/trainer_gpu_run.py --out DIR [--layers 4] [--steps 8] [--work /dev/shm/mft]

Writes DIR/trainer_gpu.json (per run: tokens/s, MFU, peak memory, losses, what happened) and the
train.py logs. Weights are random (no download); the data is random tokens packed into documents.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.launch import kill_tree, process_env, standalone_argv  # noqa: E402  (the product's launcher)

TOKENIZER_FILE = REPO / "bench" / "assets" / "tokenizer.model.v1"  # copied from mistral-common


def make_model(out: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaTokenizer, MistralConfig, MistralForCausalLM

    if (out / "config.json").exists():
        return out
    cfg = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = MistralForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="2GB")
    tmp = out / "_tok"
    tmp.mkdir()
    shutil.copy(TOKENIZER_FILE, tmp / "tokenizer.model")
    LlamaTokenizer.from_pretrained(str(tmp), add_bos_token=True, add_eos_token=False).save_pretrained(str(out))
    shutil.copy(TOKENIZER_FILE, out / "tokenizer.model")
    shutil.rmtree(tmp)
    return out


def make_data(store_uri: str, local: Path, seq_len: int, rows: int, val_rows: int) -> str:
    """Random-token documents filling `rows` + `val_rows` rows, through the product writer
    (spark_jobs/filter/train_ready.py)."""
    import numpy as np

    from pipeline_core import uris
    from pipeline_core.artifacts import read_manifest
    from pipeline_core.handoffs import IGNORE_INDEX, TokenizerSpec
    from spark_jobs.filter.train_ready import document, write_train_ready

    uri = uris.join(store_uri, "datasets", "gpu", "train", f"seq{seq_len}")
    if read_manifest(uri) is not None:
        return uri
    rng = np.random.default_rng(0)

    def documents(n):  # each row's documents fill it exactly; packed one row's worth at a time
        out, sizes = [], []
        for _ in range(n):
            sizes.append(0)
            used = 0
            while used < seq_len:
                doc = int(min(rng.integers(seq_len // 32, seq_len // 2), seq_len - used))
                toks = rng.integers(3, 32000, doc).tolist()
                out.append(document(toks, [IGNORE_INDEX] * (doc // 3) + toks[doc // 3:]))  # prompt third: no loss
                used += doc
                sizes[-1] += 1
        return out, sizes

    spec = TokenizerSpec(name="mistral-v1", vocab_size=32000, bos_id=1, eos_id=2,
                         chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (train, train_sizes), (val, val_sizes) = documents(rows), documents(val_rows)
    write_train_ready(uri, local, {"train": train, "val": val}, seq_len=seq_len, tokenizer=spec, pad_id=0,
                      buffers={"train": train_sizes, "val": val_sizes})
    return uri


def metrics_of(run_uri: str, staging: Path, run_id: str) -> dict:
    from pipeline_core import uris
    from training.metrics import read_csv

    report = uris.to_local_path(run_uri) / "report" / "data"
    rows = read_csv(report / "metrics.csv")
    summary = json.loads((report / "summary.json").read_text())
    steady = [r for r in rows[2:] if not r["skipped"]]  # warm-up steps out
    tps = sorted(r["tokens_per_s"] for r in steady)
    mfus = sorted(r["mfu"] for r in steady)
    return {"rows": rows, "summary": summary, "median_tokens_per_s": tps[len(tps) // 2] if tps else None,
            "median_mfu": mfus[len(mfus) // 2] if mfus else None}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/dev/shm/mft")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--variants", default="fp32_accum,bf16_accum")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from pipeline_core import layout, uris
    from pipeline_core.artifacts import read_manifest
    from pipeline_core.config import load_config

    store = uris.qualify(work / "store")
    model_dir = make_model(work / "base", args.layers)
    rows = args.steps * args.micro_batch * args.grad_accum
    input_uri = make_data(store, work / "ready", args.seq_len, rows, val_rows=16)
    results: dict = {"args": vars(args), "runs": {}}
    env = process_env(cpu=False)
    for variant in args.variants.split(","):
        run_id = f"gpu-{variant}"
        run_uri = uris.join(store, "runs", run_id)
        overrides = {
            "pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(work / "staging"),
            "train.base_model": str(model_dir), "train.pipeline_stages": 1, "train.seq_len": args.seq_len,
            "train.micro_batch_size": args.micro_batch, "train.gradient_accumulation_steps": args.grad_accum,
            "train.steps": args.steps, "train.checkpoint_every": args.steps // 2, "train.keep_last": 1,
            "train.warmup_steps": 2, "train.eval_batches": 4, "train.learning_rate": 1e-5,
            "train.grad_accum_dtype": "fp32" if variant == "fp32_accum" else "bf16",
        }
        cfg_path = work / f"{run_id}.yaml"
        load_config(overrides=overrides).dump(cfg_path)
        r: dict = {"overrides": overrides}
        log1 = out / f"{run_id}-1.log"
        t0 = time.time()
        kill = variant == "fp32_accum"
        with log1.open("w") as log:
            proc = subprocess.Popen(standalone_argv(input_uri, run_uri, cfg_path, nproc=1), env=env, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            first_ckpt = layout.checkpoint_uri(run_uri, args.steps // 2)
            while proc.poll() is None:
                if kill and read_manifest(first_ckpt) is not None:
                    kill_tree(proc)
                    r["killed_after_s"] = time.time() - t0
                    break
                time.sleep(2)
        r["first_rc"] = proc.returncode
        if kill:
            log2 = out / f"{run_id}-2.log"
            with log2.open("w") as log:
                r["resume_rc"] = subprocess.run(standalone_argv(input_uri, run_uri, cfg_path, nproc=1), env=env, cwd=REPO,
                                                stdout=log, stderr=subprocess.STDOUT).returncode
            r["resumed"] = "resumed from" in log2.read_text()
        r["wall_s"] = time.time() - t0
        try:
            r.update(metrics_of(run_uri, work / "staging", run_id))
        except Exception as e:  # noqa: BLE001 - recorded, the next variant still runs
            r["metrics_error"] = repr(e)
        if kill:
            r["export"] = check_export(uris.to_local_path(layout.model_uri(run_uri)) / "data")
        results["runs"][variant] = r
        (out / "trainer_gpu.json").write_text(json.dumps(results, indent=1, default=str))
        shutil.rmtree(uris.to_local_path(run_uri) / "checkpoints", ignore_errors=True)  # room for the next
        shutil.rmtree(work / "staging", ignore_errors=True)
        print(f"RESULT {variant}: {json.dumps({k: r.get(k) for k in ('first_rc', 'resume_rc', 'resumed', 'median_tokens_per_s', 'median_mfu', 'wall_s')})}",
              flush=True)
        if "summary" in r:
            print("summary", json.dumps({k: r["summary"].get(k) for k in ("peak_memory_gib", "eval_loss",
                  "optimizer_wrapper", "grad_accum_dtype", "fast_kernels", "attention_backend", "precision")}))
    return 0


def check_export(export_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.bfloat16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    ids = tok("The capital of France is", return_tensors="pt").input_ids.cuda()
    with torch.no_grad():
        logits = model(ids).logits
    cfg = json.loads((export_dir / "tokenizer_config.json").read_text())
    return {"loaded": True, "finite": bool(torch.isfinite(logits).all()), "params": sum(p.numel() for p in model.parameters()),
            "chat_template_exported": "chat_template" in cfg}


if __name__ == "__main__":
    raise SystemExit(main())
