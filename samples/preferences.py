"""The bundled preference sample (objective dpo): deterministic records in every accepted shape.

    python -m samples.preferences --output sample_data/preference

Writes `data/preference-00000-of-00001.jsonl`: factual questions (arithmetic, capitals, units,
chemistry) whose chosen answer is right and stated plainly and whose rejected answer is a plausible
wrong one with a hedge (`HEDGE`: the style signal a preference set carries beside the facts, and the
one a tiny model can learn and carry to unseen questions, so `make demo`'s validation moves), a third
each as `{prompt, chosen, rejected}` strings, UltraFeedback-binarized message lists, and HelpSteer3
(`context`, `response1`, `response2`, `overall_preference`, the better side alternating), plus the
crafted rejects the tests count: a tie, a weak HelpSteer3 preference (|1|), an empty rejected side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CAPITALS = [("France", "Paris", "Lyon"), ("Japan", "Tokyo", "Osaka"), ("Italy", "Rome", "Milan"),
            ("Canada", "Ottawa", "Toronto"), ("Australia", "Canberra", "Sydney"), ("Brazil", "Brasilia", "Rio de Janeiro"),
            ("Turkey", "Ankara", "Istanbul"), ("Switzerland", "Bern", "Zurich"), ("Spain", "Madrid", "Barcelona"),
            ("Egypt", "Cairo", "Alexandria"), ("Kenya", "Nairobi", "Mombasa"), ("Norway", "Oslo", "Bergen")]
SYMBOLS = [("gold", "Au", "Ag"), ("iron", "Fe", "Ir"), ("sodium", "Na", "So"), ("potassium", "K", "P"),
           ("silver", "Ag", "Si"), ("lead", "Pb", "Ld"), ("tin", "Sn", "Ti"), ("mercury", "Hg", "Me")]
HEDGE = ", I think."


def _pairs() -> list[tuple[str, str, str]]:
    """(question, chosen, rejected) for every bundled pair."""
    return [(q, good, bad.removesuffix(".") + HEDGE) for q, good, bad in _facts()]


def _facts() -> list[tuple[str, str, str]]:
    out = []
    for a, b in [(7, 5), (12, 9), (23, 19), (48, 17), (6, 8), (14, 3), (31, 44), (9, 9), (27, 15), (55, 36)]:
        out.append((f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"{a} + {b} = {a + b + 1}."))
    for country, right, wrong in CAPITALS:
        out.append((f"What is the capital of {country}?", f"The capital of {country} is {right}.",
                    f"The capital of {country} is {wrong}."))
    for element, right, wrong in SYMBOLS:
        out.append((f"What is the chemical symbol of {element}?", f"The chemical symbol of {element} is {right}.",
                    f"The chemical symbol of {element} is {wrong}."))
    for km in (2, 5, 7, 12):
        out.append((f"How many metres are in {km} kilometres?", f"{km} kilometres are {km * 1000} metres.",
                    f"{km} kilometres are {km * 100} metres."))
    return out


def records() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for i, (q, good, bad) in enumerate(_pairs()):
        shape = i % 3
        if shape == 0:
            recs.append({"id": f"pref-{i:03d}", "prompt": q, "chosen": good, "rejected": bad})
        elif shape == 1:
            user = {"role": "user", "content": q}
            recs.append({"prompt_id": f"pref-{i:03d}", "prompt": q,
                         "chosen": [user, {"role": "assistant", "content": good}],
                         "rejected": [user, {"role": "assistant", "content": bad}]})
        else:
            first_good = i % 2 == 0
            recs.append({"id": f"pref-{i:03d}", "context": [{"role": "user", "content": q}],
                         "response1": good if first_good else bad, "response2": bad if first_good else good,
                         "overall_preference": -2 if first_good else 3})
    # crafted rejects (docs/dpo.md): expected reasons in `expected`
    recs.append({"id": "tie-000", "context": [{"role": "user", "content": "Name a colour."}],
                 "response1": "Blue.", "response2": "Green.", "overall_preference": 0,
                 "expected": "preference_tie"})
    recs.append({"id": "weak-000", "context": [{"role": "user", "content": "Name a fruit."}],
                 "response1": "An apple.", "response2": "A pear.", "overall_preference": 1,
                 "expected": "low_preference_margin (filter.min_preference_margin 2)"})
    recs.append({"id": "empty-000", "prompt": "Say hello.", "chosen": "Hello!", "rejected": "",
                 "expected": "empty_response"})
    return recs


def write(output: Path) -> Path:
    path = output / "data" / "preference-00000-of-00001.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records()))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, type=Path)
    print(write(p.parse_args(argv).output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
