"""Builders for the DPO tests: preference pairs rendered by the filter's own code (Mistral v1), packed
one pair per row, and TRL's DPO computation on the same tiny model and pairs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch

QUESTIONS = [("What is 7 + 5?", "7 + 5 = 12.", "7 + 5 = 13, I think, but maybe 14."),
             ("Capital of France?", "Paris.", "The capital of France is Lyon."),
             ("Symbol of gold?", "The chemical symbol of gold is Au.", "Ag."),
             ("How many metres in 2 km?", "2000 metres.", "200 metres, since a kilometre is 100 metres."),
             ("Name a planet.", "Mars is a planet of the solar system.", "The Moon."),
             ("What is 9 x 9?", "81.", "9 x 9 = 99.")]


def rendered_pairs(seq_len: int = 128, n: int = len(QUESTIONS)):
    """[(chosen (ids, labels), rejected (ids, labels))] through `render_docs.render_pair`."""
    import numpy as np

    from pipeline_core.config import FilterSection
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter.filter_rows import conversation_options
    from spark_jobs.filter.render_docs import render_pair

    fcfg = FilterSection(objective="dpo", seq_len=seq_len)
    tok = load_tokenizer(fcfg.tokenizer)
    rec = SimpleNamespace(metadata=None, reasoning=None)
    out = []
    for q, good, bad in QUESTIONS[:n]:
        doc, cut = render_pair([{"role": "user", "content": q}, {"role": "assistant", "content": good}], bad, rec, tok,
                               fcfg, conversation_options(fcfg))
        out.append(((doc.input_ids[:cut], doc.labels[:cut]), (doc.input_ids[cut:], doc.labels[cut:])))
        assert np.all(doc.labels[:cut][-1] == tok.eos_id)
    return out


def pair_rows(pairs, seq_len: int, pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, labels, position_ids) int64 tensors, one row per pair (spark_jobs.preference.pair_row)."""
    from spark_jobs.preference import pair_row

    rows = []
    for chosen, rejected in pairs:
        ids, labels, pos = pair_row(chosen, rejected, seq_len, pad_id)
        rows.append((torch.from_numpy(ids).long(), torch.from_numpy(labels).long(), torch.from_numpy(pos).long()))
    return rows


def hf_side_logps(model, pairs) -> torch.Tensor:
    """[P, 2] summed log-probs of each side's trained tokens, each side alone through transformers."""
    out = []
    for side in pairs:
        vals = []
        for ids, labels in side:
            ids_t = torch.as_tensor(ids, dtype=torch.long)[None]
            lab = torch.as_tensor(labels, dtype=torch.long)[None]
            logits = model(input_ids=ids_t, use_cache=False).logits[:, :-1].float()
            tgt = lab[:, 1:]
            mask = tgt != -100
            lp = torch.log_softmax(logits, -1).gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
            vals.append((lp * mask).sum())
        out.append(torch.stack(vals))
    return torch.stack(out)


def trl_dpo(model, pairs, ref: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
            label_smoothing: float = 0.0) -> dict:
    """TRL 1.x `DPOTrainer._compute_loss` (its concatenated forward through `add_fused_lm_head` and its
    loss and reward metrics) on the pairs, padded TRL's way ([chosen..., rejected...] batch,
    completion_mask = the trained tokens), reference log-probs precomputed (`ref` [P, 2])."""
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(model, "_mft_fused", False):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        model._mft_fused = True
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    for i, (a, lab) in enumerate(seqs):
        n = len(a)
        ids[i, :n] = torch.as_tensor(a, dtype=torch.long)
        attn[i, :n] = 1
        comp[i, :n] = torch.as_tensor(lab) != -100
    metrics: dict = defaultdict(lambda: defaultdict(list))
    accel = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    me = SimpleNamespace(model=model, accelerator=accel, aux_loss_enabled=False, ld_alpha=None,
                         precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                         loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
                         _metrics=metrics, _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp,
              "ref_chosen_logps": ref[:, 0].float(), "ref_rejected_logps": ref[:, 1].float()}
    loss = DPOTrainer._compute_loss(me, model, inputs, return_outputs=False)
    m = metrics["train" if model.training else "eval"]
    return {"loss": float(loss), "reward_accuracy": m["rewards/accuracies"][-1],
            "chosen_reward": m["rewards/chosen"][-1], "rejected_reward": m["rewards/rejected"][-1],
            "reward_margin": m["rewards/margins"][-1], "logps_chosen": m["logps/chosen"][-1],
            "logps_rejected": m["logps/rejected"][-1]}


def dpo_run(store: str, tmp_path, name: str, acc: float, margin: float, ref: str, storage=None) -> tuple[str, str]:
    """A DPO run's committed model and report (val reward accuracy and margin, reference) under
    `<store>/runs/<name>/`, as the trainer leaves them for the promotion gate: (run URI, model URI)."""
    from pipeline_core import layout, uris
    from pipeline_core.artifacts import publish_artifact

    run = uris.join(store, "runs", name)
    (tmp_path / name / "model" / "data").mkdir(parents=True)
    (tmp_path / name / "model" / "data" / "config.json").write_text("{}")
    (tmp_path / name / "report" / "data").mkdir(parents=True)
    (tmp_path / name / "report" / "data" / "summary.json").write_text("{}")
    publish_artifact(tmp_path / name / "model", layout.model_uri(run), kind="model", counts={}, storage=storage)
    publish_artifact(tmp_path / name / "report", layout.report_uri(run), kind="report", counts={}, storage=storage,
                     extra={"eval_reward_accuracy": acc, "eval_reward_margin": margin, "reference_uri": ref})
    return run, layout.model_uri(run)
